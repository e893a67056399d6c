"""hami-doctor: each root cause in a scenario of its own (a real process against the simulator), and
every rule, repair and rendering in-process from evidence built by hand."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from doctor.causes import (
    CAUSES,
    ORDER,
    RESTART_PLUGIN,
    Cause,
    devices_cause,
    diagnose,
    growth_cause,
    log_cause,
    protocol_cause,
    registration_cause,
    serving_cause,
    version_cause,
)
from doctor.evidence import (
    KubeletProcess,
    NodeEvidence,
    PluginEvidence,
    PluginProcesses,
    ProcessGrowth,
    ProcessSample,
    SocketFile,
    SocketProbe,
)
from doctor.logscan import LogFindings
from doctor.render import Report, as_json, as_text, fix_lines, npd_line, shell_lines
from doctor.repairs import STALE, Repair, apply, plan
from initcheck.checks import Finding
from initcheck.flags import AUTO_DEVICES, PluginSpec
from sidecar.rpc import unix_target
from sidecar.testing import FakeDevicePlugin, FakeKubelet
from sidecar.testing.grpcserve import GoStyleUnimplemented
from tests.conftest import wait_for

GPU = "nvidia.com/gpu"
PY = sys.executable


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
            *extra,
        ]  # fmt: skip

    async def run(self, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        """The one way a test starts hami-doctor: a real process, never a traceback on stderr."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv(*extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert b"Traceback" not in err, err.decode()
        assert proc.returncode is not None
        return proc.returncode, out.decode()

    async def report(self, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
        code, out = await self.run("--output", "json", *extra, env=env)
        doc: dict[str, object] = json.loads(out)
        return code, doc


def verdicts(doc: dict[str, object]) -> dict[str, str]:
    causes = doc["causes"]
    assert isinstance(causes, list)
    return {c["id"]: c["verdict"] for c in causes}


@pytest.fixture
def doctor(dp_dir: str, short_tmp: str) -> Doctor:
    os.makedirs(os.path.join(short_tmp, "dev"))
    for i in range(2):  # the host's two GPUs, as the simulated plugin reports them
        Path(short_tmp, "dev", f"nvidia{i}").touch()
    kubelet_log = os.path.join(short_tmp, "kubelet.log")
    plugin_log = os.path.join(short_tmp, "plugin.log")
    Path(kubelet_log).write_text(
        klog("I", '"Got registration request from device plugin with resource" resourceName="nvidia.com/gpu"')
    )
    Path(plugin_log).write_text("I1202 Starting GRPC server for 'nvidia.com/gpu'\nRegistered device plugin\n")
    return Doctor(dp_dir, short_tmp, kubelet_log, plugin_log)


def klog(level: str, message: str, at: float | None = None) -> str:
    t = time.localtime(at if at is not None else time.time())
    stamp = f"{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.000000"
    return f"{level}{stamp}    1234 manager.go:1] {message}\n"


@pytest.fixture
async def node(dp_dir: str, short_tmp: str) -> AsyncIterator[tuple[FakeKubelet, FakeDevicePlugin]]:
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as k, FakeDevicePlugin(dp_dir) as p:
        await wait_for(lambda: k.healthy_devices(GPU))
        yield k, p


async def test_healthy_node_exits_0_and_every_row_is_ok(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]
) -> None:
    with growing_process("fake-plugin", leak=False):
        code, doc = await doctor.report("--plugin-process-name", "fake-plugin")
    assert code == 0
    assert doc["healthy"] is True
    rows = verdicts(doc)
    # Every row is OK but the kubelet's version: no real kubelet binary runs here to ask.
    assert {k: v for k, v in rows.items() if k != "kubelet-version"} == dict.fromkeys(
        rows.keys() - {"kubelet-version"}, "ok"
    )
    assert rows["kubelet-version"] == "unknown"


async def test_socket_permission(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    kubelet, _ = node
    os.chmod(short_tmp, 0o755)
    os.chmod(doctor.dir, 0o755)
    os.chmod(kubelet.socket_path, 0o600)
    code, doc = await doctor.report("--plugin-uid", "1000", "--plugin-gid", "1000")
    assert (code, doc["most_likely"]) == (1, "socket-permission")


async def test_socket_path_mismatch(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], kubelet_elsewhere: tuple[object, str]
) -> None:
    _, where = kubelet_elsewhere
    code, out = await doctor.run()
    assert code == 1
    first = out.splitlines()[3]
    assert first.split()[1:4] == ["socket", "path", "mismatch"]
    assert where in out
    code, doc = await doctor.report()
    assert doc["most_likely"] == "socket-path"


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
    assert doc["repairs"] == [
        {
            "path": plugin.socket_path,
            "why": "a plugin socket nothing listens on (the plugin died)",
            "command": f"rm {plugin.socket_path}",
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
    causes = doc["causes"]
    assert isinstance(causes, list)
    (row,) = [c for c in causes if c["id"] == "kubelet-log"]
    assert row["evidence"][0].startswith(
        f"{doctor.kubelet_log}: 3 x 'Bad registration request from device plugin'"
    )
    assert "not supported" in row["evidence"][0]


async def test_kubelet_log_from_journalctl(
    doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin], short_tmp: str
) -> None:
    fake = Path(short_tmp, "bin", "journalctl")
    fake.parent.mkdir()
    line = 'E1202 10:00:00.000000 1 x.go:1] "failed to dial device plugin" err="context deadline exceeded"'
    fake.write_text(f'#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho \'{line}\'\n')
    fake.chmod(0o755)
    _, doc = await doctor.report(
        "--kubelet-log", "journal", env={"PATH": f"{fake.parent}:{os.environ['PATH']}"}
    )
    assert doc["most_likely"] == "kubelet-log"
    assert Path(short_tmp, "bin", "args").read_text().split()[:2] == ["-u", "kubelet"]


async def test_plugin_registration_errors(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    with open(doctor.plugin_log, "a") as f:
        f.write("2026-12-02T10:00:00Z Could not register device plugin: context deadline exceeded\n" * 2)
    code, doc = await doctor.report("--since", "3650d")
    assert (code, doc["most_likely"]) == (1, "plugin-log")


@contextlib.contextmanager
def growing_process(name: str, leak: bool) -> Iterator[int]:
    """A process named `name`; with `leak`, it starts a thread every 10 ms for as long as it runs
    (capped at 3000), so any two samples the doctor takes a fraction of a second apart see growth."""
    folder = Path(os.environ.get("TMPDIR", "/tmp"), f"hg-growth-{os.getpid()}")
    folder.mkdir(exist_ok=True)
    exe = folder / name
    with contextlib.suppress(FileExistsError):
        exe.symlink_to(os.path.realpath(PY))
    code = (
        "import sys, threading, time\nthreading.stack_size(256 * 1024)\nstop = threading.Event()\n"
        "print(1, flush=True)\n"
        "for _ in range(3000 if sys.argv[1] == 'leak' else 0):\n"
        "    threading.Thread(target=stop.wait, daemon=True).start(); time.sleep(0.01)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([str(exe), "-c", code, "leak" if leak else "steady"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


async def test_plugin_resource_growth(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    with growing_process("leaky-plugin", leak=True):
        code, doc = await doctor.report("--plugin-process-name", "leaky-plugin", "--sample-interval", "0.5")
    assert (code, doc["most_likely"]) == (1, "plugin-growth")


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
    protected = {p: fingerprint(p) for p in (kubelet.socket_path, kubelet.checkpoint_path)}

    _, out = await doctor.run()
    assert "repairs (hami-doctor --fix applies these and nothing else):" in out
    assert f"rm {plugin.socket_path}" in out
    assert os.path.exists(plugin.socket_path)  # without --fix nothing changes

    _, out = await doctor.run("--fix")
    assert f"fix: rm {plugin.socket_path}: done" in out
    assert f"fix: rm {other}: done" in out
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
    # An internal error (here a broken psutil installation) is NPD's Unknown, in one line.
    broken = Path(short_tmp, "broken", "psutil")
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('psutil C extension missing')\n")
    code, out = await doctor.run("--npd", env={"PYTHONPATH": str(broken.parent)})
    assert code == 2
    assert out.count("\n") == 1
    assert out.startswith("hami-doctor could not diagnose: ")


async def test_json_shape(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    _, doc = await doctor.report()
    assert set(doc) == {"healthy", "exit_code", "most_likely", "causes", "repairs", "kubelet"}
    causes = doc["causes"]
    assert isinstance(causes, list)
    assert len(causes) == 10
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


def plugin_evidence(**changes: Any) -> PluginEvidence:
    healthy = PluginEvidence(
        spec=GPU_SPEC,
        probe=SocketProbe(PLUGIN_SOCK, "alive", "GetDevicePluginOptions answered"),
        registered=True,
        registration="the kubelet lists 2 device(s)",
        listed=2,
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
    kubelet_socket=SocketProbe(KUBELET_SOCK, "alive", "serving v1beta1.Registration"),
    plugins=(plugin_evidence(),),
    kubelet=KubeletProcess(True, pid=1, version="1.29.3", listening=(KUBELET_SOCK,)),
    kubelet_logs=(LogFindings("/var/log/kubelet.log", read=True),),
    plugin_logs=(LogFindings("/var/log/pods/plugin.log", read=True),),
    plugin_process=PluginProcesses("nvidia-device-plugin", visible=True, growth=(growth(),)),
    folder_sockets=(SocketFile(KUBELET_SOCK, listening=True), SocketFile(PLUGIN_SOCK, listening=True)),
    kubelet_path=KUBELET_SOCK,
    expect_devices=AUTO_DEVICES,
    device_glob=GLOB,
    host_devices=("/dev/nvidia0", "/dev/nvidia1"),
)


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
    assert f"$ rm {PLUGIN_SOCK}" in cause.fix
    assert f"$ rm {DP}/Ascend910B3.sock" not in cause.fix  # a hung plugin still holds its socket
    assert cause.fix.count(RESTART_PLUGIN) == 1


def test_an_unregistered_plugin() -> None:
    cause = registration_cause([plugin_evidence(registered=False, registration="the checkpoint is older")])
    assert (cause.verdict, cause.evidence) == ("problem", [f"{GPU}: the checkpoint is older"])
    assert cause.fix[-1] == RESTART_PLUGIN
    assert registration_cause([plugin_evidence()]).verdict == "ok"


@pytest.mark.parametrize(
    ("expect", "host", "listed", "verdict", "evidence"),
    [
        (None, 3, 2, "unknown", "not checked: give --expect-devices N, or auto"),
        (AUTO_DEVICES, 0, 2, "unknown", f"no host device matches {GLOB}"),
        (
            AUTO_DEVICES,
            3,
            2,
            "problem",
            f"{GPU}: the host has 3 device node(s) ({GLOB}), the kubelet lists 2",
        ),
        (AUTO_DEVICES, 2, 2, "ok", f"{GPU}: the kubelet lists 2 of 2"),
        (4, 0, 2, "problem", f"{GPU}: 4 device(s) expected (--expect-devices), the kubelet lists 2"),
        (2, 0, 20, "ok", f"{GPU}: the kubelet lists 20 of 2"),
    ],
)
def test_devices_row_follows_expect_devices(
    expect: int | None, host: int, listed: int, verdict: str, evidence: str
) -> None:
    nodes = tuple(f"/dev/nvidia{i}" for i in range(host))
    cause = devices_cause([plugin_evidence(listed=listed)], expect, GLOB, nodes)
    assert cause.verdict == verdict
    assert cause.evidence[0].startswith(evidence)
    assert bool(cause.fix) == (verdict == "problem")


def test_log_rows() -> None:
    fix = ("read the log", "$ journalctl -u kubelet")
    unreadable = LogFindings("/var/log/kubelet.log", problem="cannot read /var/log/kubelet.log: denied")
    assert log_cause("kubelet-log", [unreadable], fix).evidence == [unreadable.problem]
    assert log_cause("kubelet-log", [unreadable], fix).verdict == "unknown"
    assert log_cause("kubelet-log", [], fix).evidence == ["no log given"]
    quiet = LogFindings("/var/log/kubelet.log", read=True)
    assert log_cause("kubelet-log", [unreadable, quiet], fix).verdict == "ok"
    noisy = LogFindings(
        "/var/log/kubelet.log",
        read=True,
        counts={"failed to dial device plugin": 1, "Bad registration request from device plugin": 3},
        last={
            "failed to dial device plugin": "E1 dial",
            "Bad registration request from device plugin": "E2 bad",
        },
    )
    cause = log_cause("kubelet-log", [noisy, quiet], fix)
    assert cause.verdict == "problem"
    assert cause.evidence == [
        "/var/log/kubelet.log: 3 x 'Bad registration request from device plugin', newest: E2 bad",
        "/var/log/kubelet.log: 1 x 'failed to dial device plugin', newest: E1 dial",
        "/var/log/kubelet.log: no registration error",
    ]
    assert cause.fix == list(fix)


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
    noisy = LogFindings(
        "p.log",
        read=True,
        counts={"Could not register device plugin": 1},
        last={"Could not register device plugin": "x"},
    )
    evidence = replace(
        HEALTHY,
        plugin_logs=(noisy,),
        plugins=(plugin_evidence(registered=False, registration="not registered"),),
    )
    causes = diagnose(evidence)
    assert [c.id for c in causes[:2]] == ["plugin-not-registered", "plugin-log"]
    assert [c.id for c in causes[2:]] == [
        c for c, _ in CAUSES if c not in ("plugin-not-registered", "plugin-log")
    ]


def test_repairs_plan_only_dead_plugin_sockets() -> None:
    evidence = replace(
        HEALTHY,
        folder_sockets=(
            SocketFile(KUBELET_SOCK, listening=False),  # a dead kubelet.sock: the kubelet's to replace
            SocketFile(PLUGIN_SOCK, listening=False),
            SocketFile(f"{DP}/Ascend910B3.sock", listening=True),
        ),
    )
    assert plan(evidence) == [Repair(PLUGIN_SOCK, STALE, f"rm {PLUGIN_SOCK}")]


def test_repairs_apply_looks_again_before_removing(short_tmp: str) -> None:
    dead, alive = os.path.join(short_tmp, "dead.sock"), os.path.join(short_tmp, "alive.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(alive)
        listener.listen()
        done = apply([Repair(dead, STALE, f"rm {dead}"), Repair(alive, STALE, f"rm {alive}")])
    assert [(r.applied, r.error) for r in done] == [
        (True, ""),
        (False, "skipped: it accepts connections again"),
    ]
    assert not os.path.exists(dead)
    assert os.path.exists(alive)
    assert fix_lines(done) == [
        f"fix: rm {dead}: done",
        f"fix: rm {alive}: skipped: it accepts connections again",
    ]


def test_text_json_and_npd_renderings() -> None:
    long = "x" * 300
    evidence = replace(
        HEALTHY,
        plugins=(plugin_evidence(probe=SocketProbe(PLUGIN_SOCK, "refused", f"refused {long}")),),
        folder_sockets=(SocketFile(PLUGIN_SOCK, listening=False),),
    )
    report = Report(diagnose(evidence), plan(evidence), evidence.kubelet)
    text = as_text(report, fixing=False).splitlines()
    assert max(map(len, text)) <= 80
    assert text[0] == "hami-doctor: 1 problem(s) found; the most likely cause first"
    assert text[3].split()[1:5] == ["plugin", "not", "serving", "PROBLEM"]
    assert "repairs (hami-doctor --fix applies these and nothing else):" in text
    doc = json.loads(as_json(report))
    assert (doc["healthy"], doc["exit_code"], doc["most_likely"]) == (False, 1, "plugin-not-serving")
    assert doc["kubelet"] == {"visible": True, "pid": 1, "listening": [KUBELET_SOCK], "version": "1.29.3"}
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
