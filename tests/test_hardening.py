"""A hostile node: a C locale, signal storms, FIFOs where files belong, a huge checkpoint.

Real processes; every wait and loop is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.deviceplugin import checkpoint, hamiconfig, hostdevices
from sidecar.deviceplugin.checkpoint import CheckpointError, read_checkpoint
from sidecar.health import HealthState
from sidecar.server import metrics
from sidecar.server.metrics import Metrics, MetricsPublisher
from testing import FakeDevicePlugin, free_port
from tests.conftest import wait_for
from tests.test_initcheck import catches
from tests.test_serving import _sidecar_argv as sidecar_argv
from tests.test_sidecar_cli import CLEAN_ENV, get, stop, wait_serving

# Python's own defaults under a C locale: ASCII, no UTF-8 mode, no encoding override.
C_LOCALE = {
    **{k: v for k, v in CLEAN_ENV.items() if k not in ("PYTHONIOENCODING", "LANG", "LANGUAGE")},
    "LC_ALL": "C",
    "PYTHONUTF8": "0",
}
UTF8_LOCALE = {**C_LOCALE, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}


def _run(module: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, env=env, timeout=120, check=False
    )


@pytest.mark.parametrize("output", ["text", "json", "npd"])
def test_the_doctor_writes_under_a_c_locale(output: str, short_tmp: str) -> None:
    """Its text has `…` and the paths it names may be non-ASCII: escaped, never a traceback."""
    root = os.path.join(short_tmp, "nœud")
    argv = ["--device-plugin-dir", os.path.join(root, "device-plugins")]
    argv += ["--npd"] if output == "npd" else ["--output", output]
    c = _run("doctor", argv, C_LOCALE)
    utf8 = _run("doctor", argv, UTF8_LOCALE)
    assert b"Traceback" not in c.stderr, c.stderr.decode(errors="replace")
    assert c.returncode == utf8.returncode
    assert c.returncode in (0, 1, 2, 3)
    c.stdout.replace(root.encode(), b"").decode("ascii")  # escapes, but a path's own bytes
    if output == "json":
        assert json.loads(c.stdout)["exit_code"] == c.returncode
    if output == "text":
        assert "\\u2026" in c.stdout.decode() or "…" not in utf8.stdout.decode()


def test_initcheck_writes_under_a_c_locale(short_tmp: str) -> None:
    folder = os.path.join(short_tmp, "plugins-é")
    os.mkdir(folder)
    c = _run("initcheck", ["--device-plugin-dir", folder], C_LOCALE)
    utf8 = _run("initcheck", ["--device-plugin-dir", folder], UTF8_LOCALE)
    assert b"Traceback" not in c.stdout + c.stderr
    assert c.returncode == utf8.returncode
    assert b"plugins-" in c.stdout  # one_line escapes the path's undecodable bytes itself


def test_the_sidecar_logs_under_a_c_locale(short_tmp: str) -> None:
    """A bad configuration naming a non-ASCII value: its line and logs escape it; still exit 2."""
    port = free_port()
    proc = subprocess.Popen(
        sidecar_argv(short_tmp, port, "--probe-timeout", "bientôt…"),
        env=C_LOCALE,
        stderr=subprocess.PIPE,
        text=True,
        errors="strict",
        encoding="ascii",
    )
    try:
        wait_serving(proc, port)
        assert get(port, "/healthz") == (200, "ok")
    finally:
        code, err = stop(proc)
    assert "Traceback" not in err
    assert "Logging error" not in err
    assert "--probe-timeout: expected seconds, got 'bient" in err
    assert code == 2


def _start(short_tmp: str, port: int, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        sidecar_argv(short_tmp, port, *argv), env=CLEAN_ENV, stderr=subprocess.PIPE, text=True
    )


def _wait_caught(proc: subprocess.Popen[str], signum: int) -> None:
    deadline = time.monotonic() + 20
    while not catches(proc.pid, signum):
        assert proc.poll() is None
        assert time.monotonic() < deadline, f"the sidecar never caught {signum}"
        time.sleep(0.001)


def _storm(proc: subprocess.Popen[str], rng: random.Random, count: int = 50) -> None:
    """`count` SIGTERM/SIGINT at random 0-50 ms gaps, or until the process is gone."""
    for _ in range(count):
        if proc.poll() is not None:
            return
        proc.send_signal(rng.choice([signal.SIGTERM, signal.SIGINT]))
        time.sleep(rng.uniform(0, 0.05))


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("bad_config", [False, True])
@pytest.mark.parametrize("when", ["start-up", "serving", "shutdown"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_storm_of_stop_signals_ends_the_sidecar_once(
    when: str, bad_config: bool, seed: int, short_tmp: str
) -> None:
    """Fifty SIGTERM/SIGINT at random gaps: exit 0 (2 serving a bad configuration), no traceback."""
    rng = random.Random(f"{when}-{bad_config}-{seed}")
    port = free_port()
    proc = _start(short_tmp, port, *(["--probe-timeout", "soon"] if bad_config else []))
    try:
        _wait_caught(proc, signal.SIGTERM)  # not SIGINT: Python's own handler has it from the start
        if when == "start-up":
            time.sleep(rng.uniform(0, 0.3))
        else:
            wait_serving(proc, port)
        if when == "shutdown":
            proc.send_signal(signal.SIGTERM)
            time.sleep(rng.uniform(0, 0.1))
        _storm(proc, rng)
    finally:
        code, err = _finish(proc)
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err
    assert code == (2 if bad_config else 0), err


def test_sighup_is_ignored_and_logged_once(short_tmp: str) -> None:
    port = free_port()
    proc = _start(short_tmp, port)
    try:
        _wait_caught(proc, signal.SIGHUP)
        proc.send_signal(signal.SIGHUP)  # during start-up
        wait_serving(proc, port)
        for _ in range(5):
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.02)
        time.sleep(0.3)
        assert proc.poll() is None
        wait_serving(proc, port)
        assert get(port, "/sidecarz/live")[0] == 200
    finally:
        code, err = stop(proc)
    assert code == 0, err
    assert err.count("SIGHUP ignored") == 1, err
    assert "Traceback" not in err


def test_a_bad_configuration_and_sigint_exits_2(short_tmp: str) -> None:
    port = free_port()
    proc = _start(short_tmp, port, "--probe-timeout", "soon")
    try:
        wait_serving(proc, port)
        proc.send_signal(signal.SIGINT)
    finally:
        code, err = _finish(proc)
    assert code == 2, err
    assert "Traceback" not in err


def _status_until(
    proc: subprocess.Popen[str], port: int, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None
        status, body = get(port, "/status")
        if status in (200, 503):
            doc: dict[str, Any] = json.loads(body)
            if done(doc):
                return doc
        assert time.monotonic() < deadline, body
        time.sleep(0.1)


@pytest.mark.parametrize("fifo", ["config", "checkpoint"])
def test_a_fifo_is_a_reason_not_a_stuck_reader(fifo: str, short_tmp: str) -> None:
    """A FIFO no one writes to, at HAMi's config path or the checkpoint's: opening it must not block
    the reader thread (which every later read, and the exit, waits for)."""
    plugins = os.path.join(short_tmp, "device-plugins")
    os.makedirs(plugins)
    config = os.path.join(short_tmp, "config.json")
    checkpoint = os.path.join(plugins, "kubelet_internal_checkpoint")
    if fifo == "config":
        os.mkfifo(config)
        with open(checkpoint, "w") as f:
            json.dump({"Data": {"PodDeviceEntries": [], "RegisteredDevices": {}}, "Checksum": 0}, f)
    else:
        os.mkfifo(checkpoint)
    port = free_port()
    argv = ["--hami-config", config, "--expect-devices", "auto", "--node-name", "n1"]
    proc = _start(short_tmp, port, *argv)
    try:
        wait_serving(proc, port)
        doc = _status_until(
            proc,
            port,
            lambda d: (
                d["checks"]["checkpoint"].get("reason", "not probed yet") != "not probed yet"
                and bool(d["expected_devices"]["notes"])
            ),
        )
        reason = doc["checks"]["checkpoint"]["reason"]
        notes = " ".join(doc["expected_devices"]["notes"])
        if fifo == "config":
            assert f"{config} cannot be read (a FIFO, not a regular file)" in notes
            assert "FIFO" not in reason
        else:
            assert reason == "the checkpoint is a FIFO, not a regular file"
        for name, check in doc["checks"].items():
            if name != "checkpoint":
                assert "FIFO" not in str(check), name
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err


def test_the_configmap_symlink_is_followed_a_fifo_behind_it_is_not_read(short_tmp: str) -> None:
    """A ConfigMap's files are symlinks into ..data/: followed, but what they lead to must be a file."""
    data = os.path.join(short_tmp, "..data")
    os.mkdir(data)
    with open(os.path.join(data, "config.json"), "w") as f:
        json.dump({"nodeconfig": []}, f)
    config = os.path.join(short_tmp, "config.json")
    os.symlink(os.path.join("..data", "config.json"), config)
    src = hamiconfig.Sources(
        device_glob=os.path.join(short_tmp, "nvidia*"), config_path=config, node_name="n1"
    )
    assert hamiconfig.expectation(src).notes == (
        f"{config} has no nodeconfig entry named n1: nothing filtered",
    )
    os.remove(os.path.join(data, "config.json"))
    os.mkfifo(os.path.join(data, "config.json"))
    (note,) = hamiconfig.expectation(src).notes
    assert note == f"{config} cannot be read (a FIFO, not a regular file): HAMi's filter not subtracted"


def test_the_checkpoint_and_the_gpu_attributes_are_not_followed(short_tmp: str) -> None:
    target = os.path.join(short_tmp, "elsewhere")
    with open(target, "w") as f:
        json.dump({"Data": {"RegisteredDevices": {"r": ["a"]}}}, f)
    link = os.path.join(short_tmp, "kubelet_internal_checkpoint")
    os.symlink(target, link)
    with pytest.raises(CheckpointError, match=r"^the checkpoint is a symbolic link, not followed$"):
        read_checkpoint(link)
    gpus = os.path.join(short_tmp, "gpus")
    os.makedirs(os.path.join(gpus, "0000:01:00.0"))
    os.mkfifo(os.path.join(gpus, "0000:01:00.0", "information"))
    assert hostdevices.read_gpus(gpus) == ([], "")  # skipped, not waited on


def _checkpoint(registered: object) -> bytes:
    doc = {"Data": {"PodDeviceEntries": [], "RegisteredDevices": registered}, "Checksum": 1}
    return json.dumps(doc, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (
            _checkpoint({f"r{i}": [] for i in range(1_000_000)}),
            r"^the checkpoint is \d+ bytes, over the 8388608-byte bound: too large to be a kubelet's$",
        ),
        (
            _checkpoint({"r": [0] * checkpoint.MAX_CHECKPOINT_VALUES}),
            r"^the checkpoint holds over 131072 values: too large to be a kubelet's$",
        ),
        (
            _checkpoint({f"r{i}": [] for i in range(1025)}),
            r"^the checkpoint registers 1025 resources, over 1024: too large to be a kubelet's$",
        ),
    ],
    ids=["1e6-keys", "values", "resources"],
)
def test_a_huge_valid_checkpoint_is_a_reason(raw: bytes, reason: str, short_tmp: str) -> None:
    path = os.path.join(short_tmp, "kubelet_internal_checkpoint")
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(CheckpointError, match=reason):
        read_checkpoint(path, max_bytes=64 << 20)  # past the file bound: the parser's own bounds
    with pytest.raises(CheckpointError, match=reason if len(raw) > 8 << 20 else "."):
        read_checkpoint(path)


def test_the_largest_realistic_checkpoint_is_read(short_tmp: str) -> None:
    """256 GPUs split 100 ways, all allocated: the bounds' own sizing (checkpoint.py)."""
    ids = [f"GPU-{i:08x}-0000-0000-0000-000000000000-{s}" for i in range(256) for s in range(100)]
    entries = [
        {
            "PodUID": f"{i:036d}",
            "ContainerName": "cuda",
            "ResourceName": "nvidia.com/gpu",
            "DeviceIDs": {"0": ids[i * 25 : (i + 1) * 25]},
            "AllocResp": "A" * 4096,
        }
        for i in range(1024)
    ]
    doc = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {"nvidia.com/gpu": ids}}, "Checksum": 1}
    path = os.path.join(short_tmp, "kubelet_internal_checkpoint")
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    assert read_checkpoint(path).devices("nvidia.com/gpu") == tuple(ids)


def test_transition_lines_keep_to_a_budget_per_plugin(caplog: pytest.LogCaptureFixture) -> None:
    """A check that flaps thousands of times: LOG_BURST lines, then one line in each 1 / LOG_RATE s
    that counts what was not logged and says where the plugin's checks stand; another plugin's budget
    and lines are its own."""
    caplog.set_level(logging.INFO, logger="sidecar.server.metrics")
    now = [0.0]
    publish = MetricsPublisher(Metrics(), "p", clock=lambda: now[0])
    state = HealthState(grace=0.0, clock=lambda: now[0], on_transition=publish.transition)
    for name in ("plugin:a", "registered:a", "plugin:b"):
        state.add(name)
    for i in range(2000):  # a socket swapped every 2 ms, 4 s
        now[0] = i * 0.002
        state.report("plugin:a", i % 2 == 0, f"swap {i}", definitive=True)
    state.report("plugin:b", True, "b's own")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == metrics.LOG_BURST + 1
    assert lines[-1] == "check plugin:b: pending -> ok: b's own"
    assert all(line.startswith("check plugin:a: ") for line in lines[:-1])
    caplog.clear()
    publish.flush_transitions("a")  # not yet: the budget refills one line in 1 / LOG_RATE s
    assert caplog.records == []
    now[0] += 1 / metrics.LOG_RATE
    publish.flush_transitions("a")
    (summary,) = [r.getMessage() for r in caplog.records]
    assert summary.startswith(f"check transitions of a: {2000 - metrics.LOG_BURST} not logged in the last")
    assert "now plugin:a failed (fails liveness): swap 1999" in summary


async def test_a_plugin_socket_swapped_every_2_ms_logs_within_its_budget(
    plugin: FakeDevicePlugin, dp_dir: str, short_tmp: str
) -> None:
    """The real sidecar while the plugin's socket is replaced every 2 ms for 1 s (each swap moves a few
    checks): its transition lines stay within the plugin's budget, and one counts the rest."""
    port = free_port()
    log = os.path.join(short_tmp, "sidecar.log")
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(*sidecar_argv(short_tmp, port), stderr=err)
    try:
        for _ in range(600):
            if (await asyncio.to_thread(get, port, "/healthz"))[0] == 200:
                break
            assert proc.returncode is None
            await asyncio.sleep(0.05)
        path = os.path.join(dp_dir, "nvidia-gpu.sock")
        held: list[socket.socket] = []
        loop = asyncio.get_running_loop()
        end, swaps = loop.time() + 1.0, 0
        while loop.time() < end:
            tmp = os.path.join(dp_dir, f".swap{swaps % 2}")
            s = socket.socket(socket.AF_UNIX)
            s.bind(tmp)
            s.listen(1)
            os.rename(tmp, path)
            held.append(s)
            if len(held) > 2:
                held.pop(0).close()
            swaps += 1
            await asyncio.sleep(0.002)

        def text() -> str:
            with open(log, errors="replace") as f:
                return f.read()

        await wait_for(lambda: " not logged in the last " in text(), timeout=20, what="the unlogged count")
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        for s in held:
            s.close()
    lines = [line for line in text().splitlines() if "sidecar.server.metrics" in line and "check " in line]
    counted = [line for line in lines if " not logged in the last " in line]
    assert len(lines) - len(counted) <= 2 + metrics.LOG_BURST  # the node's kubelet and checkpoint too
    assert int(counted[0].split(" not logged")[0].rsplit(" ", 1)[1]) >= 50, (swaps, counted[0])
