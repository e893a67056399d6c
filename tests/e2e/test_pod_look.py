"""Between rounds in a pod with neither the host's network nor its pids (Ascend's chart), against the real
kubelet: the kubelet's connections cannot be read there (their accepted ends are in the kubelet's
network namespace, not the pod's), so pod-resources is looked at between rounds
(sidecar.deviceplugin.podlook); a drop brings a round forward, a neighbour's connection to the plugin's
socket does not, and where the connections can be read the look is never armed.

The sidecar runs as such a pod runs it: the plugin's network namespace, a pid namespace of its own (no
kubelet process to read), uid 0 with every capability dropped. The probe interval is an hour: a round
after the drop is one the look brought forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from sidecar.deviceplugin.podlook import PodResourcesLook
from sidecar.deviceplugin.probes import pod_resources_devices, pod_resources_held
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import POD_RESOURCES, method_path
from testing import free_port, netns
from testing.netns import Netns
from testing.realkubelet import RealKubelet, RealPlugin, Release
from tests.conftest import wait_for
from tests.forged import LOOPBACK_UP, ROOT_NO_CAPS, asking_status

GPU = "huawei.com/Ascend910B3"
SOCKET = "Ascend910B3.sock"


def in_pod(pod: Netns, argv: list[str]) -> list[str]:
    """`argv` as such a pod's container runs: its network namespace, a pid namespace of its own."""
    return [
        "nsenter",
        f"--net={pod.path}",
        "--",
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--",
        *argv,
    ]


@asynccontextmanager
async def ascend_node(
    release: Release, dp_dir: str, short_tmp: str
) -> AsyncIterator[tuple[RealKubelet, RealPlugin, Callable[[], dict[str, Any]]]]:
    """The kubelet in a network namespace of its own; the plugin it holds and the sidecar in the pod's;
    yields what reads the sidecar's /status."""
    netns.require()
    pod = Netns().start()
    try:
        pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
        async with RealKubelet(dp_dir, pod_resources, release=release, netns=True) as kubelet:
            plugin = RealPlugin(dp_dir, GPU, SOCKET, devices=("NPU-0", "NPU-1"), release=release)
            plugin.process.argv = ["nsenter", f"--net={pod.path}", "--", *plugin.process.argv]
            try:
                mark = plugin.mark()
                await plugin.start()
                await plugin.wait_event("stream-open", after=mark)
                async with sidecar(pod, dp_dir, pod_resources, kubelet, short_tmp) as status:
                    yield kubelet, plugin, status
            finally:
                await plugin.close()
    finally:
        pod.close()


@asynccontextmanager
async def sidecar(
    pod: Netns, dp_dir: str, pod_resources: str, kubelet: RealKubelet, short_tmp: str
) -> AsyncIterator[Callable[[], dict[str, Any]]]:
    up = await asyncio.create_subprocess_exec(*pod.command([sys.executable, "-c", LOOPBACK_UP]))
    assert await asyncio.wait_for(up.wait(), 30) == 0
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "--device-plugin-dir",
        dp_dir,
        "--pod-resources-socket",
        pod_resources,
    ]
    argv += ["--listen", f"127.0.0.1:{port}", "--plugin", f"{GPU}={SOCKET}"]
    argv += ["--kubelet-version", kubelet.version, "--probe-interval", "3600", "--probe-timeout", "0.3"]
    argv += ["--registration-grace", "1.5", "--connection-interval", "0.2"]
    with open(os.path.join(short_tmp, "sidecar.log"), "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *in_pod(pod, [*ROOT_NO_CAPS, *argv]), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        with asking_status(pod.command, port) as status:
            yield status
    finally:
        # unshare --fork ignores SIGTERM and waits for its child, the sidecar: the group's signal reaches it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)


def registered(doc: dict[str, Any]) -> tuple[str, str]:
    c = doc.get("checks", {}).get(f"registered:{GPU}", {"state": "", "reason": ""})
    return c["state"], c["reason"]


async def held(status: Callable[[], dict[str, Any]]) -> int:
    """Once the sidecar judges the plugin held, with no connection read: the rounds so far."""
    await wait_for(lambda: registered(status())[0] == "ok", timeout=30, what="registered")
    doc = status()
    assert "not visible from this pod" in doc["kubelet_connections_from"], doc["kubelet_connections_from"]
    rounds: int = doc["probe_rounds"]
    return rounds


async def answering(path: str, method: str, answer: Callable[[bytes, object], bytes]) -> grpc.aio.Server:
    """A gRPC server on the Unix socket `path` whose pod-resources `method` answers `answer`'s bytes."""
    service, name = method_path(POD_RESOURCES, method).strip("/").split("/")
    server = grpc.aio.server()
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(answer)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {name: handler})])
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    return server


@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_a_drop_brings_the_round_forward_where_the_connections_cannot_be_read(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    """The kubelet ends the plugin's stream while it serves: the round that judges it comes from the
    look (an hour's probe interval: no other round is due), and fails the check as a round would."""
    async with ascend_node(release, dp_dir, short_tmp) as (_, plugin, status):
        before = await held(status)
        await plugin.end_stream("oldest")
        await wait_for(lambda: registered(status())[0] == "failed", timeout=30, what="the drop judged")
        assert status()["probe_rounds"] > before


@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_a_neighbours_connection_to_the_plugin_changes_no_verdict(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    """Any root process may connect to the plugin's socket and close: the look reads the kubelet's
    pod-resources, not the connections, so it brings no round forward and no verdict changes; a drop
    after it is still brought forward."""
    async with ascend_node(release, dp_dir, short_tmp) as (_, plugin, status):
        before = await held(status)
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(plugin.socket_path)
            await asyncio.sleep(0.5)  # a few looks (every 0.2 s) after each
        doc = status()
        assert registered(doc)[0] == "ok", registered(doc)
        assert doc["probe_rounds"] <= before + 1
        await plugin.end_stream("oldest")
        await wait_for(lambda: registered(status())[0] == "failed", timeout=30, what="the drop judged")


@pytest.mark.parametrize("release", ["new"], indirect=True)
@pytest.mark.parametrize("kubelet_netns", [False, True], ids=["sock_diag", "proc"])
async def test_no_look_at_pod_resources_where_the_connections_are_read(
    node_factory: Any, kubelet_netns: bool
) -> None:
    """The sidecar in the kubelet's namespace (sock_diag) or reading it through /proc (HAMi's NVIDIA pod):
    the table's look alone, as before; pod-resources is never called between rounds, a drop or not."""
    async with node_factory(kubelet_netns=kubelet_netns) as node:
        plugin = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        await node.rounds(2)
        await plugin.end_stream("oldest")
        await node.until("/healthz?verbose", 503, contains="it dropped the plugin")
        await node.rounds(2)
        assert node.sidecar.pod_look.looks == 0


async def test_a_look_that_raises_is_no_answer_and_the_look_goes_on(short_tmp: str) -> None:
    """Something on the pod-resources socket answers bytes that are no AllocatableResourcesResponse (the
    call then raises, not as an RPC error): that look tells nothing, and the next ones still see the drop.
    A real gRPC server on a Unix socket; the look as the sidecar runs it."""
    answers = [b"\xff\xff\xff", b"\xff\xff\xff"]  # undecodable, then the kubelet's, NPU-0 gone
    kept = pr.AllocatableResourcesResponse(
        devices=[pr.ContainerDevices(resource_name=GPU, device_ids=["NPU-1"])]
    )

    def allocatable(request: bytes, context: object) -> bytes:
        return answers.pop(0) if answers else kept.SerializeToString()

    path = os.path.join(short_tmp, "pod-resources.sock")
    server = await answering(path, "GetAllocatableResources", allocatable)
    fell: list[bool] = []
    look = PodResourcesLook(path, 1.0, 0.01, lambda: fell.append(True))
    task = asyncio.create_task(look.run())
    try:
        look.watch({GPU: frozenset({"NPU-0", "NPU-1"})})
        await wait_for(lambda: bool(fell) or task.done(), timeout=30, what="the drop seen")
        assert not task.done(), task.exception()
        assert fell == [True] and look.looks == 3
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(None)


@pytest.mark.parametrize("method", ["GetAllocatableResources", "List"])
async def test_an_undecodable_pod_resources_answer_is_a_failed_reading(method: str, short_tmp: str) -> None:
    """Bytes that are no answer of pod-resources' (grpcio hands the caller None for them): a reading that
    failed, saying so, never an exception in the round."""

    def garbage(request: bytes, context: object) -> bytes:
        return b"\xff\xff\xff"

    path = os.path.join(short_tmp, "pod-resources.sock")
    server = await answering(path, method, garbage)
    try:
        read = pod_resources_devices if method == "GetAllocatableResources" else pod_resources_held
        reading = await read(path, 2.0)
    finally:
        await server.stop(None)
    assert reading.value is None
    assert "an answer that is no" in str(reading.error), reading
