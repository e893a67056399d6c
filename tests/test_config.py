"""Flags, their HAMI_GUARD_* twins and the checks made before any I/O."""

from __future__ import annotations

import pytest

from sidecar.config import PluginSpec, Settings, parse_settings


def test_defaults_are_hamis_real_names() -> None:
    s = parse_settings([], environ={})
    assert s == Settings()
    assert s.device_plugin_dir == "/var/lib/kubelet/device-plugins"
    assert s.kubelet_path == "/var/lib/kubelet/device-plugins/kubelet.sock"
    assert s.plugins == (PluginSpec("nvidia.com/gpu", "nvidia-gpu.sock"),)
    assert s.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert (s.host, s.port) == ("0.0.0.0", 9395)
    assert (s.probe_interval, s.probe_timeout, s.registration_grace) == (10.0, 2.0, 60.0)
    assert s.plugin_label == "hami"


def test_every_flag_has_an_environment_twin_and_a_flag_wins() -> None:
    env = {
        "HAMI_GUARD_PROBE_INTERVAL": "5",
        "HAMI_GUARD_PROBE_TIMEOUT": "0.5",
        "HAMI_GUARD_PLUGIN": "nvidia.com/gpu=nvidia-gpu.sock, huawei.com/Ascend910B3=Ascend910B3.sock",
        "HAMI_GUARD_LISTEN": "127.0.0.1:9000",
        "HAMI_GUARD_EXPECT_DEVICES": "auto",
        "HAMI_GUARD_LOG_FORMAT": "json",
    }
    s = parse_settings([], environ=env)
    assert (s.probe_interval, s.probe_timeout, s.host, s.port) == (5.0, 0.5, "127.0.0.1", 9000)
    assert [p.resource for p in s.plugins] == ["nvidia.com/gpu", "huawei.com/Ascend910B3"]
    assert s.expect_devices == -1
    assert s.log_format == "json"
    s = parse_settings(["--probe-interval", "7", "--plugin", "a.com/x=x.sock"], environ=env)
    assert s.probe_interval == 7.0
    assert s.plugins == (PluginSpec("a.com/x", "x.sock"),)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--probe-timeout", "10", "--probe-interval", "5"], {}, "--probe-timeout (10s) must be below"),
        (["--plugin", "gpu"], {}, "expected RESOURCE=SOCKET"),
        (["--plugin", "a.com/x=x.sock", "--plugin", "a.com/x=y.sock"], {}, "named twice"),
        (["--listen", "9395"], {}, "expected ADDR:PORT"),
        (["--expect-devices", "many"], {}, "expected a number from 1 to 65536 or auto"),
        ([], {"HAMI_GUARD_PROBE_INTERVAL": "soon"}, "HAMI_GUARD_PROBE_INTERVAL='soon'"),
        ([], {"HAMI_GUARD_LOG_FORMAT": "xml"}, "expected one of text, json"),
    ],
)
def test_bad_input_is_a_usage_error_naming_it(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_settings(argv, environ=env)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
