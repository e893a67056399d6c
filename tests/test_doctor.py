"""hami-doctor: each root cause in a scenario of its own (a real process against the simulator), and
every rule, repair and rendering in-process from evidence built by hand."""

from __future__ import annotations

import ast
import asyncio
import calendar
import contextlib
import hashlib
import io
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from doctor.causes import (
    DRIVER_FIRST,
    ORDER,
    REREGISTER_FIX,
    UNRECORDED_FIX,
    devices_cause,
    diagnose,
    growth_cause,
    log_cause,
    protocol_cause,
    registration_cause,
    serving_cause,
    version_cause,
)
from doctor.cli import main
from doctor.dra.causes import NOISE
from doctor.evidence import folder_sockets
from doctor.logscan import (
    MAX_JOINED,
    MAX_LINE,
    lines_of,
    read_tail,
    scan,
    scan_file,
    scan_journal,
)
from doctor.patterns import (
    ALREADY_CONNECTED,
    CATALOGUE,
    DRA_PATTERNS,
    DRIVER_FIX,
    KUBELET_PATTERNS,
    OTHER_PLUGIN_FIX,
    PLUGIN_PATTERNS,
    RESTART_PLUGIN,
    RUNTIME_FIX,
    SECTIONS,
    CatalogueError,
    load,
    read,
)
from doctor.render import as_json, as_text, fix_lines, npd_line, shell_lines
from doctor.repairs import MIN_AGE, STALE, apply, plan, removal
from doctor.shell import quote, split_words
from doctor.types import (
    CAUSES,
    Cause,
    DriverNodes,
    KubeletProcess,
    LogFindings,
    NodeEvidence,
    Pattern,
    PluginEvidence,
    PluginProcesses,
    ProcessGrowth,
    ProcessSample,
    Repair,
    Report,
    SocketFile,
    SocketProbe,
)
from hami_guard.flags import AUTO_DEVICES, DeviceExpectation, PluginSpec
from hami_guard.node.sockets import try_connect
from hami_guard.node.unixdiag import SocketOwner, kubelet_connections
from hami_guard.profiles import DEFAULT as DEFAULT_PROFILE
from initcheck.checks import Finding
from sidecar.deviceplugin.checkpoint import Checkpoint, CheckpointError, read_checkpoint
from sidecar.deviceplugin.evidence import iso
from sidecar.deviceplugin.probes import Reading, SocketId
from sidecar.rpc import unix_target
from testing import FakeDevicePlugin, FakeKubelet, netns
from testing.grpcserve import GoStyleUnimplemented
from testing.netns import Netns
from testing.plugin import hami_device_ids
from tests.conftest import wait_for
from tests.proctable import isolated
from tests.test_initcheck import FLIPPER, stand_in

GPU = "nvidia.com/gpu"
PY = sys.executable
REPO = Path(__file__).resolve().parents[1]

# hami-doctor reads a process table of the test's own (tests/proctable.py): pid 1, the test's process and
# the processes it started, never another process of a kubelet's name on the machine. These tests start
# processes named kubelet, k3s-server and kubelite, which every check on the machine can see: each holds
# the process-table lock (tests/conftest.py), so no test that reads the machine's table sees them.
pytestmark = pytest.mark.usefixtures("process_table")


@dataclass
class Doctor:
    dir: str
    tmp: str
    kubelet_log: str
    plugin_log: str

    def argv(self, *extra: str) -> list[str]:
        return [
            PY, "-m", "doctor",
            "--device-plugin-dir", self.dir,
            "--pod-resources-socket", os.path.join(self.tmp, "pod-resources", "kubelet.sock"),
            "--kubelet-log", self.kubelet_log,
            "--plugin-log", self.plugin_log,
            "--device-glob", os.path.join(self.tmp, "dev", "nvidia[0-9]*"),
            "--expect-devices", "auto",
            "--plugin-process-name", "no-such-plugin",
            "--sample-interval", "0.2",
            "--probe-timeout", "0.5",
            "--sidecar-status", "",
            *extra,
        ]  # fmt: skip

    async def run(
        self, *extra: str, env: dict[str, str] | None = None, ns: Netns | None = None
    ) -> tuple[int, str]:
        """The one way a test starts hami-doctor: a real process (in `ns`, a pod's network namespace, when
        given) with a process table of the test's own (its processes, taken now), never a traceback on
        stderr."""
        argv = self.argv(*extra)
        table = os.path.join(tempfile.mkdtemp(prefix="proc-", dir=self.tmp), "table")
        proc = await asyncio.create_subprocess_exec(
            *isolated(ns.command(argv) if ns is not None else argv, table),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert b"Traceback" not in err, err.decode()
        assert proc.returncode is not None
        return proc.returncode, out.decode()

    async def report(
        self, *extra: str, env: dict[str, str] | None = None, ns: Netns | None = None
    ) -> tuple[int, dict[str, object]]:
        code, out = await self.run("--output", "json", *extra, env=env, ns=ns)
        doc: dict[str, object] = json.loads(out)
        return code, doc


def verdicts(doc: dict[str, object]) -> dict[str, str]:
    causes = doc["causes"]
    assert isinstance(causes, list)
    return {c["id"]: c["verdict"] for c in causes}


def row(doc: dict[str, object], cause_id: str) -> dict[str, Any]:
    causes = doc["causes"]
    assert isinstance(causes, list)
    (found,) = [c for c in causes if c["id"] == cause_id]
    assert isinstance(found, dict)
    return found


@pytest.fixture
def doctor(dp_dir: str, short_tmp: str) -> Doctor:
    os.makedirs(os.path.join(short_tmp, "dev"))
    for name in ("nvidia0", "nvidia1", "nvidiactl"):  # the host's two GPUs and the driver's control node
        Path(short_tmp, "dev", name).touch()
    kubelet_log = os.path.join(short_tmp, "kubelet.log")
    plugin_log = os.path.join(short_tmp, "plugin.log")
    Path(kubelet_log).write_text(klog("I", REQUEST, file="server.go:146"))
    Path(plugin_log).write_text(
        cri(klog("I", "Starting GRPC server for 'nvidia.com/gpu'", pid=1, file="server.go:528"))
        + cri(
            klog(
                "I", "Registered device plugin for 'nvidia.com/gpu' with Kubelet", pid=1, file="server.go:330"
            )
        )
    )
    return Doctor(dp_dir, short_tmp, kubelet_log, plugin_log)


REQUEST = '"Got registration request from device plugin with resource" resourceName="nvidia.com/gpu"'


def klog(
    level: str, message: str, at: float | None = None, pid: int = 12345, file: str = "manager.go:123"
) -> str:
    """A line as klog writes it: `I1203 06:02:46.123456   12345 manager.go:123] message`."""
    t = time.localtime(at if at is not None else time.time())
    stamp = f"{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.123456"
    return f"{level}{stamp} {pid:>7} {file}] {message}\n"


def cri(line: str, at: float | None = None, stream: str = "stderr") -> str:
    """A container's line as the kubelet's CRI log file holds it: `<RFC 3339 UTC> stderr F <line>`."""
    t = time.gmtime(at if at is not None else time.time())
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', t)}.123456789Z {stream} F {line}"


def age(path: str, seconds: float = 60.0) -> None:
    """Make a socket file look `seconds` old (its mtime: what hami-doctor dates a socket by)."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


@pytest.fixture
async def node(dp_dir: str, short_tmp: str) -> AsyncIterator[tuple[FakeKubelet, FakeDevicePlugin]]:
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as k, FakeDevicePlugin(dp_dir) as p:
        await wait_for(lambda: k.healthy_devices(GPU))
        yield k, p


async def test_healthy_node_exits_0_and_every_row_is_ok(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    with growing_process("fake-plugin", leak=False) as name:
        code, doc = await doctor.report("--plugin-process-name", name)
    assert code == 0
    assert doc["healthy"] is True
    rows = verdicts(doc)
    # Every row is OK but two: no real kubelet binary runs here to ask its version, and the doctor shares
    # the (simulated) kubelet's network namespace, where whose listener serves a socket cannot be told.
    unknown = {"kubelet-version", "socket-owner"}
    assert {k: v for k, v in rows.items() if k not in unknown} == dict.fromkeys(rows.keys() - unknown, "ok")
    assert {rows[k] for k in unknown} == {"unknown"}
    assert row(doc, "socket-owner")["evidence"][0].startswith("nvidia-gpu.sock: host network: ")
    assert doc["errors"] == []


async def test_socket_permission(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    kubelet, _ = node
    os.chmod(short_tmp, 0o755)
    os.chmod(doctor.dir, 0o755)
    os.chmod(kubelet.socket_path, 0o600)
    code, doc = await doctor.report("--plugin-uid", "1000", "--plugin-gid", "1000")
    assert (code, doc["most_likely"]) == (1, "socket-permission")


async def test_socket_path_mismatch(doctor: Doctor, short_tmp: str) -> None:
    """The kubelet listens on this very kubelet.sock, but bound it in another folder (the file was moved
    since): it dials plugins there, not here."""
    where = os.path.join(short_tmp, "k", "device-plugins", "kubelet.sock")
    with stand_in("kubelet", short_tmp, where, os.path.join(doctor.dir, "kubelet.sock")):
        code, out = await doctor.run()
        assert code == 1
        first = out.splitlines()[3]
        assert first.split()[1:4] == ["socket", "path", "mismatch"]
        assert where in out
        code, doc = await doctor.report()
    assert doc["most_likely"] == "socket-path"


async def test_a_process_named_kubelet_elsewhere_is_ignored(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], kubelet_elsewhere: tuple[Any, str]
) -> None:
    """A process named kubelet that does not listen on kubelet.sock (another kubelet on the machine) is
    not the kubelet: the report names it as ignored, and judges as without it."""
    other, _ = kubelet_elsewhere
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (0, None), verdicts(doc)
    why = f"it does not listen on kubelet.sock as this pod sees it (pid {os.getpid()} does)"
    ignored = f"pid {other.pid} (kubelet): {why}"
    assert f"PATH_MISMATCH: ignored {ignored}" in row(doc, "socket-path")["evidence"]
    kubelet = doc["kubelet"]
    assert isinstance(kubelet, dict)
    assert kubelet == {"visible": False, "why": kubelet["why"], "ignored": [ignored]}
    assert kubelet["why"].startswith("no process named kubelet, k3s, k3s-agent, k3s-server or kubelite ")


async def test_protocol_mismatch(doctor: Doctor) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([GoStyleUnimplemented({})])
    server.add_insecure_port(unix_target(os.path.join(doctor.dir, "kubelet.sock")))
    await server.start()
    try:
        code, doc = await doctor.report()
    finally:
        await server.stop(None)
    assert (code, doc["most_likely"]) == (1, "protocol")


async def test_plugin_not_serving_a_stale_socket(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    _, plugin = node
    await plugin.crash(remove_socket=False)
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "plugin-not-serving")
    assert doc["repairs"] == []  # a socket just made may be a plugin's between bind() and listen()
    age(plugin.socket_path)
    code, doc = await doctor.report()
    assert doc["repairs"] == [
        {
            "path": plugin.socket_path,
            "why": "a plugin socket nothing listens on (the plugin died)",
            "command": f"rm -- {plugin.socket_path}",
            "applied": False,
            "error": "",
        }
    ]


async def test_plugin_not_registered(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    kubelet, plugin = node
    plugin.register_enabled = False
    await kubelet.restart()
    await wait_for(lambda: os.path.exists(plugin.socket_path))
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "plugin-not-registered")


async def test_a_probers_connection_is_not_the_kubelets(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    """Where the kubelet's descriptors cannot be read (here: no process named kubelet holds its listener),
    a connection to a plugin's socket from the kubelet's network namespace is anyone's: the sidecar's
    probe (hostNetwork) is one. Open when the doctor first reads the connections, closed once its probes
    begin (they follow that reading), it makes no registration of a plugin that never registered."""
    dev = "example.com/dev"
    never = FakeDevicePlugin(doctor.dir, dev, "dev.sock")
    never.register_enabled = False
    async with never:
        await wait_for(lambda: os.path.exists(never.socket_path))
        with socket.socket(socket.AF_UNIX) as prober:
            prober.connect(never.socket_path)
            asked = never.calls["GetDevicePluginOptions"]
            # The second reading comes a probe timeout after the first: 2 s to see the probe and hang up.
            run = asyncio.create_task(
                doctor.report("--plugin", f"{GPU}=nvidia-gpu.sock", "--plugin", f"{dev}=dev.sock",
                              "--probe-timeout", "2")
            )  # fmt: skip
            await wait_for(
                lambda: never.calls["GetDevicePluginOptions"] > asked or run.done(), 60, "the doctor's probe"
            )
        code, doc = await run
    evidence = row(doc, "plugin-not-registered")["evidence"]
    assert (code, doc["most_likely"]) == (1, "plugin-not-registered"), evidence
    assert any(e.startswith(f"{dev}: the kubelet holds no connection to dev.sock: ") for e in evidence), (
        evidence
    )
    assert any(e.startswith(f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock") for e in evidence)


async def test_a_dropped_plugin_is_not_registered_though_the_checkpoint_still_lists_it(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    """kubernetes issue 131013: the kubelet closes its connection and never dials again; nothing is
    rewritten, so the checkpoint still lists the devices. The live connection decides."""
    kubelet, plugin = node
    code, doc = await doctor.report()
    assert code == 0
    assert row(doc, "plugin-not-registered")["evidence"] == [
        f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock; pod-resources lists 2 healthy device(s)"
    ]
    before = read_checkpoint(kubelet.checkpoint_path)
    await kubelet.drop(GPU)

    def connections() -> int:
        seen = kubelet_connections(kubelet.socket_path)
        assert not isinstance(seen, str), seen
        return seen.to(plugin.socket_path)

    await wait_for(lambda: connections() == 0, what="the kubelet's connection to close")
    code, doc = await doctor.report()
    assert read_checkpoint(kubelet.checkpoint_path) == before  # history, untouched
    assert before.devices(GPU) == ("GPU-0", "GPU-1")
    assert plugin.serving
    assert (code, doc["most_likely"]) == (1, "plugin-not-registered")
    registered = row(doc, "plugin-not-registered")
    assert registered["evidence"] == [
        f"{GPU}: the kubelet is no longer connected to nvidia-gpu.sock, though its checkpoint recorded 2 "
        f"healthy device(s) from it at {iso(before.mtime_ns / 1e9)} (history): it dropped the plugin, which "
        "keeps serving (kubernetes issues 121994, 131013)"
    ]
    assert registered["fix"] == list(REREGISTER_FIX)


async def test_devices_visible_but_not_registered(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    Path(short_tmp, "dev", "nvidia2").touch()  # nvidia-smi would see three; the plugin reports two
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "devices-not-registered")


async def test_kubelet_registration_errors(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    old = klog(
        "E",
        '"Bad registration request from device plugin" err="this line is two hours old"',
        time.time() - 7200,
    )
    err = 'err="requested API version \\"v1alpha\\" is not supported by kubelet"'
    bad = klog("E", f'"Bad registration request from device plugin" {err}')
    with open(doctor.kubelet_log, "a") as f:
        f.write(old + bad * 3)
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "kubelet-log")
    evidence = row(doc, "kubelet-log")["evidence"]
    assert evidence[0].startswith(
        f"{doctor.kubelet_log}: 3 x 'Bad registration request from device plugin': the plugin asked for an "
        "API version other than v1beta1; newest: E"
    )
    assert "not supported" in evidence[0]


async def test_kubelet_log_from_journalctl(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    line = klog(
        "E",
        '"Failed to connect to new client" err="failed to dial device plugin: context deadline exceeded" '
        'resource="nvidia.com/gpu"',
        file="handler.go:94",
    )
    _, doc = await doctor.report("--kubelet-log", "journal", env=fake_journal(short_tmp, {"kubelet": line}))
    assert doc["most_likely"] == "kubelet-log"
    assert (
        "-u kubelet -u k3s -u k3s-agent -u snap.microk8s.daemon-kubelite"
        in Path(short_tmp, "bin", "args").read_text()
    )
    assert row(doc, "kubelet-log")["evidence"][0].endswith(line.strip())


def fake_journal(tmp: str, units: dict[str, str]) -> dict[str, str]:
    """A journalctl on the PATH that prints `units[u]` for each `-u u` asked (and records its arguments)."""
    fake = Path(tmp, "bin", "journalctl")
    fake.parent.mkdir(exist_ok=True)
    script = ["#!/bin/sh", 'echo "$@" > "$(dirname "$0")/args"', 'for a in "$@"; do case "$a" in']
    for unit, text in units.items():
        Path(tmp, "bin", f"{unit}.log").write_text(text)
        script.append(f'  {unit}) cat "$(dirname "$0")/{unit}.log";;')
    script += ["esac; done", ""]
    fake.write_text("\n".join(script))
    fake.chmod(0o755)
    return {"PATH": f"{fake.parent}:{os.environ['PATH']}"}


async def test_k3s_logs_the_kubelet_under_its_own_unit(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    """On k3s `journalctl -u kubelet` has nothing: the k3s unit holds the kubelet's lines."""
    _, doc = await doctor.report("--kubelet-log", "journal", env=fake_journal(short_tmp, {"kubelet": ""}))
    assert row(doc, "kubelet-log")["verdict"] == "unknown"  # no line read: not "ok"
    assert "no line could be read" in row(doc, "kubelet-log")["evidence"][0]
    line = klog(
        "E", '"ListAndWatch ended unexpectedly for device plugin" err="EOF" resource="nvidia.com/gpu"'
    )
    env = fake_journal(
        short_tmp, {"kubelet": "", "k3s": f'time="x" level=info msg="Running kubelet"\n{line}'}
    )
    code, doc = await doctor.report("--kubelet-log", "journal", env=env)
    assert (code, doc["most_likely"]) == (1, "kubelet-log")


async def test_plugin_registration_errors(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    line = klog(
        "I", "Could not register device plugin: context deadline exceeded", pid=1, file="server.go:325"
    )
    with open(doctor.plugin_log, "a") as f:
        f.write(cri(line) * 2)
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "plugin-log")
    assert row(doc, "plugin-log")["evidence"][0].startswith(
        f"{doctor.plugin_log}: 2 x 'Could not register device plugin:': kubelet.sock did not answer"
    )


@contextlib.contextmanager
def growing_process(name: str, leak: bool) -> Iterator[str]:
    """A process named `name` and this test process's pid (no other test's process has that name: the
    doctor looks at every process of the name on the machine); yields the name.

    With `leak`, its thread count follows the wall clock, one thread per 10 ms since it started (capped
    at 3000: 30 s, more than a doctor run takes): what a wait for the CPU delayed is made up at once, so
    two samples the doctor takes a second apart see about 100 more threads (its bound is 20) however
    little CPU the machine gave it in between, as long as it ran once in the last 0.8 s of them."""
    name = f"{name[:7]}-{os.getpid()}"[:15]  # the kernel's `comm` keeps 15 characters
    folder = Path(os.environ.get("TMPDIR", "/tmp"), f"hg-growth-{os.getpid()}")
    folder.mkdir(exist_ok=True)
    exe = folder / name
    with contextlib.suppress(FileExistsError):
        exe.symlink_to(os.path.realpath(PY))
    code = (
        "import sys, threading, time\nthreading.stack_size(256 * 1024)\nstop = threading.Event()\n"
        "print(1, flush=True)\n"
        "start, made = time.monotonic(), 0\n"
        "while sys.argv[1] == 'leak' and made < 3000:\n"
        "    due = min(3000, int((time.monotonic() - start) / 0.01))\n"
        "    while made < due:\n"
        "        threading.Thread(target=stop.wait, daemon=True).start(); made += 1\n"
        "    time.sleep(0.01)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([str(exe), "-c", code, "leak" if leak else "steady"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()
    try:
        yield name
    finally:
        proc.kill()
        proc.wait()


async def test_plugin_resource_growth(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    with growing_process("leaky-plugin", leak=True) as name:
        code, doc = await doctor.report("--plugin-process-name", name, "--sample-interval", "1")
    assert (code, doc["most_likely"]) == (1, "plugin-growth"), row(doc, "plugin-growth")


def fingerprint(path: str) -> tuple[int, int, str]:
    st = os.stat(path)
    content = "" if not os.path.isfile(path) else hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return st.st_ino, st.st_mode, content


async def test_fix_removes_only_stale_plugin_sockets_and_prints_each_change(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    kubelet, plugin = node
    await plugin.crash(remove_socket=False)
    other = os.path.join(doctor.dir, "Ascend910B3.sock")  # another dead plugin's socket
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(other)
    for path in (plugin.socket_path, other):
        age(path)
    protected = {p: fingerprint(p) for p in (kubelet.socket_path, kubelet.checkpoint_path)}

    _, out = await doctor.run()
    assert "repairs (hami-doctor --fix applies these and nothing else):" in out
    assert f"rm -- {plugin.socket_path}" in out
    assert os.path.exists(plugin.socket_path)  # without --fix nothing changes

    _, out = await doctor.run("--fix")
    assert f"fix: rm -- {plugin.socket_path}: done" in out
    assert f"fix: rm -- {other}: done" in out
    assert not os.path.exists(plugin.socket_path)
    assert not os.path.exists(other)
    assert {p: fingerprint(p) for p in protected} == protected


async def test_npd_mode_one_line_and_its_exit_codes(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    code, out = await doctor.run("--npd")
    assert (code, out.count("\n")) == (0, 1)
    _, plugin = node
    await plugin.crash()
    code, out = await doctor.run("--npd")
    assert (code, out.count("\n")) == (1, 1)
    assert out.startswith("plugin not serving: ")
    # An internal error (here a broken grpc installation) is NPD's Unknown, in one line.
    broken = Path(short_tmp, "broken")
    for name in ("grpc", "psutil"):
        Path(broken, name).mkdir(parents=True)
        Path(broken, name, "__init__.py").write_text(f"raise ImportError('{name} C extension missing')\n")
    code, out = await doctor.run("--npd", env={"PYTHONPATH": str(broken)})
    assert code == 2
    assert out.count("\n") == 1
    assert out.startswith("hami-doctor could not diagnose: ImportError: grpc C extension missing")
    # A reader that fails costs only its own rows: without psutil, the rest is still judged.
    Path(broken, "grpc", "__init__.py").unlink()
    Path(broken, "grpc").rmdir()
    code, doc = await doctor.report(env={"PYTHONPATH": str(broken)})
    assert (code, doc["most_likely"]) == (1, "plugin-not-serving")
    errors = doc["errors"]
    assert isinstance(errors, list)
    assert any("psutil C extension missing" in e for e in errors)
    # Without grpc, each output still ends in one line and exit 2, never a traceback.
    Path(broken, "grpc").mkdir()
    Path(broken, "grpc", "__init__.py").write_text("raise ImportError('grpc C extension missing')\n")
    code, out = await doctor.run("--output", "json", env={"PYTHONPATH": str(broken)})
    assert (code, json.loads(out)["error"]) == (2, "ImportError: grpc C extension missing")
    code, out = await doctor.run(env={"PYTHONPATH": str(broken)})
    assert (code, out) == (2, "")


async def test_json_shape(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    _, doc = await doctor.report()
    assert set(doc) == {"healthy", "exit_code", "most_likely", "causes", "repairs", "kubelet", "errors"}
    assert doc["errors"] == []
    causes = doc["causes"]
    assert isinstance(causes, list)
    assert len(causes) == 13
    for c in causes:
        assert set(c) == {"id", "title", "verdict", "evidence", "fix"}
        assert c["verdict"] in {"problem", "ok", "unknown"}


async def test_text_report_fits_80_columns(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    _, plugin = node
    plugin.register_enabled = False
    await plugin.crash(remove_socket=False)
    with open(doctor.plugin_log, "a") as f:
        f.write("Could not register device plugin: context deadline exceeded " + "x" * 200 + "\n")
    code, out = await doctor.run()
    assert code == 1
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert lines[0].startswith("hami-doctor: ")
    assert "PROBLEM" in lines[3]


# -- the rules, in-process, from evidence built by hand -----------------------------------------------
DP = "/var/lib/kubelet/device-plugins"
KUBELET_SOCK = f"{DP}/kubelet.sock"
PLUGIN_SOCK = f"{DP}/nvidia-gpu.sock"
GPU_SPEC = PluginSpec(GPU, "nvidia-gpu.sock")
GLOB = "/dev/nvidia[0-9]*"
# kubelet.sock, then the plugin's socket a second later, then the kubelet's checkpoint write after its first
# ListAndWatch answer: two GPUs as HAMi advertises them (ten split IDs each).
T0 = 1_767_225_600 * 10**9
KUBELET_ID, PLUGIN_ID = SocketId(100, T0), SocketId(200, T0 + 10**9)
UUIDS = ("GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f", "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60")
SPLIT_IDS = tuple(hami_device_ids(UUIDS))
CHECKPOINT = Checkpoint({GPU: SPLIT_IDS}, T0 + 2 * 10**9)
LIVE = Reading({GPU: frozenset(SPLIT_IDS)})  # pod-resources: healthy IDs by resource
UNSEEN = "the kubelet's network namespace is not visible from this pod"
HELD = f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock; pod-resources lists 2 healthy device(s)"
NOT_MOUNTED = "pod-resources socket not mounted"


def plugin_evidence(**changes: Any) -> PluginEvidence:
    healthy = PluginEvidence(
        spec=GPU_SPEC,
        probe=SocketProbe(PLUGIN_SOCK, "alive", "GetDevicePluginOptions answered", PLUGIN_ID),
        connections=Reading(1),
        owner=SocketOwner("this-pod", "this pod's network namespace holds the listener", 7),
    )
    return replace(healthy, **changes)


def growth(pid: int = 42, rss_mib: float = 0.0, fds: int = 0, threads: int = 0) -> ProcessGrowth:
    first = ProcessSample(rss=100 * 2**20, fds=20, threads=10)
    second = ProcessSample(rss=first.rss + int(rss_mib * 2**20), fds=20 + fds, threads=10 + threads)
    return ProcessGrowth(pid, first, second, interval=2.0, uptime=7200.0)


HEALTHY = NodeEvidence(
    findings=(
        Finding("DIR_MISSING", "pass", DP, "folder"),
        Finding("SOCKET_MISSING", "pass", KUBELET_SOCK, "exists"),
        Finding("NOT_A_SOCKET", "pass", KUBELET_SOCK, "socket"),
        Finding("OWNER_MISMATCH", "skip", KUBELET_SOCK, "not asked for (--expect-*)"),
        Finding("PERMISSION_DENIED", "pass", KUBELET_SOCK, "uid 0 gid 0 with CAP_DAC_OVERRIDE"),
        Finding("MODE_TOO_OPEN", "pass", KUBELET_SOCK, "mode 0755"),
        Finding("STALE_SOCKET", "pass", KUBELET_SOCK, "connect() accepted"),
        Finding("PATH_MISMATCH", "pass", KUBELET_SOCK, "kubelet pid 1 listens here"),
    ),
    kubelet_socket=SocketProbe(KUBELET_SOCK, "alive", "serving v1beta1.Registration", KUBELET_ID),
    plugins=(plugin_evidence(),),
    kubelet=KubeletProcess(True, pid=1, version="1.29.3", listening=(KUBELET_SOCK,)),
    kubelet_logs=(LogFindings("/var/log/kubelet.log", read=True, lines=40),),
    plugin_logs=(LogFindings("/var/log/pods/plugin.log", read=True, lines=40),),
    plugin_process=PluginProcesses("nvidia-device-plugin", visible=True, growth=(growth(),)),
    folder_sockets=(SocketFile(KUBELET_SOCK, listening=True), SocketFile(PLUGIN_SOCK, listening=True)),
    kubelet_path=KUBELET_SOCK,
    checkpoint=Reading(CHECKPOINT),
    pod_resources=LIVE,
    expect_devices=AUTO_DEVICES,
    device_glob=GLOB,
    host_devices=("/dev/nvidia0", "/dev/nvidia1"),
    driver=DriverNodes(True, "/dev", True, ("/dev/nvidia0", "/dev/nvidia1")),
)
IDENTITY = (1, 2, 3, 4)


def one(causes: list[Cause], cause_id: str) -> Cause:
    (cause,) = [c for c in causes if c.id == cause_id]
    return cause


def test_healthy_evidence_every_row_ok_and_nothing_to_repair() -> None:
    causes = diagnose(HEALTHY)
    assert [c.id for c in causes] == [cause_id for cause_id, _ in CAUSES]
    assert {c.id: c.verdict for c in causes} == dict.fromkeys(ORDER, "ok")
    assert plan(HEALTHY) == []


@pytest.mark.parametrize(
    ("finding", "cause_id", "verdict", "evidence"),
    [
        (
            Finding(
                "PATH_MISMATCH", "fail", KUBELET_SOCK, "kubelet pid 9 listens on: /x.sock", "", "mount it"
            ),
            "socket-path",
            "problem",
            f"PATH_MISMATCH: {KUBELET_SOCK}: kubelet pid 9 listens on: /x.sock",
        ),
        (
            Finding("SOCKET_MISSING", "fail", KUBELET_SOCK, "nothing", "", "start the kubelet"),
            "socket-path",
            "problem",
            f"SOCKET_MISSING: {KUBELET_SOCK}: nothing",
        ),
        (
            Finding("PERMISSION_DENIED", "fail", KUBELET_SOCK, "srw------- 0:0", "", "run as root"),
            "socket-permission",
            "problem",
            f"PERMISSION_DENIED: {KUBELET_SOCK}: srw------- 0:0",
        ),
        (
            Finding("GROUP_MISMATCH", "fail", KUBELET_SOCK, "gid 0", "gid 1000", "chgrp 1000"),
            "socket-permission",
            "problem",
            f"GROUP_MISMATCH: {KUBELET_SOCK}: gid 0",
        ),
        (
            Finding("MODE_TOO_OPEN", "warn", KUBELET_SOCK, "mode 0777"),
            "socket-permission",
            "ok",
            "MODE_TOO_OPEN (warning): mode 0777",
        ),
        (
            Finding("PATH_MISMATCH", "skip", KUBELET_SOCK, "no process named kubelet is visible"),
            "socket-path",
            "ok",
            "PATH_MISMATCH not checked: no process named kubelet is visible",
        ),
    ],
)
def test_initcheck_findings_become_the_socket_rows(
    finding: Finding, cause_id: str, verdict: str, evidence: str
) -> None:
    causes = diagnose(replace(HEALTHY, findings=(finding,)))
    cause = one(causes, cause_id)
    assert (cause.verdict, cause.evidence) == (verdict, [evidence])
    assert cause.fix == ([finding.remedy] if verdict == "problem" else [])
    if verdict == "problem":
        assert causes[0] is cause


@pytest.mark.parametrize(
    ("state", "verdict"), [("wrong-service", "problem"), ("alive", "ok"), ("refused", "unknown")]
)
def test_protocol_row_from_the_kubelet_probe(state: str, verdict: str) -> None:
    cause = protocol_cause(SocketProbe(KUBELET_SOCK, state, "why"))
    assert cause.verdict == verdict
    assert ("$ ss -xlp | grep kubelet.sock" in cause.fix) == (verdict == "problem")


def test_a_stale_plugin_socket_is_not_serving_and_its_removal_is_the_fix() -> None:
    stale = plugin_evidence(probe=SocketProbe(PLUGIN_SOCK, "refused", "connection refused"))
    hung = plugin_evidence(
        spec=PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock"),
        probe=SocketProbe(f"{DP}/Ascend910B3.sock", "timeout", "timeout: no answer"),
    )
    cause = serving_cause([stale, hung])
    assert cause.verdict == "problem"
    assert cause.evidence == ["nvidia-gpu.sock: connection refused", "Ascend910B3.sock: timeout: no answer"]
    assert f"$ rm -- {PLUGIN_SOCK}" in cause.fix
    assert f"$ rm -- {DP}/Ascend910B3.sock" not in cause.fix  # a hung plugin still holds its socket
    assert cause.fix.count(RESTART_PLUGIN) == 1


def registration_row(**changes: Any) -> Cause:
    """The plugin-not-registered row from HEALTHY with the plugin's connections (`connections`) and the
    node's records (`checkpoint`, `pod_resources`) changed."""
    plugin = {k: changes.pop(k) for k in ("connections",) if k in changes}
    return registration_cause(replace(HEALTHY, plugins=(plugin_evidence(**plugin),), **changes))


AT = iso(CHECKPOINT.mtime_ns / 1e9)
BEFORE_THE_SOCKET = replace(CHECKPOINT, mtime_ns=PLUGIN_ID.mtime_ns - 1)  # written for an older socket


@pytest.mark.parametrize(
    ("changes", "verdict", "evidence", "fix"),
    [
        pytest.param(
            {},
            "ok",
            HELD,
            [],
            id="held",
        ),
        pytest.param(
            {"checkpoint": Reading.failed("the checkpoint is not valid JSON (truncated or corrupt)")},
            "ok",
            HELD,
            [],
            id="held, the checkpoint unreadable",
        ),
        pytest.param(
            {"checkpoint": Reading(BEFORE_THE_SOCKET), "pod_resources": Reading.failed(NOT_MOUNTED)},
            "problem",
            f"{GPU}: the kubelet is connected to nvidia-gpu.sock but has recorded no device list from it "
            "since the socket was created (a Register under way, or refused; a kubelet restart clears the "
            "refused state on Kubernetes 1.37)",
            list(UNRECORDED_FIX),
            id="connected, not recorded since the socket was made",
        ),
        pytest.param(
            {"checkpoint": Reading(Checkpoint({}, CHECKPOINT.mtime_ns))},
            "problem",
            f"{GPU}: the kubelet is connected to nvidia-gpu.sock but has recorded no device list",
            list(UNRECORDED_FIX),
            id="connected, never recorded",
        ),
        pytest.param(
            {"pod_resources": Reading({})},
            "problem",
            f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock, but pod-resources lists no device of "
            f"{GPU} although its checkpoint, written since the socket was created, records 2 healthy: it "
            "dropped the plugin (a connection is not a stream; kubernetes issue 121994)",
            list(REREGISTER_FIX),
            id="connected, pod-resources empty against a fresh checkpoint",
        ),
        pytest.param(
            {"pod_resources": Reading({}), "checkpoint": Reading(replace(CHECKPOINT, registered={GPU: ()}))},
            "ok",
            f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock; pod-resources lists no healthy "
            "device",
            [],
            id="connected, every device reported unhealthy",
        ),
        pytest.param(
            {"connections": Reading(0), "pod_resources": Reading({})},
            "problem",
            f"{GPU}: the kubelet is no longer connected to nvidia-gpu.sock, though its checkpoint recorded 2 "
            f"healthy device(s) from it at {AT} (history): it dropped the plugin, which keeps serving "
            "(kubernetes issues 121994, 131013)",
            list(REREGISTER_FIX),
            id="no connection after an earlier acceptance",
        ),
        pytest.param(
            {"connections": Reading(0), "checkpoint": Reading(BEFORE_THE_SOCKET)},
            "problem",
            f"{GPU}: the kubelet holds no connection to nvidia-gpu.sock: not registered since the plugin "
            "socket was created",
            list(REREGISTER_FIX),
            id="no connection since the socket was made",
        ),
        pytest.param(
            {
                "connections": Reading(0),
                "checkpoint": Reading.failed("no checkpoint: the kubelet has not recorded any device plugin"),
            },
            "problem",
            f"{GPU}: the kubelet holds no connection to nvidia-gpu.sock: not registered (no checkpoint: ",
            list(REREGISTER_FIX),
            id="no connection, no checkpoint",
        ),
        pytest.param(
            {"connections": Reading.failed(UNSEEN), "checkpoint": Reading(BEFORE_THE_SOCKET)},
            "ok",
            f"{GPU}: pod-resources lists 2 healthy device(s) of {GPU} (the kubelet's connections cannot be "
            f"seen: {UNSEEN})",
            [],
            id="unseen, pod-resources lists it",
        ),
        pytest.param(
            {"connections": Reading.failed(UNSEEN), "pod_resources": Reading({})},
            "problem",
            f"{GPU}: pod-resources lists no device of {GPU} although the kubelet recorded 2 healthy: it "
            f"dropped the plugin (the kubelet's connections cannot be seen: {UNSEEN})",
            list(REREGISTER_FIX),
            id="unseen, pod-resources no longer lists it",
        ),
        pytest.param(
            {"connections": Reading.failed(UNSEEN), "pod_resources": Reading.failed(NOT_MOUNTED)},
            "unknown",
            f"{GPU}: the kubelet's checkpoint recorded 2 healthy device(s) of {GPU} at {AT}, since both "
            "sockets were made; that is history (it is not rewritten when the kubelet drops a plugin) and "
            f"nothing live tells whether the kubelet holds it now (the kubelet's connections cannot be seen: "
            f"{UNSEEN}; {NOT_MOUNTED})",
            [],
            id="unseen, the checkpoint alone: history",
        ),
        pytest.param(
            {
                "connections": Reading.failed(UNSEEN),
                "pod_resources": Reading.failed(NOT_MOUNTED),
                "checkpoint": Reading(BEFORE_THE_SOCKET),
            },
            "problem",
            f"{GPU}: not registered since the plugin socket was created (the kubelet's connections cannot be "
            f"seen: {UNSEEN})",
            list(REREGISTER_FIX),
            id="unseen, the checkpoint older than the socket",
        ),
        pytest.param(
            {
                "connections": Reading.failed(UNSEEN),
                "pod_resources": Reading.failed(NOT_MOUNTED),
                "checkpoint": Reading.failed("cannot open the checkpoint: Permission denied"),
            },
            "unknown",
            f"{GPU}: cannot be told: the kubelet's connections cannot be seen: {UNSEEN}; {NOT_MOUNTED}; "
            "cannot open the checkpoint: Permission denied",
            [],
            id="nothing readable",
        ),
    ],
)
def test_registration_is_judged_as_the_sidecar_judges_it(
    changes: dict[str, Any], verdict: str, evidence: str, fix: list[str]
) -> None:
    """The kubelet's live connection first, then pod-resources; the checkpoint only dates an acceptance."""
    cause = registration_row(**changes)
    assert cause.verdict == verdict
    assert cause.evidence[0].startswith(evidence), cause.evidence
    assert cause.fix == fix


def test_zero_or_only_unhealthy_devices_while_held_is_registered() -> None:
    """pod-resources and the checkpoint list healthy devices only: a plugin whose GPUs all turned unhealthy
    lists none. Held, it is registered (a restart would only hide its health events); the devices row says
    what is missing."""
    none = replace(CHECKPOINT, registered={GPU: ()})
    nothing: Reading[dict[str, frozenset[str]]] = Reading({})
    for pod_resources in (nothing, Reading.failed(NOT_MOUNTED)):
        evidence = replace(HEALTHY, checkpoint=Reading(none), pod_resources=pod_resources)
        causes = diagnose(evidence)
        registered = one(causes, "plugin-not-registered")
        assert registered.verdict == "ok"
        assert registered.evidence[0].startswith(
            f"{GPU}: the kubelet holds a connection to nvidia-gpu.sock; "
        )
        assert registered.evidence[0].endswith("no healthy device (registered all the same)")
        assert one(causes, "devices-not-registered").verdict == "problem"
        assert causes[0].id == "devices-not-registered"


def test_a_registration_of_several_plugins_is_judged_per_plugin() -> None:
    ascend = plugin_evidence(
        spec=PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock"), connections=Reading(0)
    )
    cause = registration_cause(replace(HEALTHY, plugins=(plugin_evidence(), ascend)))
    assert cause.verdict == "problem"
    assert cause.evidence == [
        "huawei.com/Ascend910B3: the kubelet holds no connection to Ascend910B3.sock: never registered "
        "(the kubelet's checkpoint does not list huawei.com/Ascend910B3)",
        HELD,
    ]
    assert cause.fix[-1] == RESTART_PLUGIN


@pytest.mark.parametrize(
    ("expect", "host", "listed", "verdict", "evidence"),
    [
        (DeviceExpectation(), 3, 2, "unknown", "not checked: give --expect-devices N, or auto"),
        (AUTO_DEVICES, 0, 2, "unknown", f"no host device matches {GLOB}"),
        (
            AUTO_DEVICES,
            3,
            2,
            "problem",
            f"{GPU}: the host has 3 device node(s) ({GLOB}), the kubelet lists 2",
        ),
        (AUTO_DEVICES, 2, 2, "ok", f"{GPU}: the kubelet lists 2 of 2"),
        (
            DeviceExpectation.at_least(4),
            0,
            2,
            "problem",
            f"{GPU}: 4 device(s) expected (--expect-devices), the kubelet lists 2",
        ),
        (DeviceExpectation.at_least(2), 0, 20, "ok", f"{GPU}: the kubelet lists 20 of 2"),
    ],
)
def test_devices_row_follows_expect_devices(
    expect: DeviceExpectation, host: int, listed: int, verdict: str, evidence: str
) -> None:
    nodes = tuple(f"/dev/nvidia{i}" for i in range(host))
    uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(listed)]
    live = Reading({GPU: frozenset(hami_device_ids(uuids))})  # each GPU as ten split IDs
    cause = devices_cause(replace(HEALTHY, pod_resources=live, expect_devices=expect, host_devices=nodes))
    assert cause.verdict == verdict
    assert cause.evidence[0].startswith(evidence)
    assert bool(cause.fix) == (verdict == "problem")


@pytest.mark.parametrize(
    ("checkpoint", "listed"),
    [
        (CHECKPOINT, 2),  # HAMi's split IDs once per GPU
        (replace(CHECKPOINT, registered={GPU: ("GPU-0", "GPU-0", "GPU-1::0", "GPU-1::1")}), 2),
        (replace(CHECKPOINT, mtime_ns=KUBELET_ID.mtime_ns - 1), 0),  # another kubelet's: not counted
    ],
)
def test_without_pod_resources_the_devices_are_counted_from_a_current_checkpoint(
    checkpoint: Checkpoint, listed: int
) -> None:
    evidence = replace(
        HEALTHY,
        pod_resources=Reading.failed(NOT_MOUNTED),
        checkpoint=Reading(checkpoint),
        expect_devices=DeviceExpectation(),
    )
    assert devices_cause(evidence).evidence[-1] == f"{GPU}: the kubelet lists {listed}"


def test_log_rows() -> None:
    unreadable = LogFindings("/var/log/kubelet.log", problem="cannot read /var/log/kubelet.log: denied")
    assert log_cause("kubelet-log", [unreadable]).evidence == [unreadable.problem]
    assert log_cause("kubelet-log", [unreadable]).verdict == "unknown"
    assert log_cause("kubelet-log", []).evidence == ["no log given"]
    empty = LogFindings("journalctl -u kubelet", read=True)  # k3s: nothing under the kubelet's unit
    assert (log_cause("kubelet-log", [empty]).verdict, log_cause("kubelet-log", [empty]).evidence) == (
        "unknown",
        ["journalctl -u kubelet: no line could be read"],
    )
    quiet = LogFindings("/var/log/kubelet.log", read=True, lines=3)
    assert log_cause("kubelet-log", [unreadable, quiet]).verdict == "ok"
    bad = klog(
        "I", '"Bad registration request from device plugin" err="the ResourceName \\"gpu\\" is invalid"'
    )
    dial = klog(
        "E", '"Failed to connect to new client" err="failed to dial device plugin: context deadline exceeded"'
    )
    noisy = scan((bad * 3 + dial).encode(), KUBELET_PATTERNS, "/var/log/kubelet.log", None, time.time())
    cause = log_cause("kubelet-log", [noisy, quiet])
    assert cause.verdict == "problem"
    assert cause.evidence == [
        "/var/log/kubelet.log: 3 x 'Bad registration request from device plugin': the resource name is not "
        f"<domain>/<name>; newest: {bad.strip()}",
        "/var/log/kubelet.log: 1 x 'Failed to connect to new client': the plugin did not answer on its "
        f"socket within the kubelet's 10 s dial; newest: {dial.strip()}",
        "/var/log/kubelet.log: no current registration error",
    ]
    assert cause.fix[0].startswith("the plugin must speak v1beta1")
    assert cause.fix[-1] == RESTART_PLUGIN


@pytest.mark.parametrize(
    ("sample", "verdict"),
    [
        (growth(rss_mib=1.0, fds=3, threads=1), "ok"),
        (growth(rss_mib=20.0), "problem"),
        (growth(fds=100), "problem"),
        (growth(threads=20), "problem"),
    ],
)
def test_growth_row_from_two_samples(sample: ProcessGrowth, verdict: str) -> None:
    cause = growth_cause(PluginProcesses("nvidia-device-plugin", True, (sample,)), rss_growth_mib=20.0)
    assert cause.verdict == verdict
    assert cause.evidence[0].startswith("pid 42: RSS ")
    assert ("$ ps -o rss,nlwp -p 42" in cause.fix) == (verdict == "problem")


def test_growth_row_without_a_visible_plugin_process() -> None:
    cause = growth_cause(PluginProcesses("nvidia-device-plugin", visible=False), rss_growth_mib=20.0)
    assert cause.verdict == "unknown"
    assert cause.evidence == ["no process named nvidia-device-plugin is visible (run with hostPID)"]


SYNC = "Register is synchronous since 1.25"
POD_RESOURCES = "pod-resources GetAllocatableResources needs 1.23 (GA 1.28)"


@pytest.mark.parametrize(
    ("version", "notes"),
    [
        ("1.33.1", [SYNC]),
        ("1.25.0", [SYNC]),
        ("1.24.17", []),
        ("1.23.0", []),
        ("1.22.5", [POD_RESOURCES]),
        ("1.19.0", [POD_RESOURCES]),
    ],
)
def test_version_row_says_what_really_changed(version: str, notes: list[str]) -> None:
    cause = version_cause(KubeletProcess(True, pid=1, version=version))
    assert cause.verdict == "ok"
    assert cause.evidence[0] == f"kubelet v{version}; device plugin API v1beta1 is the only one served"
    assert [line.split(":")[0] for line in cause.evidence[1:]] == notes


def test_version_row_unknown_says_why() -> None:
    hidden = version_cause(KubeletProcess(False, why="no process named kubelet is visible"))
    assert (hidden.verdict, hidden.evidence) == (
        "unknown",
        ["version unknown: no process named kubelet is visible"],
    )
    silent = version_cause(KubeletProcess(True, pid=1))
    assert silent.evidence == ["version unknown: the kubelet binary did not print a Kubernetes version"]


def test_problems_come_first_in_causal_order() -> None:
    line = cri(klog("I", "Could not register device plugin: context deadline exceeded"))
    noisy = scan(line.encode(), PLUGIN_PATTERNS, "p.log", None, time.time())
    evidence = replace(
        HEALTHY,
        plugin_logs=(noisy,),
        plugins=(plugin_evidence(connections=Reading(0)),),
    )
    causes = diagnose(evidence)
    assert [c.id for c in causes[:2]] == ["plugin-not-registered", "plugin-log"]
    assert [c.id for c in causes[2:]] == [
        c for c, _ in CAUSES if c not in ("plugin-not-registered", "plugin-log")
    ]


def test_repairs_plan_only_old_dead_plugin_sockets_judged_whole() -> None:
    old = MIN_AGE + 1
    evidence = replace(
        HEALTHY,
        folder_sockets=(
            SocketFile(KUBELET_SOCK, False, IDENTITY, old),  # a dead kubelet.sock: the kubelet's to replace
            SocketFile(PLUGIN_SOCK, False, IDENTITY, old),
            SocketFile(f"{DP}/Ascend910B3.sock", True, IDENTITY, old),
            SocketFile(f"{DP}/young.sock", False, IDENTITY, MIN_AGE / 2),  # maybe between bind and listen
            SocketFile(f"{DP}/changed.sock", False, None, old),  # another file after the connect() test
        ),
    )
    assert plan(evidence) == [Repair(PLUGIN_SOCK, STALE, f"rm -- {PLUGIN_SOCK}")]
    assert plan(evidence)[0].identity == IDENTITY


def dead_socket(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
    age(path)


def test_repairs_apply_looks_again_before_removing(short_tmp: str) -> None:
    dead, alive, replaced = (os.path.join(short_tmp, f"{n}.sock") for n in ("dead", "alive", "replaced"))
    for path in (dead, alive, replaced):
        dead_socket(path)
    judged = {s.path: s for s in folder_sockets(short_tmp)}
    assert all(not s.listening and s.identity and s.age >= MIN_AGE for s in judged.values())
    os.unlink(replaced)  # a plugin re-binds it after the doctor judged it
    dead_socket(replaced)
    with socket.socket(socket.AF_UNIX) as listener:
        os.unlink(alive)
        listener.bind(alive)
        listener.listen()
        age(alive)
        done = apply([removal(p, judged[p].identity) for p in (dead, alive, replaced)])
        assert [(r.applied, r.error) for r in done] == [
            (True, ""),
            (False, "skipped: another file is there now (a plugin re-created it)"),
            (False, "skipped: another file is there now (a plugin re-created it)"),
        ]
        assert not os.path.exists(dead)
        assert os.path.exists(alive) and os.path.exists(replaced)
    assert fix_lines(done)[0] == f"fix: rm -- {dead}: done"
    assert sorted(os.listdir(short_tmp)) == ["alive.sock", "replaced.sock"]  # nothing left aside


def test_text_json_and_npd_renderings() -> None:
    long = "x" * 300
    evidence = replace(
        HEALTHY,
        plugins=(plugin_evidence(probe=SocketProbe(PLUGIN_SOCK, "refused", f"refused {long}", PLUGIN_ID)),),
        folder_sockets=(SocketFile(PLUGIN_SOCK, False, IDENTITY, MIN_AGE + 1),),
    )
    report = Report(diagnose(evidence), plan(evidence), evidence.kubelet)
    text = as_text(report, fixing=False).splitlines()
    assert max(map(len, text)) <= 80
    assert text[0] == "hami-doctor: 1 problem(s) found; the most likely cause first"
    assert text[3].split()[1:5] == ["plugin", "not", "serving", "PROBLEM"]
    assert "repairs (hami-doctor --fix applies these and nothing else):" in text
    doc = json.loads(as_json(report))
    assert (doc["healthy"], doc["exit_code"], doc["most_likely"]) == (False, 1, "plugin-not-serving")
    assert doc["kubelet"] == {
        "visible": True,
        "pid": 1,
        "listening": [KUBELET_SOCK],
        "version": "1.29.3",
        "distribution": "",
        "process": "",
        "ignored": [],
    }
    line = npd_line(report)
    assert line.startswith("plugin not serving: nvidia-gpu.sock: refused xxx")
    assert "\n" not in line and len(line) == 200
    healthy = Report(diagnose(HEALTHY), [], HEALTHY.kubelet)
    assert npd_line(healthy) == "hami-doctor: the device plugin is registered"
    assert as_text(healthy, fixing=False).startswith("hami-doctor: no problem found")


def test_long_commands_wrap_with_backslashes_and_still_paste() -> None:
    wrapped = shell_lines(RESTART_PLUGIN[2:])
    lines = wrapped.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 80
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert " ".join(w for w in wrapped.replace("\\\n", " ").split()) == RESTART_PLUGIN[2:]


# -- the log catalog: each real line, as the program writes it ---------------------------------------------
def kl(level: str, file: str, message: str) -> str:
    return klog(level, message, file=file)


def pl(level: str, file: str, message: str) -> str:
    """A plugin's klog line inside the CRI log file the kubelet keeps for its container."""
    return cri(klog(level, message, pid=1, file=file))


# Every error pattern, with a line the program prints (kubernetes v1.33-v1.37, HAMi, NVIDIA's plugin),
# the row it feeds and what the doctor must say it means.
CATALOG: dict[str, tuple[str, str, str]] = {
    "Bad registration request from device plugin": (
        kl(
            "I",
            "server.go:154",
            '"Bad registration request from device plugin with resource" resourceName="nvidia.com/gpu" '
            'err="requested API version \\"v1alpha\\" is not supported by kubelet. Supported version is '
            '[\\"v1beta1\\"]"',
        ),
        "kubelet-log",
        "the plugin asked for an API version other than v1beta1",
    ),
    "Error connecting to device plugin client": (
        kl(
            "I",
            "server.go:170",
            '"Error connecting to device plugin client" err="failed to dial device plugin: context deadline '
            'exceeded"',
        ),
        "kubelet-log",
        "the plugin did not answer on its socket within the kubelet's 10 s dial",
    ),
    "Failed to connect to new client": (
        kl(
            "E",
            "handler.go:94",
            '"Failed to connect to new client" err="failed to dial device plugin: context deadline exceeded" '
            'resource="nvidia.com/gpu"',
        ),
        "kubelet-log",
        "the plugin did not answer on its socket within the kubelet's 10 s dial",
    ),
    "Unable to connect to device plugin client with socket path": (
        kl(
            "E",
            "client.go:66",
            '"Unable to connect to device plugin client with socket path" err="failed to dial device plugin: '
            'dial unix /var/lib/kubelet/device-plugins/nvidia-gpu.sock: connect: no such file or directory" '
            'path="/var/lib/kubelet/device-plugins/nvidia-gpu.sock"',
        ),
        "kubelet-log",
        "no plugin socket at the path the kubelet joins to its own folder",
    ),
    "ListAndWatch ended unexpectedly for device plugin": (
        kl(
            "E",
            "client.go:90",
            '"ListAndWatch ended unexpectedly for device plugin" err="rpc error: code = Unavailable desc = '
            'error reading from server: EOF" resource="nvidia.com/gpu"',
        ),
        "kubelet-log",
        "the plugin's device stream ended",
    ),
    "Error while serving device plugin registration grpc server": (
        kl(
            "E",
            "server.go:123",
            '"Error while serving device plugin registration grpc server" err="accept unix '
            '/var/lib/kubelet/device-plugins/kubelet.sock: use of closed network connection"',
        ),
        "kubelet-log",
        "the kubelet's registration server stopped serving kubelet.sock",
    ),
    "Failed to listen to socket while starting device plugin registry": (
        kl(
            "E",
            "server.go:130",
            '"Failed to listen to socket while starting device plugin registry" err="listen unix '
            '/var/lib/kubelet/device-plugins/kubelet.sock: bind: read-only file system" '
            'socket="/var/lib/kubelet/device-plugins/"',
        ),
        "kubelet-log",
        "the kubelet could not create kubelet.sock",
    ),
    "Failed to cleanup the device plugin directory": (
        kl(
            "E",
            "server.go:104",
            '"Failed to cleanup the device plugin directory" err="unlinkat /var/lib/kubelet/device-plugins/'
            'nvidia-gpu.sock: operation not permitted" directory="/var/lib/kubelet/device-plugins/"',
        ),
        "kubelet-log",
        "the kubelet could not remove the old sockets",
    ),
    "Could not set selinux context on socket dir": (
        kl(
            "I",
            "server.go:96",
            '"Unprivileged containerized plugins might not work. Could not set selinux context on socket '
            'dir" '
            'path="/var/lib/kubelet/device-plugins/" err="operation not supported"',
        ),
        "kubelet-log",
        "SELinux",
    ),
    "Allocate failed due to": (
        kl(
            "I",
            "allocation_manager.go:525",
            '"Pod admission denied" podUID="8a1c" pod="default/cuda-job" reason="UnexpectedAdmissionError" '
            'message="Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. '
            'Requested: 1, Available: 0, which is unexpected"',
        ),
        "kubelet-log",
        "fewer healthy devices than the pod requested",
    ),
    "Could not register device plugin:": (
        pl("I", "server.go:325", "Could not register device plugin: context deadline exceeded"),
        "plugin-log",
        "kubelet.sock did not answer within the plugin's 5 s dial",
    ),
    "Failed to start one or more plugins. Retrying in 30s...": (
        pl("I", "main.go:299", "Failed to start one or more plugins. Retrying in 30s..."),
        "plugin-log",
        "retried in 30 s",
    ),
    "Could not start device plugin for": (
        pl(
            "I",
            "server.go:317",
            "Could not start device plugin for 'nvidia.com/gpu': listen unix "
            "/var/lib/kubelet/device-plugins/nvidia-gpu.sock: bind: read-only file system",
        ),
        "plugin-log",
        "could not serve its socket",
    ),
    "Failed to start plugin:": (
        pl("E", "main.go:413", "Failed to start plugin: context deadline exceeded"),
        "plugin-log",
        "a dial timed out",
    ),
    "No devices found. Waiting indefinitely.": (
        pl("I", "main.go:420", "No devices found. Waiting indefinitely."),
        "driver-runtime",
        "the plugin found no GPU in its container",
    ),
    "failed to create FS watcher for": (
        pl(
            "E",
            "main.go:132",
            "failed to create FS watcher for /var/lib/kubelet/device-plugins/: too many open files",
        ),
        "plugin-log",
        "cannot watch the device-plugins folder",
    ),
    "has repeatedly crashed recently. Quitting": (
        pl(
            "F", "server.go:535", "GRPC server for 'nvidia.com/gpu' has repeatedly crashed recently. Quitting"
        ),
        "plugin-log",
        "crashed more than 5 times",
    ),
    "device marked unhealthy": (
        pl(
            "I",
            "server.go:621",
            "'nvidia.com/gpu' device marked unhealthy: GPU-8e5f7c3a-4e1b-9d2c-1a6f-0b7e3d9c2f41",
        ),
        "plugin-log",
        "reported a GPU unhealthy",
    ),
    "Failed to register annotation:": (
        pl(
            "E",
            "register.go:340",
            'Failed to register annotation: Patch "https://10.96.0.1:443/api/v1/nodes/gpu-1": context '
            "deadline exceeded. Retrying in 30s...",
        ),
        "plugin-log",
        "could not write the node's GPU annotations",
    ),
    "Failed to initialize NVML": (
        pl("E", "factory.go:116", "Failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND."),
        "driver-runtime",
        "libnvidia-ml.so.1 is not in the plugin's container",
    ),
    "nvml init failed": (
        pl("W", "factory.go:124", "nvml init failed: ERROR_DRIVER_NOT_LOADED"),
        "driver-runtime",
        "the NVIDIA kernel driver is not loaded on the host",
    ),
    "Incompatible strategy detected": (
        pl("E", "factory.go:135", "Incompatible strategy detected auto"),
        "driver-runtime",
        "neither NVML nor Tegra",
    ),
}


def test_every_error_pattern_has_a_real_line() -> None:
    # HAMi's register loop's lines feed the hami-registration row, which needs the API server: their real
    # lines are tests/e2e/test_hami_registration.py's.
    errors = {
        p.text
        for p in KUBELET_PATTERNS + PLUGIN_PATTERNS
        if p.kind == "error" and p.cause != "hami-registration"
    }
    assert errors == set(CATALOG)
    assert all(p.source for p in KUBELET_PATTERNS + PLUGIN_PATTERNS)


@pytest.mark.parametrize("text", list(CATALOG))
def test_each_real_line_names_its_cause_and_fix(text: str) -> None:
    line, cause_id, meaning = CATALOG[text]
    kubelet = cause_id == "kubelet-log"
    patterns = KUBELET_PATTERNS if kubelet else PLUGIN_PATTERNS
    found = scan(line.encode(), patterns, "log", 3600, time.time())
    (hit,) = found.hits
    assert (hit.text, hit.count, hit.history) == (text, 1, False)
    assert meaning in hit.meaning
    logs = {"kubelet_logs": (found,)} if kubelet else {"plugin_logs": (found,)}
    causes = diagnose(replace(HEALTHY, **logs))  # type: ignore[arg-type]
    assert causes[0].id == cause_id
    assert meaning in causes[0].evidence[0]
    assert causes[0].evidence[0].endswith(line.split(" F ", 1)[-1].strip())
    assert causes[0].fix and all(f for f in causes[0].fix)
    assert [c.id for c in causes if c.verdict == "problem"] == [cause_id]


# -- the catalogue as data: doctor/patterns.toml, loaded and checked by doctor/patterns.py -------------------
def test_the_catalogue_ships_with_the_package_and_loads() -> None:
    """doctor/patterns.toml and the default profile's sets (hami_guard/profiles/patterns), as one."""
    sets = [
        ((REPO / "hami_guard" / "profiles" / "patterns" / f"{name}.toml").read_text(), f"{name}.toml")
        for name in DEFAULT_PROFILE.doctor.log_patterns
    ]
    values = {
        "resource": DEFAULT_PROFILE.resources.default,
        "selector": DEFAULT_PROFILE.chart.selector,
        "namespace": DEFAULT_PROFILE.chart.namespace,
    }
    shipped = load((REPO / "doctor" / "patterns.toml").read_text(), sets=sets, values=values)
    assert shipped == CATALOGUE == read()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "patterns.toml" in pyproject["tool"]["setuptools"]["package-data"]["doctor"]
    assert "profiles/patterns/*.toml" in pyproject["tool"]["setuptools"]["package-data"]["hami_guard"]
    # The texts shared by every vendor name the profile's resource and DaemonSet, filled in.
    assert DEFAULT_PROFILE.chart.selector in RESTART_PLUGIN and "{" not in RESTART_PLUGIN
    assert OTHER_PLUGIN_FIX[-1] == RESTART_PLUGIN
    for name, patterns in {
        "kubelet": KUBELET_PATTERNS,
        "plugin": PLUGIN_PATTERNS,
        "dra": DRA_PATTERNS,
    }.items():
        assert patterns and all(p.cause in SECTIONS[name] and p.source for p in patterns), name
    # The rules' own words for the catalogue's: the DRA log row tells the 1.36 noise by it.
    assert [m for p in DRA_PATTERNS for _, m in p.refine if m.startswith(NOISE)]
    assert any(words == ALREADY_CONNECTED for p in KUBELET_PATTERNS for words, _ in p.refine)


@pytest.mark.parametrize(
    "patterns", [KUBELET_PATTERNS, PLUGIN_PATTERNS, DRA_PATTERNS], ids=["kubelet", "plugin", "dra"]
)
def test_every_pattern_compiles_and_each_refinement_is_reachable(patterns: tuple[Pattern, ...]) -> None:
    """Each pattern, in each spelling it is searched for, is found as itself among its section's; each
    refinement's words give its meaning (no earlier one of the same pattern hides it)."""
    for p in patterns:
        spellings = (
            {p.text, p.text[:1].swapcase() + p.text[1:], p.text.lower()} if p.ignore_case else {p.text}
        )
        for text in spellings:
            found = scan(klog("E", text).encode(), patterns, "log", None, time.time())
            if p.kind == "error":
                assert [(h.pattern, h.meaning) for h in found.hits] == [(p, p.meaning)], text
            else:  # a registration, or an attempt no rejection follows
                assert (found.hits, bool(found.registered)) == ([], True), text
        for words, meaning in p.refine:
            assert p.explain(f"{p.text}: {words}") == meaning, (p.text, words)


MINIMAL_CATALOGUE = """
[shared]
restart-plugin = "$ restart the plugin"
runtime-fix = ["fix the runtime"]
driver-fix = ["load the driver", "$ nvidia-smi -L"]
already-connected = "already connected"
restart-driver = "$ restart the driver"
other-plugin-fix = ["turn the other plugin off"]
no-driver-error = "no driver error"
both = ["@runtime-fix", "@driver-fix"]

[[kubelet]]
text = "Bad registration request"
cause = "kubelet-log"
meaning = "refused"
fix = ["@restart-plugin"]
source = "server.go"
rejects = true

[[plugin]]
text = "Could not register"
cause = "plugin-log"
meaning = "failed"
fix = ["@both"]
source = "server.go"
refine = [["@already-connected", "refused again"]]

[[dra]]
text = "RegisterPlugin error"
cause = "dra-log"
meaning = "failed"
fix = ["look at the driver's log:", "@restart-driver"]
source = "operation_generator.go"
"""


def test_a_catalogue_resolves_its_shared_texts() -> None:
    c = load(MINIMAL_CATALOGUE, "test.toml")
    (kubelet,), (plugin,), (dra,) = c.kubelet, c.plugin, c.dra
    assert (kubelet.fix, kubelet.rejects, kubelet.kind) == (("$ restart the plugin",), True, "error")
    assert plugin.fix == ("fix the runtime", "load the driver", "$ nvidia-smi -L")
    assert plugin.refine == (("already connected", "refused again"),)
    assert dra.fix == ("look at the driver's log:", "$ restart the driver")
    assert c.fixes["driver-fix"] == ("load the driver", "$ nvidia-smi -L")


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("[[kubelet]]\n", "[[kubelet]\n", "test.toml: not valid TOML"),
        ("[[dra]]", "[[dri]]", "test.toml: unknown table dri"),
        (
            "rejects = true",
            "rejects = true\nrejetcs = true",
            "[[kubelet]] #1 ('Bad registration request'): unknown key rejetcs",
        ),
        ('source = "operation_generator.go"\n', "", "[[dra]] #1 ('RegisterPlugin error'): source missing"),
        (
            'cause = "kubelet-log"',
            'cause = "plugin-log"',
            "cause: 'plugin-log' is not a row of this section (kubelet-log)",
        ),
        (
            'cause = "plugin-log"',
            'cause = "plugin-logs"',
            "cause: 'plugin-logs' is not a row of this section",
        ),
        (
            'meaning = "refused"',
            'meaning = "refused"\nkind = "warning"',
            "kind: 'warning' is not one of error, attempt, success",
        ),
        ('meaning = "refused"', 'meaning = "refused\\nfor good"', "meaning: must be one line"),
        ('meaning = "refused"', 'meaning = ""', "meaning: must be a non-empty string"),
        ("rejects = true", 'rejects = "yes"', "rejects: must be true or false"),
        (
            "rejects = true",
            'rejects = true\nkind = "attempt"',
            "rejects: only an error line rejects a Register",
        ),
        ('"@restart-plugin"]', '"@restart-plugn"]', "'@restart-plugn' names no entry of [shared]"),
        ('restart-plugin = "$ restart the plugin"', 'restart-plugin = "@restart-plugin"', "refers to itself"),
        ("both = [", 'unused = "x"\nboth = [', "[shared] unused: used by no entry"),
        (
            'driver-fix = ["load the driver", "$ nvidia-smi -L"]\n',
            "",
            "'@driver-fix' names no entry of [shared]",
        ),
        (
            'restart-driver = "$ restart the driver"\n',
            'restart-driver = ["$ restart the driver"]\n',
            "[shared] restart-driver (the rules read it): must be a non-empty string",
        ),
        (
            '[["@already-connected", "refused again"]]',
            '[["@already-connected"]]',
            "refine[0]: must be a [words, meaning] pair",
        ),
        (
            "[[dra]]",
            '[[plugin]]\ntext = "could not REGISTER"\ncause = "plugin-log"\nmeaning = "m"\nsource = "s"\n'
            "[[dra]]",
            "[[plugin]] 'could not REGISTER' matches the same words as 'Could not register'",
        ),
    ],
)
def test_a_bad_catalogue_entry_is_named(old: str, new: str, error: str) -> None:
    assert MINIMAL_CATALOGUE.count(old) == 1, old
    with pytest.raises(CatalogueError, match=re.escape(error)):
        load(MINIMAL_CATALOGUE.replace(old, new), "test.toml")


def test_a_catalogue_reads_its_sets_as_one() -> None:
    """A set (a vendor's plugin lines) shares [shared] names with the catalogue it is read with, both
    ways; placeholders are filled with the values given."""
    head, plugin = MINIMAL_CATALOGUE.split("[[plugin]]")
    plugin, dra = plugin.split("[[dra]]")
    neutral = head.replace('runtime-fix = ["fix the runtime"]\n', "") + "[[dra]]" + dra
    vendor = '[shared]\nruntime-fix = ["fix the {vendor} runtime"]\n[[plugin]]' + plugin
    c = load(neutral, "test.toml", [(vendor, "set.toml")], {"vendor": "ACME"})
    assert c.plugin[0].fix == ("fix the ACME runtime", "load the driver", "$ nvidia-smi -L")
    assert c == load(MINIMAL_CATALOGUE.replace("fix the runtime", "fix the ACME runtime"), "test.toml")


@pytest.mark.parametrize(
    ("vendor", "values", "error"),
    [
        (
            '[shared]\nrestart-plugin = "$ again"\n',
            {},
            "set.toml: [shared] restart-plugin: defined in test.toml already",
        ),
        ('[shared]\nx = "y"\n', {}, "set.toml: [shared] x: used by no entry"),
        ("[[plugin]\n", {}, "set.toml: not valid TOML"),
        ("[plugins]\n", {}, "set.toml: unknown table plugins"),
        (
            '[[plugin]]\ntext = "the {word} failed"\ncause = "plugin-log"\nmeaning = "m"\nsource = "s"\n',
            {"vendor": "ACME"},
            "set.toml: [[plugin]] #1 ('the {word} failed') text: {word} is no placeholder (known: {vendor})",
        ),
    ],
)
def test_a_bad_set_is_named(vendor: str, values: dict[str, str], error: str) -> None:
    with pytest.raises(CatalogueError, match=re.escape(error)):
        load(MINIMAL_CATALOGUE, "test.toml", [(vendor, "set.toml")], values)


def test_a_catalogue_without_a_section_is_refused() -> None:
    text = MINIMAL_CATALOGUE[: MINIMAL_CATALOGUE.index("[[dra]]")].replace(', "@restart-driver"', "")
    with pytest.raises(CatalogueError, match=re.escape("test.toml: no [[dra]] entry")):
        load(text, "test.toml")


def test_generic_strings_alone_decide_nothing() -> None:
    """`context deadline exceeded` from an API call, or a dial error quoted alone, is no cause."""
    plugin = (
        pl("E", "reflector.go:158", '"Unhandled Error" err="failed to list *v1.Node: Get '
           '\\"https://10.96.0.1:443/api/v1/nodes\\": context deadline exceeded"')
        + pl("I", "main.go:301", "failed to dial device plugin: context deadline exceeded")
    )  # fmt: skip
    kubelet = kl(
        "E", "kubelet_node_status.go:549", '"Error updating node status" err="context deadline exceeded"'
    )
    p = scan(plugin.encode(), PLUGIN_PATTERNS, "p", None, time.time())
    k = scan(kubelet.encode(), KUBELET_PATTERNS, "k", None, time.time())
    assert (p.hits, k.hits, p.lines, k.lines) == ([], [], 2, 1)
    assert {
        c.id: c.verdict for c in diagnose(replace(HEALTHY, plugin_logs=(p,), kubelet_logs=(k,)))
    } == dict.fromkeys(ORDER, "ok")


def test_an_error_before_a_later_registration_is_history() -> None:
    register_failed = pl("I", "server.go:325", "Could not register device plugin: context deadline exceeded")
    registered = pl("I", "server.go:330", "Registered device plugin for 'nvidia.com/gpu' with Kubelet")
    found = scan((register_failed + registered).encode(), PLUGIN_PATTERNS, "p.log", None, time.time())
    assert [(h.text, h.history) for h in found.hits] == [("Could not register device plugin:", True)]
    cause = log_cause("plugin-log", [found])
    assert cause.verdict == "ok"
    assert cause.evidence[0].startswith("p.log: no current registration error; newest registration: ")
    assert cause.evidence[1].startswith("history (registered since): p.log: 1 x 'Could not register")
    # The kubelet: a stream that ended, then a Register that nothing rejected, is history (every
    # restart hami-guard causes writes one); a Register rejected after it keeps it current.
    ended = CATALOG["ListAndWatch ended unexpectedly for device plugin"][0]
    request = kl("I", "server.go:146", REQUEST)
    rejected = CATALOG["Bad registration request from device plugin"][0]
    history = scan((ended + request).encode(), KUBELET_PATTERNS, "k", None, time.time())
    assert [h.history for h in history.hits] == [True]
    assert log_cause("kubelet-log", [history]).verdict == "ok"
    current = scan((ended + request + rejected).encode(), KUBELET_PATTERNS, "k", None, time.time())
    assert sorted((h.text, h.history) for h in current.hits) == [
        ("Bad registration request from device plugin", False),
        ("ListAndWatch ended unexpectedly for device plugin", False),
    ]
    again = scan((ended + request + rejected + request).encode(), KUBELET_PATTERNS, "k", None, time.time())
    assert all(h.history for h in again.hits)
    # Another resource's registration is not this one's: the stream that ended stays current.
    ascend = kl("I", "server.go:146", REQUEST.replace("nvidia.com/gpu", "huawei.com/Ascend910B3"))
    other = scan((ended + ascend).encode(), KUBELET_PATTERNS, "k", None, time.time())
    assert [h.history for h in other.hits] == [False]


def test_log_lines_and_their_times() -> None:
    now = time.time()
    old = cri(klog("I", "Could not register device plugin: x", at=now - 7200), at=now - 7200)
    part = cri("Could not register device ", at=now).replace(" F ", " P ", 1)
    split = part + "\n" + cri("plugin: context deadline exceeded\n", at=now)  # one line, in two parts
    found = scan((old + split).encode(), PLUGIN_PATTERNS, "p", 3600, now)
    assert [(h.text, h.count, h.newest) for h in found.hits] == [
        (
            "Could not register device plugin:",
            1,
            "Could not register device plugin: context deadline exceeded",
        )
    ]
    assert lines_of(b"2026-12-03T06:02:46+01:00 stdout F x\n")[0] == (
        calendar.timegm((2026, 12, 3, 5, 2, 46, 0, 0, 0)),
        "x",
    )


def test_log_reading_refuses_what_is_not_a_regular_file(short_tmp: str) -> None:
    fifo = os.path.join(short_tmp, "fifo.log")
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file \\(a named pipe\\)"):
        read_tail(fifo)
    assert (
        scan_file(fifo, PLUGIN_PATTERNS, None).problem
        == f"cannot read {fifo}: not a regular file (a named pipe)"
    )
    assert "a folder" in scan_file(short_tmp, PLUGIN_PATTERNS, None).problem


async def test_a_fifo_as_the_plugin_log_does_not_hang(doctor: Doctor, short_tmp: str) -> None:
    fifo = os.path.join(short_tmp, "plugin.fifo")
    os.mkfifo(fifo)
    code, doc = await doctor.report("--plugin-log", fifo, "--kubelet-log", short_tmp)
    assert code == 1  # no kubelet here
    assert row(doc, "plugin-log")["verdict"] == "unknown"
    assert row(doc, "plugin-log")["evidence"] == [f"cannot read {fifo}: not a regular file (a named pipe)"]
    assert row(doc, "kubelet-log")["evidence"] == [f"cannot read {short_tmp}: not a regular file (a folder)"]


async def test_an_old_error_then_a_registration_is_shown_as_history(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    ended = CATALOG["ListAndWatch ended unexpectedly for device plugin"][0]
    with open(doctor.kubelet_log, "w") as f:
        f.write(ended + klog("I", REQUEST, file="server.go:146"))
    code, doc = await doctor.report()
    assert (code, row(doc, "kubelet-log")["verdict"]) == (0, "ok")
    assert row(doc, "kubelet-log")["evidence"][1].startswith("history (registered since): ")


async def test_no_nvml_in_the_plugin_names_the_runtime_not_a_restart(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    """HAMi 861, 2280, 452, 136; NVIDIA 1220: the plugin cannot start NVML and serves nothing."""
    _, plugin = node
    await plugin.crash()
    with open(doctor.plugin_log, "w") as f:
        f.write(
            CATALOG["Failed to initialize NVML"][0] + CATALOG["No devices found. Waiting indefinitely."][0]
        )
    code, doc = await doctor.report()
    assert (code, doc["most_likely"]) == (1, "driver-runtime")
    driver = row(doc, "driver-runtime")
    assert "libnvidia-ml.so.1 is not in the plugin's container" in driver["evidence"][0]
    assert driver["fix"] == list(RUNTIME_FIX)
    assert row(doc, "plugin-not-serving")["fix"] == [DRIVER_FIRST]  # not "restart the plugin"
    # No driver on the host at all: the driver is named.
    os.unlink(os.path.join(short_tmp, "dev", "nvidiactl"))
    _, doc = await doctor.report()
    assert any(
        e.startswith(f"no {short_tmp}/dev/nvidiactl on the host")
        for e in row(doc, "driver-runtime")["evidence"]
    )
    assert DRIVER_FIX[-1] in row(doc, "driver-runtime")["fix"]


# -- usage errors, NPD -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "env", "flag"),
    [
        (["--probe-timeout", "0"], {}, "--probe-timeout"),
        (["--probe-timeout", "nan"], {}, "--probe-timeout"),
        (["--sample-interval", "-1"], {}, "--sample-interval"),
        (["--since", "99999999999999999999d"], {}, "--since"),
        ([], {"HAMI_GUARD_PROBE_TIMEOUT": "inf"}, "HAMI_GUARD_PROBE_TIMEOUT"),
    ],
)
async def test_bad_numbers_are_one_line_usage_errors_and_npd_unknown(
    doctor: Doctor, args: list[str], env: dict[str, str], flag: str
) -> None:
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "doctor", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env}
    )
    out, err = await proc.communicate()
    assert (proc.returncode, out) == (2, b"")
    assert err.decode().startswith("hami-doctor: error: ") and err.count(b"\n") == 1 and flag.encode() in err
    for npd in (["--npd"], []):
        npd_env = {**os.environ, **env, **({} if npd else {"HAMI_GUARD_NPD": "true"})}
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "doctor", *npd, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=npd_env
        )
        out, err = await proc.communicate()
        assert proc.returncode == 2
        assert out.decode().startswith("hami-doctor: usage error: ") and out.count(b"\n") == 1
        assert flag.encode() in out


async def test_npd_cites_the_failing_check(doctor: Doctor) -> None:
    code, out = await doctor.run("--npd")  # no kubelet.sock at all
    assert code == 1
    assert out.startswith(f"socket path mismatch: SOCKET_MISSING: {doctor.dir}/kubelet.sock: nothing")


# -- another plugin on the same socket -----------------------------------------------------------------
async def test_another_device_plugin_serving_the_same_socket(
    doctor: Doctor, kubelet: FakeKubelet, dp_dir: str
) -> None:
    """The GPU Operator's NVIDIA plugin beside HAMi (HAMi 829, 736): it re-binds nvidia-gpu.sock from a
    network namespace of its own and registers last; the doctor runs in this pod's namespace."""
    netns.require()
    with Netns() as pod, Netns() as other:
        ours = await pod.aplugin(dp_dir)
        try:
            await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"])
            code, doc = await doctor.report(ns=pod)
            assert row(doc, "socket-owner")["verdict"] == "ok"
            assert (
                "this pod's network namespace holds the listener" in row(doc, "socket-owner")["evidence"][0]
            )
            theirs = await other.aplugin(dp_dir, devices=["GPU-other-0"])  # re-binds the file, registers
            try:
                code, doc = await doctor.report(ns=pod)
                assert (code, doc["most_likely"]) == (1, "socket-owner")
                owner = row(doc, "socket-owner")
                assert owner["evidence"][0].startswith(
                    "nvidia-gpu.sock: another device plugin serves nvidia-gpu.sock: its listener is in "
                    "another network namespace"
                )
                assert owner["fix"] == list(OTHER_PLUGIN_FIX)
                assert (
                    verdicts(doc)["plugin-not-serving"] == "ok"
                )  # the other plugin answers: only this row sees it
                code, out = await doctor.run("--npd", ns=pod)
                assert out.startswith(
                    "another plugin owns the socket: nvidia-gpu.sock: another device plugin"
                )
                # From the host's network namespace (the kubelet's), it cannot be told: said so.
                _, doc = await doctor.report()
                assert row(doc, "socket-owner")["verdict"] == "unknown"
                assert "host network" in row(doc, "socket-owner")["evidence"][0]
            finally:
                theirs.stop()
        finally:
            ours.stop()


# -- --fix and printed commands under races and hostile names -----------------------------------------------
HOSTILE = [
    "x;touch${IFS}PWNED;.sock",
    "a b.sock",
    "new\nline.sock",
    "$(touch PWNED).sock",
    "`touch PWNED`.sock",
    "-rf.sock",
    "it's.sock",
    "tab\tand \\ back.sock",
]


def pasted_commands(text: str) -> list[str]:
    """The repair commands of a text report, as a person would paste them (continuations joined)."""
    lines = text.split("repairs (hami-doctor --fix applies these and nothing else):\n", 1)[1].splitlines()
    commands, current = [], ""
    for line in lines:
        if line.startswith("    # ") or not line.strip():
            continue
        current += line.strip()[:-1] + " " if line.endswith(" \\") else line.strip()
        if not line.endswith(" \\"):
            commands.append(current)
            current = ""
    return commands


async def paste(shell: str, line: str, cwd: str) -> None:
    proc = await asyncio.create_subprocess_exec(shell, "-c", line, cwd=cwd)
    assert await asyncio.wait_for(proc.wait(), 30) == 0, line


async def test_pasted_repair_commands_remove_exactly_the_named_file(doctor: Doctor, short_tmp: str) -> None:
    bystander = os.path.join(doctor.dir, "bystander")
    Path(bystander).touch()
    for name in HOSTILE:
        dead_socket(os.path.join(doctor.dir, name))
    _, out = await doctor.run("--output", "text")
    commands = pasted_commands(out)
    assert len(commands) == len(HOSTILE)
    for name, line in zip(sorted(HOSTILE), commands, strict=True):
        assert line.startswith("rm -- ")
        before = set(os.listdir(doctor.dir))
        await paste("bash", line, short_tmp)
        assert before - set(os.listdir(doctor.dir)) == {name}, line
    assert sorted(os.listdir(doctor.dir)) == ["bystander"]
    assert not os.path.exists(os.path.join(short_tmp, "PWNED"))
    # Printable names paste into POSIX sh as well.
    dead_socket(os.path.join(doctor.dir, HOSTILE[0]))
    _, out = await doctor.run("--output", "text")
    await paste("sh", pasted_commands(out)[0], short_tmp)
    assert sorted(os.listdir(doctor.dir)) == ["bystander"]


def test_quoting_and_wrapping_keep_words_whole() -> None:
    for name in HOSTILE:
        assert split_words(f"rm -- {quote(name)}") == ["rm", "--", quote(name)]
    long = "/var/lib/kubelet/device-plugins/" + "a b " * 12 + ".sock"
    wrapped = shell_lines(f"rm -- {quote(long)} {quote(long)}")
    assert wrapped.count("\\\n") == 2
    assert quote(long) in wrapped.replace(" \\\n        ", " ")


REBINDER = """
import os, socket, sys, time
path = sys.argv[1]
listener = None
print("ready", flush=True)
for line in sys.stdin:  # a plugin re-binding its socket (HAMi: os.Remove, then net.Listen), on cue
    deadline = time.perf_counter() + float(line)
    while time.perf_counter() < deadline:
        pass
    new = socket.socket(socket.AF_UNIX)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    new.bind(path)
    new.listen()
    if listener is not None:
        listener.close()
    listener = new
    print("bound", flush=True)
"""


def test_fix_never_removes_a_socket_a_plugin_rebinds_meanwhile(short_tmp: str) -> None:
    """500 rounds: an old dead socket is judged, and while --fix removes it the plugin re-binds the path
    at a random moment; the plugin's new socket must stay, reachable, every time."""

    path = os.path.join(short_tmp, "nvidia-gpu.sock")
    proc = subprocess.Popen(
        [PY, "-c", REBINDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    outcomes: Counter[str] = Counter()
    removed_live = 0
    try:
        for _ in range(500):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the last round's live socket: its listener goes on the next cue
            dead_socket(path)
            judged = [s for s in folder_sockets(short_tmp) if s.path == path]
            repairs_ = plan(replace(HEALTHY, folder_sockets=tuple(judged), kubelet_path=KUBELET_SOCK))
            assert len(repairs_) == 1
            proc.stdin.write(f"{random.uniform(0, 0.00015)}\n")
            proc.stdin.flush()
            (done,) = apply(repairs_)
            assert proc.stdout.readline() == "bound\n"
            outcomes["removed" if done.applied else done.error] += 1
            if try_connect(path, timeout=1.0) is not None:
                removed_live += 1
            assert [n for n in os.listdir(short_tmp) if n.endswith(".removing")] == []
    finally:
        proc.kill()
        proc.wait()
    assert removed_live == 0, outcomes
    assert sum(outcomes.values()) == 500


def test_json_under_a_kubelet_restarting_every_3_ms(dp_dir: str, short_tmp: str) -> None:
    """A kubelet.sock deleted and re-created every 3 ms: every run prints its JSON report, never a
    traceback (30 runs in-process, then a small batch of real processes)."""

    log = os.path.join(short_tmp, "k.log")
    Path(log).write_text(klog("I", REQUEST))
    argv = [
        "--device-plugin-dir", dp_dir, "--output", "json", "--kubelet-log", log, "--plugin-log", log,
        "--pod-resources-socket", os.path.join(short_tmp, "none.sock"), "--sample-interval", "0",
        "--plugin-process-name", "none", "--kubelet-process-name", "none", "--probe-timeout", "0.2",
    ]  # fmt: skip
    flipper = subprocess.Popen(
        [PY, "-c", FLIPPER, os.path.join(dp_dir, "kubelet.sock"), "0.003"], stdout=subprocess.PIPE
    )
    try:
        assert flipper.stdout is not None and flipper.stdout.readline() == b"ready\n"
        seen: Counter[str] = Counter()
        for _ in range(30):
            out = io.StringIO()
            assert main(argv, out) == 1  # the plugin is missing: a problem, found
            doc = json.loads(out.getvalue())
            assert doc["errors"] == []
            seen.update(c["id"] for c in doc["causes"] if c["verdict"] == "problem")
        assert seen["plugin-not-serving"] == 30
        for _ in range(3):
            done = subprocess.run([PY, "-m", "doctor", *argv], capture_output=True, text=True, timeout=60)
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            json.loads(done.stdout)
    finally:
        flipper.kill()
        flipper.wait()


def test_the_window_starts_at_the_first_line_within_since() -> None:
    now = time.time()
    old = kl(
        "E", "client.go:90", '"ListAndWatch ended unexpectedly for device plugin" resource="nvidia.com/gpu"'
    )
    old = klog("E", old.split("] ", 1)[1].strip(), at=now - 7200)
    fresh = klog("I", REQUEST, at=now - 60)
    found = scan((old * 20000 + fresh * 3).encode(), KUBELET_PATTERNS, "k", 3600, now)
    assert (found.lines, found.hits) == (3, [])
    assert scan((old * 3).encode(), KUBELET_PATTERNS, "k", 3600, now).lines == 0
    assert scan((old * 3).encode(), KUBELET_PATTERNS, "k", None, now).hits[0].count == 3


# -- what a node's log or checkpoint may hold: every reader answers, whatever the bytes --------------------
def test_a_resource_name_that_is_not_utf8_is_replaced_not_fatal() -> None:
    """One byte that is not UTF-8 in the kubelet's log never costs the log: it reads as U+FFFD."""
    ended = CATALOG["ListAndWatch ended unexpectedly for device plugin"][0].replace("gpu", "gp\udcff")
    request = kl("I", "server.go:146", REQUEST.replace("gpu", "gp\udcff"))
    found = scan((ended + request).encode(errors="surrogateescape"), KUBELET_PATTERNS, "k", None, time.time())
    assert found.registered.endswith('resourceName="nvidia.com/gp\ufffd"')
    assert [(h.text, h.history) for h in found.hits] == [
        ("ListAndWatch ended unexpectedly for device plugin", True)
    ]
    assert log_cause("kubelet-log", [found]).verdict == "ok"


def test_cri_partial_lines_are_joined_up_to_a_bound() -> None:
    """A line the runtime split in 16 KiB P lines is joined up to MAX_JOINED; the rest continues as a line
    of its own, so a message past the bound is still found."""
    now = time.time()
    part = "x" * (16 * 1024 - 1) + " "
    parts = [part] * 160  # 2.5 MiB
    parts[100] = "Could not register device plugin: context deadline exceeded " + part[60:]
    log = "".join(cri(p + "\n", at=now).replace(" F ", " P ", 1) for p in parts) + cri("end\n", at=now)
    lines = lines_of(log.encode())
    assert [len(line.encode()) for _, line in lines] == [MAX_JOINED, MAX_JOINED, 512 * 1024 + len("end")]
    assert {when for when, _ in lines} == {calendar.timegm(time.gmtime(now))}
    found = scan(log.encode(), PLUGIN_PATTERNS, "p", 3600, now)
    assert found.lines == 3
    assert [(h.text, h.count) for h in found.hits] == [("Could not register device plugin:", 1)]
    assert found.hits[0].meaning.startswith("kubelet.sock did not answer within")


def test_a_long_line_is_one_line_however_often_it_matches() -> None:
    """One line, one pattern (the first in it), however long the line: the scan goes on at the next line."""
    message = "Could not register device plugin: connection refused "
    line = pl("E", "server.go:325", message * 40000).rstrip("\n") + "\n"  # 2 MiB
    found = scan((line + line).encode(), PLUGIN_PATTERNS, "p", 3600, time.time())
    assert found.lines == 2
    ((text, count, newest, meaning),) = [(h.text, h.count, h.newest, h.meaning) for h in found.hits]
    assert (text, count, len(newest)) == ("Could not register device plugin:", 2, MAX_LINE)
    assert meaning == "the plugin's kubelet.sock is a dead file: nothing listens on it"


def test_a_log_path_no_file_can_have_is_a_problem_not_an_error() -> None:
    assert scan_file("/var/log/x\0y", PLUGIN_PATTERNS, None).problem == (
        "cannot read '/var/log/x\\x00y': embedded null byte"
    )


def test_every_checkpoint_failure_is_a_checkpoint_error(short_tmp: str) -> None:
    """Whatever the file (or the path), read_checkpoint answers a Checkpoint or raises CheckpointError,
    the one failure its callers handle."""
    path = os.path.join(short_tmp, "kubelet_internal_checkpoint")

    def read(data: bytes) -> dict[str, tuple[str, ...]] | str:
        with open(path, "wb") as f:
            f.write(data)
        try:
            return dict(read_checkpoint(path, max_bytes=1 << 20).registered)
        except CheckpointError as e:
            return str(e)

    real = (REPO / "fuzz" / "corpus" / "checkpoint" / "new-stream-ended").read_bytes()  # the kubelet's own
    assert read(real) == {"huawei.com/Ascend910B3": ("NPU-0", "NPU-1"), "nvidia.com/gpu": ()}
    assert read(b' {"Data": {"RegisteredDevices": {"a/b": ["x", 1, null], "c/d": 7, "e/f": null}}}') == {
        "a/b": ("x",),
        "e/f": (),
    }
    invalid = "the checkpoint is not valid JSON (truncated or corrupt)"
    assert read(real[:-20]) == invalid
    assert read(b"\xff\xfe{") == invalid
    assert read(b"[" * 100000) == invalid  # deeper than the parser recurses
    assert read(b'{"Data": {"RegisteredDevices": {"a/b": [' + b"9" * 5000 + b"]}}}") == invalid
    assert read(b" \n") == "the checkpoint is empty"
    assert read(b'{"Data": []}') == "the checkpoint has no Data object"
    assert (
        read(b'{"Data": {"RegisteredDevices": []}}') == "the checkpoint's RegisteredDevices is not an object"
    )
    assert (
        read(b" " * ((1 << 20) + 1))
        == f"the checkpoint is {(1 << 20) + 1} bytes, over the 1048576-byte bound: "
        "too large to be a kubelet's"
    )
    os.unlink(path)
    for where, reason in (
        (path, "no checkpoint: the kubelet has not recorded any device plugin"),
        (short_tmp, "the checkpoint is a folder, not a regular file"),
        (path + "\0", "cannot open the checkpoint: embedded null byte"),
    ):
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(where)
        assert str(e.value) == reason
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match=r"^the checkpoint is a FIFO, not a regular file$"):
        read_checkpoint(path)  # opened without blocking: a FIFO never hangs the reader


@pytest.mark.parametrize(("since", "asked"), [(7200.0, "--since -7200s"), (math.inf, ""), (math.nan, "")])
def test_the_journal_window_from_any_since(
    short_tmp: str, monkeypatch: pytest.MonkeyPatch, since: float, asked: str
) -> None:
    """An endless (or undefined) window asks the journal for everything, never raises."""
    line = CATALOG["Failed to connect to new client"][0]
    monkeypatch.setenv("PATH", fake_journal(short_tmp, {"kubelet": line})["PATH"])
    found = scan_journal(("kubelet",), KUBELET_PATTERNS, since)
    assert [h.text for h in found.hits] == ["Failed to connect to new client"]
    args = Path(short_tmp, "bin", "args").read_text()
    assert ("--since" in args, asked in args) == (bool(asked), True)


# -- the package's shape: imports one way, short rules, every public name said -----------------------------
def doctor_modules() -> dict[str, ast.Module]:
    """Every module of doctor/, by its dotted name, parsed."""
    found = {}
    for path in sorted((REPO / "doctor").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def doctor_imports(tree: ast.Module) -> set[str]:
    """The doctor's modules a module imports, at the top or inside a function alike."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "doctor":
            names |= {f"doctor.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("doctor."):
            names.add(str(node.module))
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("doctor.")}
    return names


def test_the_doctor_imports_run_one_way() -> None:
    """No circle, whether through imports at the top or inside functions; the records import nothing of
    the doctor, and the catalogue and the scanner nothing but the records."""
    graph = {name: doctor_imports(tree) for name, tree in doctor_modules().items()}
    assert graph["doctor.types"] == set()
    assert graph["doctor.patterns"] == graph["doctor.logscan"] == {"doctor.types"}
    assert not graph["doctor.render"] & {"doctor.evidence", "doctor.causes", "doctor.repairs"}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name not in done:
            for dep in graph.get(name, ()):
                visit(dep, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_no_rule_is_longer_than_60_lines() -> None:
    for name in ("doctor.causes", "doctor.dra.causes"):
        for node in ast.walk(doctor_modules()[name]):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                assert node.end_lineno - node.lineno < 60, f"{name}.{node.name}"


def test_every_public_class_and_function_of_the_doctor_has_a_docstring() -> None:
    """Modules, and their public classes, functions and methods (not the functions nested in these)."""
    defs = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    missing = []
    for name, tree in doctor_modules().items():
        if ast.get_docstring(tree) is None:
            missing.append(name)
        members = [n for n in tree.body if isinstance(n, defs)]
        members += [m for c in members if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, defs)]
        missing += [
            f"{name}: {n.name}"
            for n in members
            if not n.name.startswith("_") and ast.get_docstring(n) is None
        ]
    assert missing == []
