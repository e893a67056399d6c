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
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from sidecar.config import PluginSpec
from sidecar.server.status import status_document
from testing import free_port, netns
from testing.netns import Netns
from testing.realkubelet import RealKubelet, RealPlugin, Release
from tests.conftest import wait_for
from tests.e2e.conftest import Watch
from tests.e2e.realnode import SETTINGS
from tests.forged import (
    LOOPBACK_UP,
    PTRACE_ONLY,
    ROOT_NO_CAPS,
    Holder,
    asking_status,
    comm,
    forged_names,
    in_a_mount_namespace,
    listen,
    names,
    nsenter,
    pair,
    unprivileged,
)
from tests.test_doctor import Doctor, row, verdicts

GPU = "nvidia.com/gpu"  # its plugin serves and never registers: the name lies about it
DEV = "example.com/dev"  # its plugin registers
BOUND_DIR = "/var/lib/kubelet/device-plugins"  # where the kubelet's mount namespace has the folder


# A process in the kubelet's namespace that answers each line (a port) with that sidecar's /status on
# one line: one interpreter for the whole test, not one per question.
class Entered(Netns):
    """An existing network namespace (by its handle), entered as the manifests run the sidecar: uid 0,
    every capability dropped (so the descriptors of the kubelet and of the plugin cannot be read), or
    with `privileges` (PTRACE_ONLY: they can)."""

    def __init__(self, handle: str, privileges: Sequence[str] = ROOT_NO_CAPS) -> None:
        super().__init__()
        self.handle = handle
        self.privileges = list(privileges)

    @property
    def path(self) -> str:
        return self.handle

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net={self.handle}", "--", *self.privileges, *argv]


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
    try:
        with asking_status(ns.command, settings.port) as status:
            yield status
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


@asynccontextmanager
async def held_without_pod_resources(
    release: Release, dp_dir: str, short_tmp: str
) -> AsyncIterator[tuple[Netns, RealKubelet, Any, RealPlugin]]:
    """A pod's network namespace, the kubelet in one of its own with no pod-resources for the sidecar,
    and a plugin it holds: the sidecar's settings for that node."""
    netns.require()
    pod = Netns().start()
    try:
        missing = os.path.join(short_tmp, "no-pod-resources", "kubelet.sock")  # never served
        async with RealKubelet(
            dp_dir, os.path.join(short_tmp, "pod-resources", "kubelet.sock"), release=release, netns=True
        ) as kubelet:
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
                yield pod, kubelet, settings, plugin
            finally:
                await plugin.close()
    finally:
        pod.close()


def check(doc: dict[str, Any], resource: str) -> tuple[str, str]:
    """The registered check's state and reason; ("", "") while the sidecar does not answer yet."""
    c = doc.get("checks", {}).get(f"registered:{resource}", {"state": "", "reason": ""})
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
@pytest.mark.parametrize("privileges", ["none", "ptrace"])
async def test_forged_names_after_a_drop_without_pod_resources_do_not_register_it(
    release: Release, dp_dir: str, short_tmp: str, privileges: str
) -> None:
    """The kubelet drops a held plugin (its stream ends: the kubelet closes the connection, writes no
    checkpoint); the sidecar, reading /proc from a pod's namespace with no pod-resources, fails it. A
    neighbour's made-up lines then make the count unknown: the checkpoint still lists the plugin, and
    must not make it registered again.

    With CAP_SYS_PTRACE the plugin's descriptors say the kubelet's connection is the plugin's: the
    drop is one (confirmed, "no longer connected"). Without it (HAMi's default: no capability) a
    connection by path is no count, so the plugin was never seen held: the drop reads as "holds no
    connection", unconfirmed but failing all the same."""
    async with held_without_pod_resources(release, dp_dir, short_tmp) as (pod, kubelet, settings, plugin):
        kpid = kubelet.process.pid or 0
        entered = Entered(pod.path, PTRACE_ONLY if privileges == "ptrace" else ROOT_NO_CAPS)
        async with sidecar_in(entered, settings, os.path.join(short_tmp, "s.log")) as status:
            if privileges == "ptrace":
                await wait_for(lambda: check(status(), GPU)[0] == "ok", timeout=20, what="registered, held")
                held = check(status(), GPU)[1]
                assert held.startswith("the kubelet holds a connection to nvidia-gpu.sock"), held
            else:
                # Nothing live says it is held: the checkpoint's record is no registration.
                await wait_for(
                    lambda: "no live evidence in this layout" in check(status(), GPU)[1],
                    timeout=20,
                    what="the record named past evidence",
                )
                assert "unsafe" in status()["live_evidence"]
            assert status()["kubelet_connections_from"].startswith("the kubelet's network namespace")
            await plugin.end_stream("oldest")
            dropped = "no longer connected" if privileges == "ptrace" else "holds no connection"
            await wait_for(
                lambda: dropped in check(status(), GPU)[1],
                timeout=20,
                what="the drop",
            )
            # Never held before (no live evidence): failed once the grace since the start is over.
            await wait_for(lambda: check(status(), GPU)[0] == "failed", timeout=20, what="failed")
            lies = forged_names(kubelet.socket_path, plugin.socket_path, BOUND_DIR)
            with Holder(names(*lies), nsenter(kpid)):
                start = status()["probe_rounds"]
                await wait_for(lambda: status()["probe_rounds"] >= start + 4, timeout=30, what="4 rounds")
                doc = status()
                state, reason = check(doc, GPU)
                assert state == "failed", (reason, doc["checks"])
                assert "the live connection cannot be read" in reason, reason


@pytest.mark.parametrize("release", ["new"], indirect=True)
@pytest.mark.parametrize("route", ["proc", "sock_diag"])
async def test_a_look_alike_connection_to_a_dropped_plugin_changes_no_verdict(
    node_factory: Any, route: str, short_tmp: str
) -> None:
    """A neighbour in the kubelet's network namespace with user and mount namespaces of its own (as an
    unprivileged user may: `unshare -U -r -m`) mounts a tmpfs over the folder, binds the plugin's path
    there, connects, accepts and closes the listener: an accepted end at the plugin's path. The sidecar
    (as root: it reads the descriptors of the plugin's process) counts it neither through /proc (the
    kubelet in a network namespace of its own: the plugin's process does not hold that end) nor with
    sock_diag (the kubelet in the sidecar's: the end is bound to another file). pod-resources is gone
    (its socket removed), so the connections alone decide: counted, the look-alike would read as a
    refused second Register, which restarts nothing. The dropped plugin stays dropped, failing liveness,
    before, while the neighbour stays (past the refusal's bound) and after: nothing it did outlives it."""
    netns.require()
    async with node_factory(kubelet_netns=route == "proc", refusal_confirm=1.0) as node:
        plugin = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        await plugin.end_stream("oldest")
        await node.until("/healthz?verbose", 503, contains="it dropped the plugin")
        kpid = node.kubelet.process.pid or 0
        os.chmod(short_tmp, 0o755)  # the neighbour, unprivileged, reaches the folder
        *user, python = unprivileged()
        enter = [*nsenter(kpid), *user, *in_a_mount_namespace(node.dir, user=True, python=python)]
        os.unlink(os.path.join(short_tmp, "pod-resources", "kubelet.sock"))  # the connections alone decide
        with Holder([pair(plugin.socket_path)], enter) as neighbour:
            with open(f"/proc/{neighbour.pid}/net/unix", "rb") as f:  # its end, by path, in the table
                lines = f.read().decode(errors="replace").splitlines()
            assert any(" 03 " in line and line.endswith(plugin.socket_path) for line in lines)
            watch = Watch(node)
            await watch.started()
            # Past the refusal's bound (1 s), as long as a counted look-alike took to read as a refused
            # Register (5 s at most), and rounds.
            await asyncio.gather(node.rounds(3), asyncio.sleep(5))
            answers = watch.seen[:]
            await watch.stop()
        assert {code for _, code, _ in answers} == {503}
        assert all("it dropped the plugin" in body for _, _, body in answers), answers[-1][2]
        await node.rounds(2)  # and once it has gone
        await node.until("/healthz?verbose", 503, contains="it dropped the plugin")


@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_a_look_alike_made_before_a_drop_never_keeps_it_registered(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    """The sidecar as HAMi's default layout runs it (a pod's network namespace, no capability: the /proc
    route, no descriptors) without pod-resources. While the plugin is registered, an unprivileged
    neighbour in the kubelet's network namespace makes a look-alike connection at the plugin's path;
    then the kubelet drops the plugin. The count is unknown while the neighbour stays, and the
    checkpoint still records the acceptance: never "registered", before the drop, after it, or in a
    sidecar started after it (no memory to lose); /status names the layout unsafe. Once the neighbour
    goes, the count reads 0 and the drop is read."""
    async with held_without_pod_resources(release, dp_dir, short_tmp) as (pod, kubelet, settings, plugin):
        kpid = kubelet.process.pid or 0
        os.chmod(short_tmp, 0o755)  # the neighbour, unprivileged, reaches the folder
        *user, python = unprivileged()
        enter = [*nsenter(kpid), *user, *in_a_mount_namespace(dp_dir, user=True, python=python)]
        entered = Entered(pod.path, ROOT_NO_CAPS)
        log = os.path.join(short_tmp, "s.log")
        with Holder([pair(plugin.socket_path)], enter):
            async with sidecar_in(entered, settings, log) as status:
                await wait_for(
                    lambda: "no live evidence in this layout" in check(status(), GPU)[1],
                    timeout=20,
                    what="the record named past evidence",
                )
                assert "unsafe" in status()["live_evidence"]
                await plugin.end_stream("oldest")  # the kubelet drops the plugin
                start = status().get("probe_rounds", 0)
                await wait_for(
                    lambda: status().get("probe_rounds", 0) >= start + 4, timeout=30, what="rounds"
                )
                assert check(status(), GPU)[0] != "ok", check(status(), GPU)
            # A sidecar started now, the look-alike still there: nothing to forget, nothing gained.
            async with sidecar_in(entered, replace(settings, port=free_port()), log) as status:
                await wait_for(lambda: status().get("probe_rounds", 0) >= 4, timeout=30, what="rounds")
                doc = status()
                assert check(doc, GPU)[0] != "ok", check(doc, GPU)
                assert not doc["checks"][f"registered:{GPU}"]["fails_liveness"]
        # The neighbour gone, the count reads 0: the drop is read. (The plugin here serves from
        # the kubelet's namespace, not the sidecar's, so `plugin:` names another plugin's
        # listener and no restart is asked for: a layout of this test, not of a node.)
        async with sidecar_in(entered, replace(settings, port=free_port()), log) as status:
            await wait_for(
                lambda: (
                    check(status(), GPU)[0] == "failed" and "holds no connection" in check(status(), GPU)[1]
                ),
                timeout=30,
                what="the drop",
            )


async def test_a_process_named_as_the_kubelet_that_is_not_it_is_named_in_status(
    make_node: Any, short_tmp: str
) -> None:
    """A root process bearing the kubelet's name, outside any pod's cgroup, in network and mount
    namespaces of its own (a container another runtime runs), listening on a kubelet.sock of its own
    tmpfs: /status names it as ignored, and the verdicts stay; once it goes, nothing of it is left."""
    netns.require()
    name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
    async with make_node(kubelet_process_name=name) as node:
        await node.until("/healthz", 200)
        await node.wait_rounds()

        # Another process of a kubelet's name elsewhere on the machine may be named: only ours counts.
        def ignored() -> list[str]:
            return [i for i in status_document(node.sidecar)["kubelet_processes_ignored"] if f"({name})" in i]

        assert ignored() == []
        before = (await node.get("/readyz?verbose"))[0]
        kubelet_sock = os.path.join(node.dir, "kubelet.sock")
        enter = Netns().start()
        try:
            ops = [
                comm(name),
                listen(kubelet_sock),
                *names(os.path.join(node.dir, "nvidia-gpu.sock").encode()),
            ]
            with Holder(ops, enter.command(in_a_mount_namespace(node.dir, user=False))) as fake:
                await node.wait_rounds()
                why = f"it does not listen on kubelet.sock as this pod sees it (pid {os.getpid()} does)"
                assert ignored() == [f"pid {fake.pid} ({name}): {why}"]
                assert (await node.get("/readyz?verbose"))[0] == before
                assert (await node.get("/healthz"))[0] == 200
        finally:
            enter.close()
        await node.wait_rounds()
        assert ignored() == []
