"""Names bound to lie about the kubelet's connections, against the real kubelet and both readers.

The kubelet (tests/realkubelet, the device manager's own code) runs in a network namespace of its
own; a hostile neighbour in that namespace binds abstract names holding a newline and a made-up line of
`/proc/net/unix`: a listener on `kubelet.sock`, a connection to a plugin that never registered. The
sidecar, run as the manifests run it (uid 0, every capability dropped), reads that namespace through
`/proc/<kubelet pid>/net/unix` (from a pod's namespace: no hostNetwork) or with sock_diag (from inside
it: hostNetwork); hami-doctor runs beside it. Neither the verdicts nor the doctor's row change, and no
probe round fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from sidecar.config import PluginSpec
from testing import free_port, netns
from testing.netns import Netns
from testing.realkubelet import RealKubelet, RealPlugin, Release
from tests.conftest import wait_for
from tests.e2e.realnode import SETTINGS
from tests.forged import LOOPBACK_UP, ROOT_NO_CAPS, Holder, forged_names, names, nsenter, pair
from tests.test_doctor import Doctor, row, verdicts

GPU = "nvidia.com/gpu"  # its plugin serves and never registers: the name lies about it
DEV = "example.com/dev"  # its plugin registers
BOUND_DIR = "/var/lib/kubelet/device-plugins"  # where the kubelet's mount namespace has the folder
# A process in the kubelet's namespace that answers each line (a port) with that sidecar's /status on
# one line: one interpreter for the whole test, not one per question.
# /status is rate limited (the serving limits answer 503 "busy" past their rate): a refused ask is
# asked again a moment later, a few times, never forever.
STATUS = (
    "import sys, time, urllib.request\n"
    "for port in sys.stdin:\n"
    "    for _ in range(50):\n"
    "        try:\n"
    "            body = urllib.request.urlopen(f'http://127.0.0.1:{port.strip()}/status', timeout=5).read()\n"
    "            break\n"
    "        except OSError:\n"
    "            body = b'{}'\n"
    "            time.sleep(0.05)\n"
    "    print(body.decode().replace(chr(10), ' '), flush=True)\n"
)


class Entered(Netns):
    """An existing network namespace (by its handle), entered as the manifests run the sidecar: uid 0,
    every capability dropped (so the kubelet's descriptors cannot be read)."""

    def __init__(self, handle: str) -> None:
        super().__init__()
        self.handle = handle

    @property
    def path(self) -> str:
        return self.handle

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net={self.handle}", "--", *ROOT_NO_CAPS, *argv]


@asynccontextmanager
async def sidecar_in(ns: Entered, settings: Any, log: str) -> AsyncIterator[Callable[[], dict[str, Any]]]:
    """hami-sidecar, a process in `ns`; yields what reads its /status (from the same namespace)."""
    enter = ["nsenter", f"--net={ns.handle}", "--"]  # as root: the loopback needs CAP_NET_ADMIN
    up = await asyncio.create_subprocess_exec(*enter, sys.executable, "-c", LOOPBACK_UP)
    assert await asyncio.wait_for(up.wait(), 30) == 0
    argv = [sys.executable, "-m", "sidecar", "--device-plugin-dir", settings.device_plugin_dir]
    argv += ["--pod-resources-socket", settings.pod_resources_socket]
    argv += [
        "--listen",
        f"127.0.0.1:{settings.port}",
        "--kubelet-process-name",
        settings.kubelet_process_name,
    ]
    argv += ["--probe-interval", "0.5", "--probe-timeout", "0.3", "--registration-grace", "1.5"]
    for p in settings.plugins:
        argv += ["--plugin", f"{p.resource}={p.socket}"]
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(*ns.command(argv), stdout=out, stderr=subprocess.STDOUT)
    # Blocking on purpose: `status` answers wait_for's predicates, which are plain functions.
    asker = subprocess.Popen(  # noqa: ASYNC220
        ns.command([sys.executable, "-c", STATUS]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert asker.stdin is not None and asker.stdout is not None
    questions, answers = asker.stdin, asker.stdout

    def status() -> dict[str, Any]:
        questions.write(f"{settings.port}\n")
        questions.flush()
        doc: dict[str, Any] = json.loads(answers.readline())
        return doc

    try:
        yield status
    finally:
        proc.terminate()
        questions.close()
        await asyncio.wait_for(proc.wait(), 10)
        asker.wait(10)


def check(doc: dict[str, Any], resource: str) -> tuple[str, str]:
    c = doc["checks"][f"registered:{resource}"]
    return c["state"], c["reason"]


# The names lie the same way to either release's device manager: the new release only.
@pytest.mark.parametrize("release", ["new"], indirect=True)
@pytest.mark.parametrize("route", ["proc", "sock_diag"])
async def test_forged_names_in_the_kubelets_namespace_change_no_verdict(
    route: str, release: Release, dp_dir: str, short_tmp: str
) -> None:
    netns.require()
    pod = Netns().start()
    try:
        await judged(route, release, dp_dir, short_tmp, pod)
    finally:
        pod.close()


async def judged(route: str, release: Release, dp_dir: str, short_tmp: str, pod: Netns) -> None:
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    log = os.path.join(short_tmp, "sidecar.log")
    async with RealKubelet(dp_dir, pod_resources, release=release, netns=True) as kubelet:
        kpid = kubelet.process.pid or 0
        # sock_diag: the sidecar in the kubelet's namespace (hostNetwork); /proc: in a pod's of its own.
        ns = Entered(f"/proc/{kpid}/ns/net" if route == "sock_diag" else pod.path)
        settings = replace(
            SETTINGS,
            device_plugin_dir=dp_dir,
            pod_resources_socket=pod_resources,
            port=free_port(),
            plugins=(PluginSpec(GPU, "nvidia-gpu.sock"), PluginSpec(DEV, "dev.sock")),
            kubelet_process_name=kubelet.process_name,
        )
        never = RealPlugin(
            dp_dir, GPU, "nvidia-gpu.sock", release=release, register=False, watch_kubelet=False
        )
        held = RealPlugin(dp_dir, DEV, "dev.sock", release=release, watch_kubelet=False)
        try:
            await never.start()
            mark = held.mark()
            await held.start()
            await held.wait_event("stream-open", after=mark)
            async with sidecar_in(ns, settings, log) as status:

                def settled() -> bool:
                    doc = status()
                    return bool(doc) and check(doc, DEV)[0] == "ok" and check(doc, GPU)[0] == "failed"

                await wait_for(settled, timeout=20, what="the verdicts before the lie")
                before = status()
                source = before["kubelet_connections_from"]
                if route == "sock_diag":
                    assert source.startswith("this network namespace (sock_diag)"), source
                else:  # with any other process named kubelet on the machine (another test's stand-in)
                    assert source.startswith("the kubelet's network namespace (/proc/"), source
                    assert f"/proc/{kpid}/net/unix" in source, source
                doctor = Doctor(dp_dir, short_tmp, *(os.path.join(short_tmp, n) for n in ("k.log", "p.log")))
                for path in (doctor.kubelet_log, doctor.plugin_log):
                    open(path, "a").close()
                os.makedirs(os.path.join(short_tmp, "dev"), exist_ok=True)
                extra = ("--kubelet-process-name", kubelet.process_name)
                _, honest = await doctor.report(*extra, ns=ns)
                assert verdicts(honest)["plugin-not-registered"] == "problem"

                async def rounds(n: int) -> dict[str, Any]:
                    start = status()["probe_rounds"]
                    await wait_for(
                        lambda: status()["probe_rounds"] >= start + n, timeout=30, what=f"{n} rounds"
                    )
                    return status()

                lies = forged_names(kubelet.socket_path, never.socket_path, BOUND_DIR)
                assert len(lies) == 9
                with Holder(names(*lies), nsenter(kpid)):
                    after = await rounds(4)
                    assert check(after, DEV)[0] == "ok"
                    state, reason = check(after, GPU)
                    assert state == "failed", (reason, after["checks"], after["kubelet_connections_from"])
                    _, lied_to = await doctor.report(*extra, ns=ns)
                    assert verdicts(lied_to)["plugin-not-registered"] == "problem", row(
                        lied_to, "plugin-not-registered"
                    )
                    # A checkpoint that cannot be read leaves the connections alone to decide: a lie that
                    # counted would now turn the plugin that never registered to registered. It can make
                    # the connection unknown (the doctor's row then is), never there.
                    with open(kubelet.checkpoint_path, "w") as f:
                        f.write("{")
                    after = await rounds(3)
                    assert after["checks"]["checkpoint"]["state"] == "failed"
                    assert check(after, DEV)[0] == "ok"
                    state, reason = check(after, GPU)
                    assert state == "failed", (reason, after["checks"], after["kubelet_connections_from"])
                    _, lied_to = await doctor.report(*extra, ns=ns)
                    assert verdicts(lied_to)["plugin-not-registered"] != "ok", row(
                        lied_to, "plugin-not-registered"
                    )
            with open(log, encoding="utf-8", errors="replace") as f:
                assert "probe round failed" not in f.read()
        finally:
            await never.close()
            await held.close()


@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_forged_names_after_a_drop_without_pod_resources_do_not_register_it(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    """The kubelet drops a held plugin (its stream ends: the kubelet closes the connection, writes no
    checkpoint); the sidecar, reading /proc from a pod's namespace with no pod-resources, fails it. A
    neighbour's made-up lines then make the count unknown: the checkpoint still lists the plugin, and
    must not make it registered again."""
    netns.require()
    pod = Netns().start()
    try:
        missing = os.path.join(short_tmp, "no-pod-resources", "kubelet.sock")  # never served
        async with RealKubelet(
            dp_dir, os.path.join(short_tmp, "pod-resources", "kubelet.sock"), release=release, netns=True
        ) as kubelet:
            kpid = kubelet.process.pid or 0
            settings = replace(
                SETTINGS,
                device_plugin_dir=dp_dir,
                pod_resources_socket=missing,
                port=free_port(),
                plugins=(PluginSpec(GPU, "nvidia-gpu.sock"),),
                kubelet_process_name=kubelet.process_name,
            )
            plugin = RealPlugin(dp_dir, GPU, "nvidia-gpu.sock", release=release, watch_kubelet=False)
            try:
                mark = plugin.mark()
                await plugin.start()
                await plugin.wait_event("stream-open", after=mark)
                async with sidecar_in(
                    Entered(pod.path), settings, os.path.join(short_tmp, "s.log")
                ) as status:
                    await wait_for(
                        lambda: check(status(), GPU)[0] == "ok", timeout=20, what="registered, held"
                    )
                    assert status()["kubelet_connections_from"].startswith("the kubelet's network namespace")
                    await plugin.end_stream("oldest")
                    await wait_for(
                        lambda: "no longer connected" in check(status(), GPU)[1],
                        timeout=20,
                        what="the drop",
                    )
                    assert check(status(), GPU)[0] == "failed"
                    lies = forged_names(kubelet.socket_path, plugin.socket_path, BOUND_DIR)
                    with Holder(names(*lies), nsenter(kpid)):
                        start = status()["probe_rounds"]
                        await wait_for(
                            lambda: status()["probe_rounds"] >= start + 4, timeout=30, what="4 rounds"
                        )
                        doc = status()
                        state, reason = check(doc, GPU)
                        assert state == "failed", (reason, doc["checks"])
                        assert "the live connection cannot be read" in reason, reason
            finally:
                await plugin.close()
    finally:
        pod.close()


@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_a_look_alike_connection_to_a_dropped_plugin_leaves_no_lasting_refusal(
    node_factory: Any,
) -> None:
    """A neighbour in the kubelet's network namespace with user and mount namespaces of its own (as an
    unprivileged user may: `unshare -U -r -m`) mounts a tmpfs over the folder, binds the plugin's path
    there, connects, accepts and closes the listener: by path, the sidecar (reading /proc, the kubelet
    in a network namespace of its own) counts a later connection to the dropped plugin and reads a
    refused second Register. pod-resources shows the kubelet dropped the plugin: the drop stands, liveness,
    before, while and after the neighbour's connection stays (past the refusal's bound), and nothing it
    did outlives it."""
    netns.require()
    async with node_factory(kubelet_netns=True, refusal_confirm=1.0) as node:
        plugin = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        await plugin.end_stream("oldest")
        await node.until("/healthz?verbose", 503, contains="it dropped the plugin")
        kpid = node.kubelet.process.pid or 0
        enter = [*nsenter(kpid), "unshare", "-U", "-r", "-m", "sh", "-c"]
        enter += [f'mount -t tmpfs none {node.dir} && exec "$@"', "sh"]
        with Holder([pair(plugin.socket_path)], enter):
            deadline = time.monotonic() + 2.5  # past the refusal's bound
            while time.monotonic() < deadline:
                code, body = await node.get("/healthz?verbose")
                assert code == 503 and "dropped the plugin" in body, body
                assert f"[+]kubelet-client:{GPU} ok" in (await node.get("/readyz?verbose"))[1]
                await asyncio.sleep(0.1)
        await node.until("/healthz?verbose", 503, contains="it dropped the plugin")
