"""Another process named `kubelet` on the machine (a CI runner's kind, a virtual-kubelet-style tool, k3s on
a contributor's laptop) changes no verdict of hami-initcheck, hami-doctor or hami-sidecar.

The kubelet is the process of a kubelet's name that listens on the kubelet.sock the program sees
(hami_guard/node/proc.py); one that started earlier and listens elsewhere (here a copy of `sleep`
named `kubelet`, the older and lower pid) is named as ignored, never taken for it. Each program runs
twice against the same node: with a process table of the test's own that leaves the other out
(tests/proctable.py), and on the machine's own table beside it. The node's kubelet is either a process
named kubelet of its own (the simulator run as `kubelet`), or the test's process itself (a name of no
kubelet's), as in most other tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.deviceplugin.probes import pod_resources_devices
from testing import FakeDevicePlugin, FakeKubelet, free_port
from tests.conftest import stop_process
from tests.proctable import can_isolate, isolated
from tests.test_doctor import Doctor, klog

GPU = "nvidia.com/gpu"
PY = sys.executable
REPO = Path(__file__).resolve().parents[1]

# The other kubelet is visible to every test on the machine that reads the machine's process table: this
# test holds the process-table lock (tests/conftest.py) while it runs.
pytestmark = pytest.mark.usefixtures("process_table")


@pytest.fixture
def other_kubelet(short_tmp: str) -> Iterator[subprocess.Popen[bytes]]:
    """A copy of `sleep` named kubelet, started before the node's kubelet: it listens nowhere."""
    folder = os.path.join(short_tmp, "other")
    os.mkdir(folder)
    exe = os.path.join(folder, "kubelet")
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    proc = subprocess.Popen([exe, "600"])
    try:
        comm = Path(f"/proc/{proc.pid}/comm")
        deadline = time.monotonic() + 30
        while comm.read_text().strip() != "kubelet":  # named so once it has exec'd
            assert time.monotonic() < deadline, "the other kubelet did not start"
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def node(kind: str, dp_dir: str, short_tmp: str) -> AsyncIterator[str]:
    """A node whose plugin has registered; yields its pod-resources socket. `kind` "process": the
    simulator's kubelet and plugin in a process named kubelet; "test": in this test's process."""
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    if kind == "test":
        async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5), FakeDevicePlugin(dp_dir):
            await registered(pod_resources)
            yield pod_resources
        return
    proc = simulator_as_kubelet(dp_dir, pod_resources, short_tmp)
    try:
        await registered(pod_resources)
        yield pod_resources
    finally:
        stop_process(proc)


def simulator_as_kubelet(dp_dir: str, pod_resources: str, short_tmp: str) -> subprocess.Popen[bytes]:
    """`python -m testing` (the simulator's kubelet and plugin) in a process named kubelet, serving."""
    exe = os.path.join(short_tmp, "node", "kubelet")
    os.makedirs(os.path.dirname(exe))
    os.symlink(os.path.realpath(PY), exe)
    argv = [exe, "-m", "testing", "--device-plugin-dir", dp_dir, "--pod-resources-socket", pod_resources]
    # Named kubelet, the interpreter is not the virtual environment's: it is given its packages.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    while not proc.stdout.readline().startswith(b"plugin:"):  # serving: it printed its sockets
        if proc.poll() is not None:
            stop_process(proc)
            pytest.fail("the simulator exited")
    return proc


async def registered(pod_resources: str, timeout: float = 30.0) -> None:
    """Wait until pod-resources lists the plugin's devices."""
    deadline = time.monotonic() + timeout
    while not (found := await pod_resources_devices(pod_resources, 1.0)).value or GPU not in found.value:
        if time.monotonic() > deadline:
            pytest.fail(f"the plugin did not register within {timeout}s: {found.error}")
        await asyncio.sleep(0.05)


def argv_in(table: str | None, argv: list[str], exclude: Collection[int]) -> list[str]:
    """`argv` with a process table of the test's own that leaves `exclude` out (`table`: a new folder),
    or on the machine's table (`table` None)."""
    return argv if table is None else isolated(argv, table, exclude=exclude)


async def initcheck(dp_dir: str, table: str | None, exclude: Collection[int]) -> dict[str, Any]:
    argv = argv_in(table, [PY, "-m", "initcheck", "--device-plugin-dir", dp_dir, "--output", "json"], exclude)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    doc = json.loads(out)
    return {"exit": proc.returncode, "checks": {c["id"]: c["status"] for c in doc["checks"]}}


async def doctor(doc: Doctor, table: str | None, exclude: Collection[int]) -> dict[str, Any]:
    argv = argv_in(table, doc.argv("--output", "json", "--probe-timeout", "3"), exclude)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert b"Traceback" not in err, err.decode()
    report = json.loads(out)
    return {"exit": proc.returncode, "causes": {c["id"]: c["verdict"] for c in report["causes"]}}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


async def sidecar(
    dp_dir: str, pod_resources: str, table: str | None, exclude: Collection[int]
) -> dict[str, Any]:
    """hami-sidecar's verdicts, once the plugin is ready and two more rounds have run."""
    port = free_port()
    argv = [PY, "-m", "sidecar", "--listen", f"127.0.0.1:{port}", "--device-plugin-dir", dp_dir]
    argv += ["--pod-resources-socket", pod_resources, "--plugin", f"{GPU}=nvidia-gpu.sock"]
    # Timeouts a loaded machine meets: the comparison is of the kubelet's identity, not of its speed.
    argv += ["--probe-interval", "2", "--probe-timeout", "1.5", "--registration-grace", "3"]
    argv += ["--hami-config", "/nonexistent/hami/config.json"]
    proc = start(argv_in(table, argv, exclude))
    url = f"http://127.0.0.1:{port}"
    try:
        await until(lambda: get(f"{url}/readyz")[0] == 200, "the sidecar's readiness")
        first = rounds(url)
        await until(lambda: rounds(url) >= first + 2, "two more rounds")
        found: dict[str, Any] = {}
        for path in ("/healthz?verbose", "/readyz?verbose"):
            code, body = get(url + path)
            found[path] = (
                code,
                sorted(line.split()[0] for line in body.splitlines() if line.startswith("[")),
            )
        return found
    finally:
        stop_process(proc)


def rounds(url: str) -> int:
    """The sidecar's probe rounds so far, -1 where /status does not answer (busy: its rate limit)."""
    code, body = get(f"{url}/status")
    return int(json.loads(body)["probe_rounds"]) if code == 200 else -1


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Ask every 50 ms (the sidecar's endpoints have a rate limit); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("kind", ["process", "test"])
async def test_another_process_named_kubelet_changes_no_verdict(
    kind: str, other_kubelet: subprocess.Popen[bytes], dp_dir: str, short_tmp: str
) -> None:
    if not can_isolate():
        pytest.skip("a process table of the test's own needs root, unshare and mount (tests/proctable.py)")
    os.makedirs(os.path.join(short_tmp, "dev"))
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        Path(short_tmp, "dev", name).touch()
    logs = [os.path.join(short_tmp, name) for name in ("kubelet.log", "plugin.log")]
    Path(logs[0]).write_text(klog("I", "started", file="server.go:146"))
    Path(logs[1]).write_text("")
    exclude = [other_kubelet.pid]
    async with node(kind, dp_dir, short_tmp) as pod_resources:
        report = Doctor(dp_dir, short_tmp, *logs)
        seen: dict[str, list[dict[str, Any]]] = {}
        for beside in (False, True):  # without the other kubelet, then beside it
            with tempfile.TemporaryDirectory(prefix="hg-") as d:
                tables = [None if beside else os.path.join(d, name) for name in ("i", "d", "s")]
                seen.setdefault("initcheck", []).append(await initcheck(dp_dir, tables[0], exclude))
                seen.setdefault("doctor", []).append(await doctor(report, tables[1], exclude))
                seen.setdefault("sidecar", []).append(
                    await sidecar(dp_dir, pod_resources, tables[2], exclude)
                )
        assert other_kubelet.poll() is None  # it ran all along
    without, beside_it = seen["initcheck"]
    assert without == beside_it
    assert without["exit"] == 0
    assert without["checks"]["PATH_MISMATCH"] == ("pass" if kind == "process" else "skip")
    without, beside_it = seen["doctor"]
    assert without == beside_it
    assert without["causes"]["socket-path"] == "ok"
    without, beside_it = seen["sidecar"]
    assert without == beside_it
    assert without["/readyz?verbose"][0] == 200
