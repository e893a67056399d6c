"""--plugin-candidates: hami-sidecar learns which of several resources this node's plugin serves (Ascend's
plugin on a cluster of several chips: each node serves its own chip's `huawei.com/<commonWord>` on
`<commonWord>.sock`), from the kernel's listeners of its own network namespace, before it judges anything.

Real processes and real sockets: the sidecar and "this pod's" plugin run in the test's network namespace
(the pod's), the kubelet's stand-in and a look-alike plugin in namespaces of their own (`testing.netns`:
root, as in CI), the kubelet's as on a node where the pod has no hostNetwork. Until one candidate is
served here the sidecar restarts nothing: every /healthz the tests ask on the way is 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.candidates import CHECK, CandidateWait, Where, look
from sidecar.health import Status
from testing import free_port, netns
from testing.netns import Netns, PluginProcess
from tests.conftest import wait_for

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_GUARD_")}
NPU = {
    name: PluginSpec(f"huawei.com/{name}", f"{name}.sock")
    for name in ("Ascend910B3", "Ascend310P", "Ascend910A", "Ascend910B4", "Ascend910B2")
}
OURS = NPU["Ascend310P"]
# A socket that listens until its stdin closes, in the namespace it is started in.
LISTENER = (
    "import os, socket, sys\n"
    "p = sys.argv[1]\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.bind(p)\n"
    "s.listen()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def listening(path: str, ns: Netns | None = None) -> Iterator[None]:
    """A process listening on a Unix socket at `path`, in `ns` (None: the test's namespace, the pod's)."""
    argv = [sys.executable, "-c", LISTENER, path]
    proc = subprocess.Popen(
        ns.command(argv) if ns else argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def serving(dp_dir: str, spec: PluginSpec, ns: Netns | None = None) -> Iterator[PluginProcess]:
    """A device plugin serving `spec` (gRPC), not registering, in `ns` (None: this pod's namespace)."""
    p = PluginProcess.start(
        ns, dp_dir, resource=spec.resource, socket_name=spec.socket, devices=["NPU-0"], register=False
    )
    try:
        yield p
    finally:
        p.stop()


class Sidecar:
    """hami-sidecar as a process in the test's network namespace, asked over loopback."""

    def __init__(self, root: str, dp_dir: str, candidates: list[PluginSpec], *extra: str) -> None:
        self.port = free_port()
        self.log = open(os.path.join(root, "sidecar.log"), "w+")  # noqa: SIM115 - closed in stop()
        argv = [
            sys.executable, "-m", "sidecar",
            "--device-plugin-dir", dp_dir,
            "--pod-resources-socket", os.path.join(root, "pod-resources", "kubelet.sock"),
            "--listen", f"127.0.0.1:{self.port}",
            "--polling-interval", "0.05",
            "--probe-interval", "0.5",
            "--probe-timeout", "0.2",
            *extra,
        ]  # fmt: skip
        env = {
            **CLEAN_ENV,
            "HAMI_GUARD_PLUGIN_CANDIDATES": ",".join(f"{c.resource}={c.socket}" for c in candidates),
        }
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=self.log)
        self.liveness: list[int] = []  # every /healthz answer the test saw

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def status(self) -> dict[str, Any]:
        """/status, once /healthz was asked too (its answer kept)."""
        code, _ = self.get("/healthz")
        if code:
            self.liveness.append(code)
        status, body = self.get("/status")
        return json.loads(body) if status in (200, 503) and body.startswith("{") else {}

    def until(
        self, holds: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.status()
            if doc and holds(doc):
                return doc
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {doc}\n{self.output()}"
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def namespaces() -> Iterator[tuple[Netns, Netns]]:
    """The node's (the kubelet's) and another pod's network namespaces."""
    netns.require()
    with Netns() as node, Netns() as other:
        yield node, other


@pytest.fixture
def started(short_tmp: str, dp_dir: str) -> Iterator[Callable[..., Sidecar]]:
    sidecars: list[Sidecar] = []

    def start(candidates: list[PluginSpec], *extra: str) -> Sidecar:
        sidecars.append(Sidecar(short_tmp, dp_dir, candidates, *extra))
        return sidecars[-1]

    yield start
    for s in sidecars:
        s.stop()


def looked(at_least: int) -> Callable[[dict[str, Any]], bool]:
    return lambda doc: doc.get("plugin_candidates", {}).get("looks", 0) >= at_least


def test_the_resource_this_pods_plugin_serves_is_chosen_and_no_look_alike(
    dp_dir: str,
    short_tmp: str,
    namespaces: tuple[Netns, Netns],
    started: Callable[..., Sidecar],
    process_table: None,
) -> None:
    """Five candidates: another pod's plugin serves Ascend910B3.sock (its listener is in its namespace),
    Ascend910B2.sock is a dead socket file, Ascend910A.sock a symbolic link to this pod's socket and
    Ascend910B4.sock a hard link to a socket of this pod's bound under another name. The sidecar waits
    (liveness 200, readiness 503 naming each), past its grace too (readiness only), then chooses the one
    this pod's plugin serves, and judges it as if --plugin had named it."""
    node, other = namespaces
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(os.path.join(dp_dir, NPU["Ascend910B2"].socket))
    os.symlink(OURS.socket, os.path.join(dp_dir, NPU["Ascend910A"].socket))
    decoy = os.path.join(short_tmp, "decoy.sock")
    with (
        listening(os.path.join(dp_dir, "kubelet.sock"), node),
        listening(decoy),
        serving(dp_dir, NPU["Ascend910B3"], other) as theirs,
    ):
        os.link(decoy, os.path.join(dp_dir, NPU["Ascend910B4"].socket))
        sidecar = started(list(NPU.values()), "--registration-grace", "1")
        doc = sidecar.until(looked(40), "40 looks (2 s at 0.05 s)")
        assert doc["plugin_candidates"]["chosen"] is None and doc["ready"] is False
        assert doc["settings"]["plugins"] == {}
        code, body = sidecar.get("/readyz?verbose")
        assert code == 503
        assert (
            "[!]plugin failed (no restart: a plugin restart would not mend it): waiting for this node's "
            in body
        )
        assert "Ascend910B3.sock: no listener in this pod's network namespace (not this pod's plugin)" in body
        assert "Ascend910B2.sock: no listener in this pod's network namespace" in body
        assert "Ascend910A.sock: a symbolic link, not followed" in body
        assert "Ascend910B4.sock: no listener in this pod's network namespace" in body
        assert "none within the 1s grace" in body
        # The plugin's readinessProbe asks /readyz less the node's checks: the wait is not one of them.
        gate = "/readyz?exclude=kubelet&exclude=checkpoint&exclude=devices&exclude=hami&exclude=recover"
        assert sidecar.get(gate)[0] == 503
        assert sidecar.get("/sidecarz") == (200, "ok")  # the sidecar itself works
        assert (
            'device_plugin_check_up{check="plugin",plugin="hami",resource=""} 0.0'
            in sidecar.get("/metrics")[1]
        )
        with serving(dp_dir, OURS):
            doc = sidecar.until(lambda d: d["plugin_candidates"].get("chosen") is not None, "the choice")
            assert doc["plugin_candidates"]["chosen"] == OURS.resource
            assert doc["plugin_candidates"]["evidence"].startswith("Ascend310P.sock's listener (socket ")
            assert doc["settings"]["plugins"] == {OURS.resource: OURS.socket}
            doc = sidecar.until(
                lambda d: d["checks"].get(f"plugin:{OURS.resource}", {}).get("state") == "ok",
                "the chosen plugin's check to pass",
            )
            assert not any(c.endswith(("Ascend910B3", "Ascend910B4", "Ascend910A")) for c in doc["checks"])
            assert "plugin" not in doc["checks"]  # the wait's check is gone with the wait
        assert theirs.proc.poll() is None  # the look-alike served all along
    assert set(sidecar.liveness) == {200}, sidecar.liveness
    assert len(sidecar.liveness) > 40
    assert "this node's plugin serves huawei.com/Ascend310P on Ascend310P.sock" in sidecar.output()


def test_two_candidates_served_here_are_not_guessed_between(
    dp_dir: str, namespaces: tuple[Netns, Netns], started: Callable[..., Sidecar]
) -> None:
    """This pod serves two candidates at once: which one the node registers cannot be told. Not ready, the
    reason naming the fix; liveness 200 look after look, however long it lasts."""
    node, _ = namespaces
    with (
        listening(os.path.join(dp_dir, "kubelet.sock"), node),
        serving(dp_dir, OURS),
        serving(dp_dir, NPU["Ascend910B3"]),
    ):
        sidecar = started([OURS, NPU["Ascend910B3"]])
        doc = sidecar.until(looked(40), "40 looks")
    assert doc["plugin_candidates"]["outcome"] == "undecided"
    assert doc["plugin_candidates"]["chosen"] is None
    assert doc["checks"]["plugin"]["state"] == "failed" and not doc["checks"]["plugin"]["fails_liveness"]
    assert doc["plugin_candidates"]["reason"] == (
        "this pod serves several candidates at once (huawei.com/Ascend310P (Ascend310P.sock), "
        "huawei.com/Ascend910B3 (Ascend910B3.sock)), so which one this node's plugin registers cannot be "
        "told: name this node's resource with --plugin (HAMI_GUARD_PLUGIN; the post-renderer's plugin=)"
    )
    assert set(sidecar.liveness) == {200}, sidecar.liveness


def test_the_host_network_is_not_guessed_in(dp_dir: str, started: Callable[..., Sidecar]) -> None:
    """The kubelet's listener in the sidecar's own namespace (hostNetwork): every process of the node
    listens there, so this pod's one served candidate proves nothing. Not ready, no restart."""
    with listening(os.path.join(dp_dir, "kubelet.sock")), serving(dp_dir, OURS):
        sidecar = started([OURS, NPU["Ascend910B3"]])
        doc = sidecar.until(looked(20), "20 looks")
    assert doc["plugin_candidates"]["outcome"] == "undecided"
    assert doc["plugin_candidates"]["reason"].startswith(
        "this pod's network namespace is the host's (hostNetwork: the kubelet's listener on kubelet.sock is "
        "in it)"
    )
    assert doc["settings"]["plugins"] == {}
    assert set(sidecar.liveness) == {200}, sidecar.liveness


def test_once_chosen_nothing_is_ready_before_the_first_round(
    dp_dir: str, namespaces: tuple[Netns, Netns], started: Callable[..., Sidecar]
) -> None:
    """The look chose, the first round of the one chosen has not ended (its plugin accepts and never
    answers: the round waits out a 3 s probe timeout): /readyz says probes are pending and /sidecarz is
    503 again, as for a sidecar told --plugin, until that round ends."""
    node, _ = namespaces
    with listening(os.path.join(dp_dir, "kubelet.sock"), node), listening(os.path.join(dp_dir, OURS.socket)):
        sidecar = started([OURS, NPU["Ascend910B3"]], "--probe-timeout", "3", "--probe-interval", "10")
        doc = sidecar.until(lambda d: d["plugin_candidates"].get("chosen") is not None, "the choice")
        assert doc["probe_rounds"] == 0, doc  # asked at once: the round waits 3 s for the plugin
        code, body = sidecar.get("/readyz?verbose")
        assert code == 503
        assert body.startswith("[~]probes pending: the first probe round has not finished"), body
        assert sidecar.get("/sidecarz")[0] == 503
        sidecar.until(lambda d: d["probe_rounds"] > 0, "the first round")
        assert sidecar.get("/sidecarz") == (200, "ok")
    assert set(sidecar.liveness) == {200}, sidecar.liveness


PIDS = "/sys/fs/cgroup/pids"  # cgroup v1's pids controller


@contextlib.contextmanager
def no_new_threads(pid: int) -> Iterator[None]:
    """`pid` in a pids cgroup of its own capped at the threads it has: it can make no new one (as in a
    pod whose pids limit is reached). Back in the root cgroup after."""
    if not os.access(os.path.join(PIDS, "cgroup.procs"), os.W_OK):
        pytest.skip("no writable cgroup v1 pids controller")
    group = os.path.join(PIDS, f"hami-guard-test-{os.getpid()}-{pid}")
    os.mkdir(group)
    try:
        with open(f"/proc/{pid}/status") as f:
            threads = next(line.split()[1] for line in f if line.startswith("Threads:"))
        with open(os.path.join(group, "pids.max"), "w") as f:
            f.write(threads)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError), open(os.path.join(PIDS, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        os.rmdir(group)


def test_judging_the_one_chosen_that_cannot_start_fails_readiness_only(
    dp_dir: str, namespaces: tuple[Netns, Netns], started: Callable[..., Sidecar]
) -> None:
    """The choice made, judging it cannot start (here no new thread may be made: a pids cgroup full at
    the threads the wait runs with): the sidecar's own fault. It says so where
    the plugin's readinessProbe and an operator look (the `plugin` check fails, no restart), never
    liveness, and it keeps serving (an exit would leave the plugin's livenessProbe no answer)."""
    node, _ = namespaces
    with listening(os.path.join(dp_dir, "kubelet.sock"), node):
        sidecar = started([OURS, NPU["Ascend910B3"]])
        sidecar.until(looked(3), "3 looks")
        with no_new_threads(sidecar.proc.pid):
            with listening(os.path.join(dp_dir, OURS.socket)):
                doc = sidecar.until(
                    lambda d: "could not start" in d["checks"].get("plugin", {}).get("reason", ""),
                    "the failure to start judging",
                )
            assert doc["plugin_candidates"]["chosen"] == OURS.resource
            assert doc["checks"]["plugin"]["state"] == "failed"
            assert not doc["checks"]["plugin"]["fails_liveness"]
            assert doc["checks"]["plugin"]["reason"].startswith(
                f"judging {OURS.resource} could not start: RuntimeError("
            )
            code, body = sidecar.get("/readyz?verbose")
            assert code == 503 and "[!]plugin failed (no restart" in body, body
            assert sidecar.get("/healthz") == (200, "ok")
            assert sidecar.proc.poll() is None
    assert set(sidecar.liveness) == {200}, sidecar.liveness
    assert f"judging {OURS.resource} could not start" in sidecar.output()


def test_without_the_kubelets_listener_nothing_is_chosen(dp_dir: str) -> None:
    """Whether this namespace is the host's is told by the kubelet's listener being elsewhere: with
    kubelet.sock missing, or a dead file, a served candidate waits."""
    with listening(os.path.join(dp_dir, OURS.socket)):
        seen = look(dp_dir, "kubelet.sock", [OURS, NPU["Ascend910B3"]])
        assert (seen.outcome, seen.served) == ("waiting", None)
        assert "kubelet.sock is not a socket file there" in seen.reason
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(os.path.join(dp_dir, "kubelet.sock"))
        seen = look(dp_dir, "kubelet.sock", [OURS, NPU["Ascend910B3"]])
        assert (seen.outcome, seen.served) == ("waiting", None)
        assert "nothing listens on kubelet.sock" in seen.reason


@contextlib.contextmanager
def stuck_folder(root: str) -> Iterator[str]:
    """A folder whose every look hangs, as on a hostPath mount that stopped answering: a FUSE mount whose
    daemon never answers (its first request waits for an INIT nobody reads). Closing the device ends it."""
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as e:
        pytest.skip(f"no FUSE here: {e}")
    folder = os.path.join(root, "stuck")
    os.mkdir(folder)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    try:
        if libc.mount(b"hami-guard-test", folder.encode(), b"fuse", 0, opts) != 0:
            pytest.skip(f"cannot mount FUSE: {os.strerror(ctypes.get_errno())}")
        try:
            yield folder
        finally:
            os.close(fd)  # the hung looks end (ENOTCONN)
            fd = -1
            libc.umount2(folder.encode(), 2)  # MNT_DETACH
    finally:
        if fd >= 0:
            os.close(fd)
        os.rmdir(folder)


async def test_a_look_that_hangs_is_late_at_the_grace(short_tmp: str) -> None:
    """The look never returns: the wait says so, and at the grace fails (readiness only), as it would
    for looks that return and find nothing."""
    with stuck_folder(short_tmp) as folder:
        wait = CandidateWait(
            Where(folder, "kubelet.sock", 0.05, 1.0), [OURS, NPU["Ascend910B3"]], lambda c: None
        )
        task = asyncio.create_task(wait.wait())
        try:
            check = wait.state.checks[CHECK.name]
            await wait_for(lambda: check.status is Status.FAILED, timeout=30, what="the wait late")
            assert wait.looks == 0 and not check.live_failed
            assert check.reason.startswith(
                f"a look at {folder} has not finished: a stuck mount? (none within"
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
