"""hami-sidecar as a process: a bad configuration is served, not exited on; usage errors stay one
line; stop signals during start-up; --watch-mode inotify without inotify.

Real processes on loopback ports; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from testing import free_port
from tests.conftest import require_tool
from tests.test_initcheck import catches
from tests.test_serving import _sidecar_argv as sidecar_argv

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_GUARD_")}


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body); (0, "") while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def wait_serving(
    proc: subprocess.Popen[str], port: int, path: str = "/sidecarz/live", timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while get(port, path)[0] != 200:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"nothing served {path}"
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    return proc.returncode, err


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--probe-timeout", "1e-300"], {}, "--probe-timeout"),
        ([], {"HAMI_GUARD_PROBE_INTERVAL": "soon"}, "HAMI_GUARD_PROBE_INTERVAL='soon'"),
        (["x\nfail: FAKE"], {}, "unrecognized arguments: x\\nfail: FAKE"),
        # Candidates of two vendors: the settings would be one vendor's, judging the other's plugin.
        (
            [],
            {"HAMI_GUARD_PLUGIN_CANDIDATES": "huawei.com/Ascend910B=Ascend910B.sock,nvidia.com/gpu=gpu.sock"},
            "--plugin-candidates: all of one vendor profile, or all of none",
        ),
    ],
)
def test_a_bad_configuration_is_served_not_exited_on(
    argv: list[str], env: dict[str, str], named: str, short_tmp: str
) -> None:
    """The plugin's livenessProbe points at this port: an exit would crash-loop into plugin restarts."""
    port = free_port()
    proc = subprocess.Popen(
        sidecar_argv(short_tmp, port, *argv),
        env={**CLEAN_ENV, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_serving(proc, port)
        assert get(port, "/healthz") == (200, "ok")
        assert get(port, "/livez")[0] == 200
        status, body = get(port, "/healthz?verbose")
        assert status == 200
        assert named in body
        for path in ("/readyz", "/readyz/kubelet", "/sidecarz"):
            status, body = get(port, path)
            assert status == 503, path
            assert named in body, path
        status, body = get(port, "/status")
        assert status == 503
        doc = json.loads(body)
        assert named in doc["config_error"].replace("\\\\", "\\")
        assert doc["ready"] is False
        status, body = get(port, "/metrics")
        assert status == 200
        assert "device_plugin_sidecar_config_error 1.0" in body
    finally:
        code, err = stop(proc)
    lines = err.splitlines()
    assert lines[0].startswith("hami-sidecar: error: ")
    assert lines[0].endswith("(see hami-sidecar --help)")
    assert named in lines[0]
    assert not any(line.startswith("fail:") for line in lines)  # the argument's newline stays escaped
    assert "Traceback" not in err
    assert code == 2


def test_help_still_prints_and_exits_0() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "--help"],
        capture_output=True,
        text=True,
        env={**CLEAN_ENV, "HAMI_GUARD_PROBE_INTERVAL": "soon"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    assert result.stdout.startswith("usage: hami-sidecar")
    assert "--listen" in result.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_start_up_is_one_log_line(signum: int, short_tmp: str) -> None:
    """The signal comes while the sidecar still imports grpc and aiohttp (over a second)."""
    port = free_port()
    proc = subprocess.Popen(sidecar_argv(short_tmp, port), env=CLEAN_ENV, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the sidecar never caught SIGTERM"
            time.sleep(0.001)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    (line,) = err.splitlines()
    assert line.endswith(f"stopped by {signal.Signals(signum).name} during start-up")
    assert get(port, "/healthz")[0] == 0  # nothing was served


def test_no_inotify_instance_left_is_named_and_served(short_tmp: str) -> None:
    """In a user namespace of the test's own, with its inotify instance limit at 0."""
    unshare = require_tool("unshare")
    probe = subprocess.run(
        [unshare, "-Ur", "sh", "-c", "echo 0 > /proc/sys/user/max_inotify_instances"],
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot make a user namespace here: {probe.stderr.decode()}")
        pytest.skip(f"cannot make a user namespace here: {probe.stderr.decode()}")
    os.mkdir(os.path.join(short_tmp, "device-plugins"))
    port = free_port()
    argv = sidecar_argv(short_tmp, port, "--watch-mode", "inotify")
    script = 'echo 0 > /proc/sys/user/max_inotify_instances && exec "$@"'
    proc = subprocess.Popen(
        [unshare, "-Ur", "sh", "-c", script, "sh", *argv], env=CLEAN_ENV, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_serving(proc, port)
        assert get(port, "/healthz")[0] == 200
        status, body = get(port, "/readyz")
        assert status == 503
        assert "inotify" in body
    finally:
        code, err = stop(proc)
    assert "--watch-mode inotify: cannot watch" in err
    assert "inotify instance limit reached" in err
    assert "cannot serve on" not in err
    assert "Traceback" not in err
    assert code == 2
