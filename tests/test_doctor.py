"""hami-doctor: each root cause diagnosed from evidence, in a scenario of its own, as the most likely."""

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
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

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
            PY, "-m", "sidecar.doctor",
            "--device-plugin-dir", self.dir,
            "--pod-resources-socket", os.path.join(self.tmp, "pod-resources", "kubelet.sock"),
            "--kubelet-log", self.kubelet_log,
            "--plugin-log", self.plugin_log,
            "--device-glob", os.path.join(self.tmp, "dev", "nvidia[0-9]*"),
            "--plugin-process-name", "no-such-plugin",
            "--sample-interval", "0.2",
            "--probe-timeout", "0.5",
            *extra,
        ]  # fmt: skip

    async def run(self, *extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *self.argv(*extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert b"Traceback" not in err, err.decode()
        assert proc.returncode is not None
        return proc.returncode, out.decode()

    async def report(self, *extra: str) -> tuple[int, dict[str, object]]:
        code, out = await self.run("--output", "json", *extra)
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
    with growing_process("fake-plugin", grow_mib=0) as _:
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
    argv = [a if a != doctor.kubelet_log else "journal" for a in doctor.argv("--output", "json")]
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, env=env)
    out, _ = await proc.communicate()
    doc = json.loads(out)
    assert doc["most_likely"] == "kubelet-log"
    assert Path(short_tmp, "bin", "args").read_text().split()[:2] == ["-u", "kubelet"]


async def test_plugin_registration_errors(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    with open(doctor.plugin_log, "a") as f:
        f.write("2026-12-02T10:00:00Z Could not register device plugin: context deadline exceeded\n" * 2)
    code, doc = await doctor.report("--since", "100000d")
    assert (code, doc["most_likely"]) == (1, "plugin-log")


@contextlib.contextmanager
def growing_process(name: str, grow_mib: int) -> Iterator[int]:
    """A process named `name` that adds `grow_mib` MiB of resident memory every 50 ms for 1 s."""
    folder = Path(os.environ.get("TMPDIR", "/tmp"), f"hg-growth-{os.getpid()}")
    folder.mkdir(exist_ok=True)
    exe = folder / name
    with contextlib.suppress(FileExistsError):
        exe.symlink_to(os.path.realpath(PY))
    code = (
        "import sys, time\nkeep = []\nprint(1, flush=True)\n"
        "for _ in range(20):\n    keep.append(bytearray(int(sys.argv[1]) * 2**20)); time.sleep(0.05)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([str(exe), "-c", code, str(grow_mib)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


async def test_plugin_resource_growth(doctor: Doctor, node: tuple[FakeKubelet, FakeDevicePlugin]) -> None:
    with growing_process("leaky-plugin", grow_mib=10):
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
    proc = await asyncio.create_subprocess_exec(
        *doctor.argv("--npd"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(broken.parent)},
    )
    stdout, stderr = await proc.communicate()
    code, out = proc.returncode or 0, stdout.decode()
    assert b"Traceback" not in stderr
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
