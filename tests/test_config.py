"""Flags, their HAMI_GUARD_* twins and the checks made before any I/O."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from doctor.settings import DoctorSettings
from doctor.settings import build_parser as doctor_parser
from doctor.settings import parse_settings as doctor_settings
from hami_guard import flags
from hami_guard.envflags import env_name, parse_with_env
from hami_guard.flags import AUTO_DEVICES, DeviceExpectation, Expect
from initcheck.cli import build_parser as initcheck_parser
from sidecar.config import BadConfig, PluginSpec, Settings, parse_settings, read_settings
from sidecar.config import build_parser as sidecar_parser
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME


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
    assert s.expect_devices == AUTO_DEVICES
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
        (["--expect-devices", "many"], {}, "expected a number from 0 to 65536 or auto"),
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


# -- the shared vocabulary, as each of the three programs reads it ----------------------------------------
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "hami-initcheck": initcheck_parser,
    "hami-sidecar": sidecar_parser,
    "hami-doctor": doctor_parser,
}


def usage_error(parser: argparse.ArgumentParser, argv: list[str], environ: dict[str, str], err: Any) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_with_env(parser, argv, environ)
    assert exit_.value.code == 2
    message: str = err.readouterr().err
    assert message.count("\n") == 1, message  # one line, no usage block
    return message


def typed_flags() -> list[tuple[str, str]]:
    """Every flag, of every program, that takes a value of a type other than a plain string."""
    found = []
    for prog, build in PARSERS.items():
        for action in build()._actions:
            if action.type not in (None, str) and action.option_strings:
                found.append((prog, action.option_strings[0]))
    return found


@pytest.mark.parametrize(("prog", "flag"), typed_flags())
@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "1e400", "99999999999"])
def test_every_typed_flag_has_a_range_and_names_itself(
    prog: str, flag: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = usage_error(PARSERS[prog](), [flag, bad], {}, capsys)
    assert message.startswith(f"{prog}: error: argument {flag}: ")


@pytest.mark.parametrize(
    ("prog", "flag", "low", "high"),
    [
        ("hami-sidecar", "--probe-timeout", 0.005, 86400),
        ("hami-sidecar", "--probe-interval", 0.005, 86400),
        ("hami-sidecar", "--polling-interval", 0.005, 86400),
        ("hami-sidecar", "--registration-grace", 0.005, 86400),
        ("hami-doctor", "--probe-timeout", 0.005, 86400),
        ("hami-doctor", "--sample-interval", 0, 3600),
        ("hami-initcheck", "--wait", 0, 86400),
    ],
)
def test_duration_ranges(
    prog: str, flag: str, low: float, high: float, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    for ok in (low, high):
        assert getattr(parse_with_env(PARSERS[prog](), [flag, str(ok)], {}), dest) == ok
    for bad in (low - 0.001, high + 1):
        assert f"argument {flag}: expected seconds from " in usage_error(
            PARSERS[prog](), [flag, str(bad)], {}, capsys
        )
    # The environment twin is checked the same way, and named.
    var = env_name(flag)
    assert f"{var}='nan'" in usage_error(PARSERS[prog](), [], {var: "nan"}, capsys)


@pytest.mark.parametrize("sock", [".", "..", "a/b.sock", "kubelet.sock", "kubelet_internal_checkpoint"])
@pytest.mark.parametrize(
    ("prog", "flag"),
    [
        ("hami-sidecar", "--plugin"),
        ("hami-sidecar", "--plugin-candidates"),
        ("hami-doctor", "--plugin"),
        ("hami-doctor", "--plugin-candidates"),
    ],
)
def test_a_plugin_socket_is_a_file_of_the_folder_not_the_kubelets(
    prog: str, flag: str, sock: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin's socket is a file name in the device-plugins folder: not the folder, its parent, a path,
    nor the kubelet's own socket or checkpoint (a plugin judged on those would read the kubelet's file)."""
    message = usage_error(PARSERS[prog](), [flag, f"vendor.example/gpu={sock}"], {}, capsys)
    assert message.startswith(f"{prog}: error: argument {flag}: ")
    assert repr(f"vendor.example/gpu={sock}") in message
    # The variable the same (a comma-separated list), and a name that merely starts like one is a name.
    var = env_name(flag)
    assert f"{var}=" in usage_error(PARSERS[prog](), [], {var: f"vendor.example/gpu={sock}"}, capsys)
    near = sock.replace("/", "")
    assert parse_with_env(PARSERS[prog](), [flag, f"vendor.example/gpu=.{near}x"], {})


def test_the_kubelets_files_are_the_kubelets_names() -> None:
    assert (Settings().kubelet_socket, CHECKPOINT_NAME) == flags.KUBELET_FILES


def test_doctor_since_takes_units_within_a_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor_settings(["--since", "90"], {}).since == 90
    assert doctor_settings(["--since", "30m"], {}).since == 1800
    assert doctor_settings([], {"HAMI_GUARD_SINCE": "2h"}).since == 7200
    assert doctor_settings(["--since", "7d"], {}).since == 7 * 86400
    for bad in ("soon", "-1h", "nanh", "3651d", "99999999999999999999d", "1e400d", "infd", "0x10"):
        assert "argument --since: " in usage_error(doctor_parser(), ["--since", bad], {}, capsys)


@pytest.mark.parametrize("prog", ["hami-sidecar", "hami-doctor"])
def test_expect_devices_means_the_same_everywhere(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    def expect(argv: list[str]) -> object:
        return parse_with_env(PARSERS[prog](), argv, {}).expect_devices

    assert expect([]) == DeviceExpectation(Expect.ANY)  # absent: at least one healthy device
    assert expect(["--expect-devices", "auto"]) == AUTO_DEVICES == DeviceExpectation(Expect.AUTO)
    assert expect(["--expect-devices", "4"]) == DeviceExpectation(Expect.AT_LEAST, 4)
    assert expect(["--expect-devices", "0"]) == DeviceExpectation(Expect.OFF)  # no devices check
    assert "expected a number from 0 to 65536 or auto" in usage_error(
        PARSERS[prog](), ["--expect-devices", "-1"], {}, capsys
    )


def test_the_sidecar_and_the_doctor_read_their_shared_flags_alike() -> None:
    argv = [
        "--device-plugin-dir", "/k3s/device-plugins",
        "--kubelet-socket", "k.sock",
        "--plugin", "huawei.com/Ascend910B3=Ascend910B3.sock",
        "--pod-resources-socket", "/pr.sock",
        "--probe-timeout", "0.25",
        "--expect-devices", "auto",
        "--device-glob", "/dev/davinci[0-9]*",
    ]  # fmt: skip
    sidecar, doctor = parse_settings(argv, environ={}), doctor_settings(argv, {})
    for name in ("device_plugin_dir", "kubelet_socket", "plugins", "pod_resources_socket", "probe_timeout"):
        assert getattr(sidecar, name) == getattr(doctor, name)
    assert (sidecar.expect_devices, sidecar.device_glob) == (doctor.expect_devices, doctor.device_glob)
    assert sidecar.plugins == (PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock"),)


def test_settings_are_the_single_source_of_defaults() -> None:
    sidecar, doctor = Settings(), DoctorSettings()
    assert doctor_settings([], {}) == doctor
    for name in (
        "device_plugin_dir",
        "kubelet_socket",
        "plugins",
        "pod_resources_socket",
        "probe_timeout",
        "expect_devices",
        "device_glob",
    ):
        assert getattr(doctor, name) == getattr(sidecar, name), name
    initcheck = parse_with_env(initcheck_parser(), [], {})
    assert (initcheck.device_plugin_dir, initcheck.kubelet_socket) == (
        sidecar.device_plugin_dir,
        sidecar.kubelet_socket,
    )
    assert initcheck.kubelet_process_name == doctor.kubelet_process_name == "kubelet"


def test_vocabulary_builds_ranges_for_new_flags() -> None:
    parse = flags.seconds(0.5, 2)
    assert parse("1.5") == 1.5
    for bad in ("0.4", "2.1", "nan", "-inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    count = flags.integer(1, 10)
    assert count("10") == 10
    for bad in ("0", "11", "1.5", "-1", "٣"):
        with pytest.raises(argparse.ArgumentTypeError):
            count(bad)
    with pytest.raises(ValueError, match="0 <= low <= high"):
        flags.seconds(2, 1)


# -- the vendor: its defaults, and settings that work without one -------------------------------------------
RENDER = "/host/dev/dri/renderD[0-9]*"
HANDSHAKE = "hami.io/node-handshake"
BIREN = ("birentech.com/gpu", "birentech.com_gpu")


@pytest.mark.parametrize(
    ("vendor", "plugin", "glob", "port", "handshake"),
    [
        ("amd", ("amd.com/gpu", "amd.com_gpu"), RENDER, 9395, ""),
        ("dcu", ("hygon.com/dcunum", "hygon.com_dcunum"), RENDER, 9395, f"{HANDSHAKE}-dcu"),
        ("biren", BIREN, "/host/dev/biren/card_[0-9]*", 9395, f"{HANDSHAKE}-biren"),
        ("nvidia", ("nvidia.com/gpu", "nvidia-gpu.sock"), "/host/dev/nvidia[0-9]*", 9395, HANDSHAKE),
    ],
)  # fmt: skip
def test_the_vendor_setting_picks_the_defaults(
    vendor: str, plugin: tuple[str, str], glob: str, port: int, handshake: str
) -> None:
    """--vendor (HAMI_GUARD_VENDOR) gives its plugin, its device nodes under --host-dev, its handshake, its
    driver and node configuration, and the sidecar's port; the doctor reads it alike."""
    env = {
        "HAMI_GUARD_VENDOR": vendor,
        "HAMI_GUARD_HOST_DEV": "/host/dev",
        "HAMI_GUARD_EXPECT_DEVICES": "auto",
    }
    s = parse_settings([], environ=env)
    assert (s.vendor, s.plugins, s.device_glob, s.port) == (vendor, (PluginSpec(*plugin),), glob, port)
    assert s.hami_handshake_annotation == handshake == s.hami_handshake(plugin[0])
    assert s.driver_gpus_dir == s.profile.devices.driver_gpus
    assert s.hami_config == ("/config/config.json" if vendor == "nvidia" else "")
    d = doctor_settings([], env)
    assert (d.vendor, d.plugins, d.device_glob) == (vendor, s.plugins, s.device_glob)
    assert d.plugin_process_name == ("nvidia-device-plugin" if vendor == "nvidia" else "k8s-device-plugin")
    assert d.sidecar_status == f"http://127.0.0.1:{port}/status"
    # A flag wins; an explicit setting wins over the vendor's.
    s = parse_settings(["--vendor", "nvidia", "--device-glob", "/d/x*", "--listen", ":9000"], environ=env)
    assert (s.vendor, s.device_glob, s.port) == ("nvidia", "/d/x*", 9000)


def test_the_vendor_follows_the_resource() -> None:
    """Without --vendor, the profile of the first --plugin resource one owns; the hami: keys, the handshake
    and the folds are each resource's vendor's."""
    s = parse_settings(["--plugin", "amd.com/gpu=amd.com_gpu", "--expect-devices", "auto"], environ={})
    assert (s.vendor, s.device_glob) == ("amd", "/dev/dri/renderD[0-9]*")
    mixed = ["--plugin", "acme.example/x=x.sock", "--plugin", "birentech.com/gpu=birentech.com_gpu"]
    s = parse_settings(mixed, environ={})
    assert s.vendor == "biren"
    # A resource no profile owns has no hami: check (it may be no plugin of HAMi's at all)...
    assert s.hami_keys() == (("birentech.com/gpu", "hami.io/node-biren-register"),)
    s = parse_settings(["--plugin", "acme.example/x=x.sock"], environ={})
    assert (s.vendor, s.hami_keys()) == ("nvidia", ())
    # ... unless --vendor says whose it is (HAMi's chart renamed the resource).
    s = parse_settings(["--plugin", "acme.example/x=x.sock", "--vendor", "nvidia"], environ={})
    assert s.hami_keys() == (("acme.example/x", "hami.io/node-nvidia-register"),)
    s = parse_settings(["--plugin", "acme.example/x=x.sock", "--hami-handshake-annotation", "a.io/h"], {})
    assert (s.hami_handshake("acme.example/x"), s.hami_handshake_given) == ("a.io/h", True)


def test_a_register_annotation_in_hamis_legacy_text_has_its_check() -> None:
    """Hygon DCU's register annotation is HAMi's legacy text, which HAMi decodes for DCU
    (DecodeNodeDevices) and so does the hami: check. --hami-annotation still names one explicitly."""
    s = parse_settings(["--vendor", "dcu"], environ={})
    assert s.hami_keys() == (("hygon.com/dcunum", "hami.io/node-dcu-register"),)
    s = parse_settings(["--vendor", "dcu", "--hami-annotation", "hygon.com/dcunum=a.io/r"], environ={})
    assert s.hami_keys() == (("hygon.com/dcunum", "a.io/r"),)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vendor", "ascend"], "--plugin: each node's Ascend plugin registers the resource of its own"),
        (["--vendor", "acme"], "argument --vendor: invalid choice: 'acme'"),
        (
            ["--plugin", "huawei.com/Ascend910B3=Ascend910B3.sock", "--expect-devices", "auto"],
            "--expect-devices auto: the Ascend profile names no device nodes to count; set --device-glob",
        ),
        (["--host-dev", "host/dev"], "--host-dev 'host/dev': an absolute path"),
    ],
)  # fmt: skip
def test_a_vendors_defaults_that_do_not_fit_are_usage_errors(argv: list[str], message: str) -> None:
    got = read_settings(argv, {})
    assert isinstance(got, BadConfig)
    assert message in got.error


def test_ascend_with_its_nodes_resource() -> None:
    """Ascend: the node's resource named, the port past its vNPU metrics' 9395, its handshake per resource,
    and `auto` with a glob of one's own."""
    argv = ["--plugin", "huawei.com/Ascend310P=Ascend310P.sock", "--device-glob", "/dev/davinci[0-9]*"]
    s = parse_settings([*argv, "--expect-devices", "auto"], environ={})
    assert (s.vendor, s.port, s.device_glob) == ("ascend", 9396, "/dev/davinci[0-9]*")
    assert s.hami_keys() == (("huawei.com/Ascend310P", "hami.io/node-register-Ascend310P"),)
    assert s.hami_handshake("huawei.com/Ascend310P") == "hami.io/node-handshake-Ascend310P"
    # A bad configuration with the vendor set still serves where the vendor's pod leaves room.
    got = read_settings(["--bogus"], {"HAMI_GUARD_VENDOR": "ascend"})
    assert isinstance(got, BadConfig) and got.port == 9396


# -- a bad configuration: what hami-sidecar can still read of it ----------------------------------------
@pytest.mark.parametrize(
    ("argv", "env", "listen", "note"),
    [
        (["--probe-interval", "soon", "--listen", "127.0.0.1:9000"], {}, ("127.0.0.1", 9000), ""),
        (["--probe-interval", "soon", "--listen=[::1]:9001"], {}, ("::1", 9001), ""),
        (["--probe-interval", "soon"], {"HAMI_GUARD_LISTEN": "127.0.0.2:9002"}, ("127.0.0.2", 9002), ""),
        # The flag wins over its variable, as when the configuration is good.
        (["--listen", "127.0.0.1:9003", "--bogus"], {"HAMI_GUARD_LISTEN": ":1"}, ("127.0.0.1", 9003), ""),
        # The bad flag is the address itself: the default port, and a note saying so.
        (["--listen", "9395"], {}, ("0.0.0.0", 9395), "--listen '9395' is not ADDR:PORT"),
        ([], {"HAMI_GUARD_LISTEN": "x\ny"}, ("0.0.0.0", 9395), "--listen 'x\\ny' is not ADDR:PORT"),
        (["--listen"], {}, ("0.0.0.0", 9395), ""),
    ],
)
def test_a_bad_configuration_still_gives_the_address_to_serve_it_on(
    argv: list[str], env: dict[str, str], listen: tuple[str, int], note: str
) -> None:
    got = read_settings(argv, env)
    assert isinstance(got, BadConfig)
    assert got.error.startswith("hami-sidecar: error: ")
    assert "\n" not in got.error
    assert (got.host, got.port) == listen
    assert note in got.listen_note
    assert bool(note) == bool(got.listen_note)


def test_a_bad_configuration_keeps_a_readable_log_format_and_level() -> None:
    got = read_settings(["--bogus", "--log-format", "json", "--log-level", "debug"], {})
    assert isinstance(got, BadConfig)
    assert (got.log_format, got.log_level) == ("json", "DEBUG")
    got = read_settings(["--log-format", "xml"], {"HAMI_GUARD_LOG_LEVEL": "loud"})
    assert isinstance(got, BadConfig)
    assert (got.log_format, got.log_level) == (Settings().log_format, Settings().log_level)


def test_a_good_configuration_reads_as_settings() -> None:
    assert read_settings(["--probe-interval", "7"], {}) == parse_settings(["--probe-interval", "7"], {})


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_usage_errors_escape_the_arguments_they_echo(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        PARSERS[prog]().parse_args(["x\nfail: FAKE"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"{prog}: error: ")
    assert "unrecognized arguments: x\\nfail: FAKE" in err


@pytest.mark.parametrize(
    "parse",
    [flags.listen_address, flags.integer(0, 10), flags.numeric_id, flags.expect_devices, flags.octal],
)
def test_a_number_of_thousands_of_digits_is_a_usage_error_not_a_valueerror(
    parse: Callable[[str], Any],
) -> None:
    """int() refuses more than 4300 decimal digits with a ValueError of its own."""
    digits = "7" * 5000
    with pytest.raises(argparse.ArgumentTypeError):
        parse(f":{digits}" if parse is flags.listen_address else digits)


def test_a_listen_port_of_thousands_of_digits_serves_on_the_default() -> None:
    got = read_settings(["--listen", "127.0.0.1:" + "9" * 5000], {})
    assert isinstance(got, BadConfig)
    assert (got.host, got.port) == (Settings().host, Settings().port)


# -- several candidate resources (--plugin-candidates, sidecar.candidates) ----------------------------------
CANDIDATES = "huawei.com/Ascend910B3=Ascend910B3.sock,huawei.com/Ascend310P=Ascend310P.sock"
B3, P = (
    PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock"),
    PluginSpec("huawei.com/Ascend310P", "Ascend310P.sock"),
)


def test_candidates_from_the_variable_or_the_flag_until_one_is_known() -> None:
    """The chart's resources as candidates: no plugin yet, the vendor theirs; once this node's is known,
    the settings are those of --plugin naming it (its annotations, its vendor's handshake)."""
    s = parse_settings(
        ["--hami-annotation", "huawei.com/Ascend910B3=x.io/b3"], {"HAMI_GUARD_PLUGIN_CANDIDATES": CANDIDATES}
    )
    assert (s.plugins, s.plugin_candidates) == ((), (B3, P))
    assert (s.vendor, s.port) == ("ascend", 9396)
    flagged = parse_settings(
        [
            "--plugin-candidates",
            f"{B3.resource}={B3.socket}",
            "--plugin-candidates",
            f"{P.resource}={P.socket}",
        ],
        {},
    )
    assert flagged.plugin_candidates == (B3, P)
    one = s.resolved(P)
    named = parse_settings(["--plugin", f"{P.resource}={P.socket}"], {})
    assert (one.plugins, one.plugin_candidates, one.hami_annotations) == ((P,), (), ())
    assert (
        one.hami_handshake_annotation
        == named.hami_handshake_annotation
        == "hami.io/node-handshake-Ascend310P"
    )
    assert one.hami_keys() == named.hami_keys()
    assert s.resolved(B3).hami_keys() == ((B3.resource, "x.io/b3"),)
    with pytest.raises(ValueError, match="not one of the candidates"):
        s.resolved(PluginSpec("nvidia.com/gpu", "nvidia-gpu.sock"))
    # Resources no profile owns are one kind too: --vendor's (else the default's) settings.
    none = parse_settings(["--vendor", "ascend"], {CAND: "vendor.example/a=a.sock,vendor.example/b=b.sock"})
    assert (none.vendor, len(none.plugin_candidates)) == ("ascend", 2)
    # One candidate is the plugin itself: nothing to learn.
    alone = parse_settings([], {"HAMI_GUARD_PLUGIN_CANDIDATES": f"{P.resource}={P.socket}"})
    assert (alone.plugins, alone.plugin_candidates) == ((P,), ())


CAND = "HAMI_GUARD_PLUGIN_CANDIDATES"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--plugin", f"{P.resource}={P.socket}"], {CAND: CANDIDATES}, "--plugin-candidates with --plugin"),
        (["--dra-driver", "gpu.example.com"], {CAND: CANDIDATES}, "--plugin-candidates with --dra-driver"),
        ([], {CAND: f"{CANDIDATES},huawei.com/Ascend310P=b.sock"}, "a resource is named twice"),
        ([], {CAND: f"{CANDIDATES},huawei.com/Ascend910A=Ascend310P.sock"}, "a socket is named twice"),
        ([], {CAND: "Ascend310P"}, "HAMI_GUARD_PLUGIN_CANDIDATES='Ascend310P'"),
        ([], {CAND: f"{CANDIDATES},nvidia.com/gpu=gpu.sock"}, "Ascend310P (ascend), nvidia.com/gpu (nvidia)"),
        ([], {CAND: f"{CANDIDATES},vendor.example/npu=npu.sock"}, "vendor.example/npu (no vendor profile)"),
        (["--vendor", "ascend"], {CAND: "hygon.com/dcunum=d.sock,x.example/n=n.sock"}, "all of one vendor"),
        (["--vendor", "ascend"], {}, "name this node's (or the chart's, --plugin-candidates), e.g. --plugin"),
    ],
)  # fmt: skip
def test_candidates_that_cannot_be_used_are_a_served_usage_error(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    got = read_settings(argv, env)
    assert isinstance(got, BadConfig)
    assert message in got.error


def test_the_doctor_offers_the_candidates_too(capsys: pytest.CaptureFixture[str]) -> None:
    """hami-doctor takes --plugin-candidates too (doctor/candidates.py): its per-node error offers them."""
    with pytest.raises(SystemExit):
        doctor_settings(["--vendor", "ascend"], {})
    err = capsys.readouterr().err
    assert "each node's Ascend plugin registers the resource of its own hardware" in err
    assert "name this node's (or the chart's, --plugin-candidates)" in err
