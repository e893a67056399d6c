"""The simulator against the kubelet's real device manager: one script of events, both sides, compared.

Each side is a node of its own (a device-plugins folder, a pod-resources socket, the same
FakeDevicePlugins): one runs FakeKubelet, the other the device manager and PodResources server of
k8s.io/kubernetes itself (testing.realkubelet, docs/real-kubelet.md). After every step the
test compares what the project reads on a node: the checkpoint's content (RegisteredDevices as
sets, PodDeviceEntries; not the checksum), the sockets in the folder, GetCapacity, the
pod-resources answers (as sets of (resource, device, NUMA node)) and the calls each plugin served.
v1.37.2 runs against the simulator's default, every release before kubernetes PR 135437 (v1.30.14 in
`make test`, 1.30 to 1.36 in `make real-slow`) against `reregister_race=True`. Differences the
simulator keeps on purpose are in docs/simulator-gaps.md, each with a test that fails when the gap
changes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from hami_guard.node.unixdiag import ESTABLISHED, normalise, proc_net_unix
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import POD_RESOURCES, insecure_channel, unary
from sidecar.watcher import FolderWatcher, FsEvent
from testing import FakeDevicePlugin, FakeKubelet, is_simulator_checkpoint
from testing.realkubelet import (
    RELEASES,
    RealKubelet,
    Release,
    disconnected_log,
    has_pr_135437,
    selected_releases,
)
from tests.conftest import wait_for
from tests.test_realkubelet import require_fixture

GPU = "nvidia.com/gpu"
ASCEND = "huawei.com/Ascend910B3"
ASCEND_SOCKET = "Ascend910B3.sock"
KUBELET_SOCK = "kubelet.sock"
TIMEOUT = 20.0  # a real kubelet in a shared CI box; every wait is for a condition


class Side:
    """One node: a kubelet (simulated or real), its folder watched, and the plugins started on it."""

    def __init__(self, label: str, root: str, kubelet_factory: Callable[[str, str], Any]) -> None:
        self.label = label
        self.dir = os.path.join(root, "device-plugins")
        os.makedirs(self.dir, mode=0o750)
        self.pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
        self.kubelet: FakeKubelet | RealKubelet = kubelet_factory(self.dir, self.pod_resources)
        self.plugins: dict[str, FakeDevicePlugin] = {}
        self.seen: list[FsEvent] = []
        self._watcher: FolderWatcher | None = None

    @property
    def real(self) -> bool:
        return isinstance(self.kubelet, RealKubelet)

    async def start(self) -> None:
        self._watcher = FolderWatcher(self.dir, self.seen.append, asyncio.get_running_loop(), mode="inotify")
        assert self._watcher.start()
        await self.kubelet.start()

    async def close(self) -> None:
        for p in self.plugins.values():
            await p.close()
        await self.kubelet.close()
        if self._watcher is not None:
            self._watcher.stop()

    def plugin(self, resource: str, socket_name: str, devices: list[str], **kwargs: Any) -> FakeDevicePlugin:
        p = FakeDevicePlugin(self.dir, resource, socket_name, devices, register_timeout=10, **kwargs)
        self.plugins[socket_name] = p
        return p

    # -- progress markers -------------------------------------------------------
    def writes(self) -> int:
        """Checkpoint writes seen in the folder (the kubelet renames a temporary file over it)."""
        return self.seen.count(FsEvent("created", CHECKPOINT_NAME))

    def log_mark(self) -> int:
        return self.kubelet.mark() if isinstance(self.kubelet, RealKubelet) else 0

    def disconnected(self, resource: str, mark: int) -> bool:
        """The kubelet has processed the end of the resource's stream."""
        if isinstance(self.kubelet, RealKubelet):
            msg = disconnected_log(self.kubelet.release)
            return bool(self.kubelet.process.find("log", lambda e: e.get("msg") == msg, mark))
        return self.kubelet.stopped(resource) and not self.kubelet.connected(resource)

    def deleted_sockets(self, since: int) -> list[str]:
        """Sockets deleted after position `since` of the events, up to kubelet.sock's creation."""
        out: list[str] = []
        for e in self.seen[since:]:
            if e == FsEvent("created", KUBELET_SOCK):
                break
            if e.kind == "deleted" and e.name.endswith(".sock"):
                out.append(e.name)
        return out

    # -- what the project reads on a node -----------------------------------------
    async def observe(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint(),
            "sockets": sorted(
                n for n in os.listdir(self.dir) if stat.S_ISSOCK(os.lstat(os.path.join(self.dir, n)).st_mode)
            ),
            "capacity": await self.capacity(),
            "allocatable": await self.allocatable(),
            "pods": await self.pods(),
            "modes": self.modes(),
            "calls": {name: dict(p.calls) for name, p in sorted(self.plugins.items())},
            "registrations": {name: p.registrations for name, p in sorted(self.plugins.items())},
        }

    def modes(self) -> dict[str, str]:
        """Permission bits of the folder, kubelet.sock and the checkpoint."""
        out = {}
        for name in (".", KUBELET_SOCK, CHECKPOINT_NAME):
            with contextlib.suppress(FileNotFoundError):
                out[name] = oct(stat.S_IMODE(os.lstat(os.path.join(self.dir, name)).st_mode))
        return out

    def checkpoint(self) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.dir, CHECKPOINT_NAME)) as f:
                data = json.load(f)["Data"]
        except FileNotFoundError:
            return None
        entries = {}
        for e in data["PodDeviceEntries"] or []:
            answer = dp.ContainerAllocateResponse.FromString(base64.b64decode(e["AllocResp"]))
            envs = {k: frozenset(v.split(",")) for k, v in answer.envs.items()}
            numa = {n: frozenset(ids) for n, ids in e["DeviceIDs"].items()}
            entries[(e["PodUID"], e["ContainerName"], e["ResourceName"])] = (numa, envs)
        return {
            "RegisteredDevices": {r: frozenset(ids or ()) for r, ids in data["RegisteredDevices"].items()},
            "PodDeviceEntries": entries if data["PodDeviceEntries"] is not None else None,
        }

    async def capacity(self) -> tuple[dict[str, int], dict[str, int], list[str]]:
        if isinstance(self.kubelet, RealKubelet):
            c = await self.kubelet.capacity()
            return c["capacity"], c["allocatable"], sorted(c["removed"])
        return await self.kubelet.capacity()

    async def allocatable(self) -> frozenset[tuple[str, str, int | None]]:
        async with insecure_channel(self.pod_resources) as channel:
            call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
            answer = await call(pr.AllocatableResourcesRequest(), timeout=5)
        return _device_set(answer.devices)

    async def pods(self) -> dict[tuple[str, str, str], frozenset[tuple[str, str, int | None]]]:
        async with insecure_channel(self.pod_resources) as channel:
            call = unary(channel, POD_RESOURCES, "List", pr.ListPodResourcesResponse)
            answer = await call(pr.ListPodResourcesRequest(), timeout=5)
        return {
            (p.namespace, p.name, c.name): _device_set(c.devices)
            for p in answer.pod_resources
            for c in p.containers
        }

    async def allocate(self, pod: str, container: str, resource: str, n: int) -> list[str]:
        return sorted(await self.kubelet.allocate(pod, container, resource, n))


def _device_set(devices: Any) -> frozenset[tuple[str, str, int | None]]:
    """ContainerDevices entries as (resource, device, NUMA node or None without topology)."""
    out: set[tuple[str, str, int | None]] = set()
    for d in devices:
        nodes: list[int | None] = [n.ID for n in d.topology.nodes] if d.HasField("topology") else [None]
        out.update((d.resource_name, device, n) for device in d.device_ids for n in nodes)
    return frozenset(out)


Step = Callable[[Side], Awaitable[None]]


async def written_after(side: Side, action: Callable[[], Awaitable[object]], what: str) -> None:
    """Act, then wait for the kubelet's next checkpoint write."""
    mark = side.writes()
    await action()
    await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: {what}")


async def both(sim: Side, real: Side, step: Step, what: str) -> dict[str, Any]:
    """Run the step on both sides at once, then compare what each node shows."""
    await asyncio.gather(step(sim), step(real))
    seen_sim, seen_real = await asyncio.gather(sim.observe(), real.observe())
    for key in seen_real:
        assert seen_sim[key] == seen_real[key], f"after {what}: {key} differs (simulator, then real kubelet)"
    return seen_sim


def plugin_socket_listed_before_kubelet_sock(scratch: str) -> str:
    """A plugin socket name that the directory lists before kubelet.sock on this filesystem (ext4 lists
    by a hash of the name; the same names keep the same order in every folder of the filesystem)."""
    os.makedirs(scratch)
    candidates = [f"nvidia-gpu{i}.sock" for i in range(32)]
    for name in [KUBELET_SOCK, ASCEND_SOCKET, *candidates]:
        with open(os.path.join(scratch, name), "w"):
            pass
    order = os.listdir(scratch)
    for name in candidates:
        if order.index(name) < order.index(KUBELET_SOCK):
            return name
    pytest.skip("no candidate name lists before kubelet.sock on this filesystem")


@contextlib.asynccontextmanager
async def node_pair(root: str, release: Release, race: bool) -> AsyncIterator[tuple[Side, Side]]:
    require_fixture(release)
    sim = Side("simulator", os.path.join(root, "sim"), lambda d, p: FakeKubelet(d, p, reregister_race=race))
    real = Side("real", os.path.join(root, "real"), lambda d, p: RealKubelet(d, p, release=release))
    try:
        await asyncio.gather(sim.start(), real.start())
        yield sim, real
    finally:
        for side in (sim, real):
            with contextlib.suppress(Exception):
                await side.close()


_SIDES = [(r, not has_pr_135437(r)) for r in selected_releases()]


@pytest.fixture(params=_SIDES, ids=[RELEASES[r] for r, _ in _SIDES])
async def sides(request: pytest.FixtureRequest, short_tmp: str) -> AsyncIterator[tuple[Side, Side]]:
    """The simulator's default against v1.37.2; its reregister_race mode against v1.30.14 (and against
    every other release before PR 135437 that $REALKUBELET_RELEASES names)."""
    async with node_pair(short_tmp, *request.param) as pair:
        yield pair


@pytest.fixture
async def new_sides(short_tmp: str) -> AsyncIterator[tuple[Side, Side]]:
    async with node_pair(short_tmp, "new", False) as pair:
        yield pair


async def test_one_script_on_the_simulator_and_on_the_real_device_manager(
    sides: tuple[Side, Side], short_tmp: str
) -> None:
    sim, real = sides
    gpu_socket = plugin_socket_listed_before_kubelet_sock(os.path.join(short_tmp, "order"))
    gpus = ["GPU-0", "GPU-1", "GPU-2"]
    numa = {"GPU-0": [0], "GPU-1": [0, 1]}

    async def nothing(side: Side) -> None:
        return None

    seen = await both(sim, real, nothing, "start")
    assert seen["checkpoint"] is None and seen["sockets"] == [KUBELET_SOCK]

    # 1. The GPU plugin registers; the kubelet writes its first answer.
    async def start_gpu(side: Side) -> None:
        mark = side.writes()
        await side.plugin(GPU, gpu_socket, gpus, numa=numa).start()
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the first answer's write")

    seen = await both(sim, real, start_gpu, "the GPU plugin's registration")
    assert seen["checkpoint"]["RegisteredDevices"] == {GPU: frozenset(gpus)}
    assert (GPU, "GPU-1", 1) in seen["allocatable"] and (GPU, "GPU-2", None) in seen["allocatable"]

    # 2. A second plugin, another resource.
    async def start_ascend(side: Side) -> None:
        mark = side.writes()
        await side.plugin(ASCEND, ASCEND_SOCKET, ["npu-0", "npu-1"]).start()
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: Ascend's write")

    await both(sim, real, start_ascend, "the Ascend plugin's registration")

    # 3. A device turns unhealthy: pushed on the stream, written (healthy devices only).
    def health(device: str, healthy: bool) -> Step:
        async def step(side: Side) -> None:
            mark = side.writes()
            side.plugins[gpu_socket].set_health(device, healthy)
            await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the health write")

        return step

    seen = await both(sim, real, health("GPU-1", False), "GPU-1 unhealthy")
    assert seen["checkpoint"]["RegisteredDevices"][GPU] == {"GPU-0", "GPU-2"}

    # 4. Allocate every healthy GPU (so the choice is the same whatever the order of a Go set).
    allocated: dict[str, list[str]] = {}
    order: dict[str, list[str]] = {}

    def allocate(pod: str, resource: str, n: int) -> Step:
        async def step(side: Side) -> None:
            allocated[side.label] = await side.allocate(pod, "main", resource, n)

        return step

    seen = await both(sim, real, allocate("pod-a", GPU, 2), "allocate pod-a")
    assert allocated["simulator"] == allocated["real"] == ["GPU-0", "GPU-2"]
    assert seen["calls"][gpu_socket]["Allocate"] == 1

    await both(sim, real, health("GPU-1", True), "GPU-1 healthy again")

    # 5. The GPU plugin dies: its stream ends; nothing is written.
    async def crash_gpu(side: Side) -> None:
        mark, writes = side.log_mark(), side.writes()
        await side.plugins[gpu_socket].crash()
        await wait_for(lambda: side.disconnected(GPU, mark), TIMEOUT, f"{side.label}: the disconnect")
        assert side.writes() == writes

    seen = await both(sim, real, crash_gpu, "the GPU plugin's crash")
    assert seen["capacity"][:2] == ({GPU: 3, ASCEND: 2}, {GPU: 0, ASCEND: 2})

    # 6. The next write (Ascend's) lists the dropped GPU resource as [].
    async def ascend_devices(side: Side) -> None:
        mark = side.writes()
        side.plugins[ASCEND_SOCKET].set_devices(["npu-0"])
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: Ascend's write")

    seen = await both(sim, real, ascend_devices, "Ascend's new device list")
    assert seen["checkpoint"]["RegisteredDevices"][GPU] == frozenset()

    # 7. The GPU plugin starts again and registers.
    async def restart_gpu(side: Side) -> None:
        mark = side.writes()
        await side.plugins[gpu_socket].restart()
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the GPU plugin's write")

    await both(sim, real, restart_gpu, "the GPU plugin's restart")

    # 8. The kubelet restarts gracefully (kubelet.sock goes first), and the GPU plugin does not register
    # again: the checkpoint is not rewritten at start; Ascend's first answer lists GPU as [].
    async def graceful_restart(side: Side) -> None:
        side.plugins[gpu_socket].register_enabled = False
        mark, since = side.writes(), len(side.seen)
        regs = side.plugins[ASCEND_SOCKET].registrations
        await side.kubelet.restart(unlink_socket=True)
        await wait_for(
            lambda: side.plugins[ASCEND_SOCKET].registrations > regs and side.writes() > mark,
            TIMEOUT,
            f"{side.label}: Ascend's registration after the restart",
        )
        await wait_for(lambda: os.path.exists(side.plugins[gpu_socket].socket_path), TIMEOUT, "GPU serving")
        deleted = side.deleted_sockets(since)
        assert deleted.index(KUBELET_SOCK) < deleted.index(gpu_socket), deleted
        order[side.label] = deleted

    seen = await both(sim, real, graceful_restart, "a graceful kubelet restart")
    assert order["simulator"] == order["real"]
    assert seen["checkpoint"]["RegisteredDevices"] == {GPU: frozenset(), ASCEND: frozenset({"npu-0"})}
    assert seen["capacity"][:2] == ({GPU: 0, ASCEND: 1}, {GPU: 0, ASCEND: 1})

    async def register_gpu(side: Side) -> None:
        mark = side.writes()
        p = side.plugins[gpu_socket]
        p.register_enabled = True
        assert await p.register(), p.last_register_error
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the GPU plugin's write")

    await both(sim, real, register_gpu, "the GPU plugin's registration after the restart")

    # 9. The kubelet is killed (kubelet.sock stays, dead) and starts again: its cleanup removes the
    # sockets in the directory's order, the GPU plugin's before kubelet.sock. Both plugins register.
    async def killed_restart(side: Side) -> None:
        mark, since = side.writes(), len(side.seen)
        regs = {n: p.registrations for n, p in side.plugins.items()}
        await side.kubelet.restart(unlink_socket=False)
        await wait_for(
            lambda: (
                all(p.registrations > regs[n] for n, p in side.plugins.items()) and side.writes() >= mark + 2
            ),
            TIMEOUT,
            f"{side.label}: both registrations after the restart",
        )
        deleted = side.deleted_sockets(since)
        assert deleted.index(gpu_socket) < deleted.index(KUBELET_SOCK), deleted
        order[side.label] = deleted

    order.clear()
    seen = await both(sim, real, killed_restart, "a killed kubelet's restart")
    assert order["simulator"] == order["real"]
    assert seen["pods"][("default", "pod-a", "main")] == {(GPU, "GPU-0", 0), (GPU, "GPU-2", None)}

    # 10. Allocating what the container holds changes nothing; another pod gets Ascend's device.
    async def same_again(side: Side) -> None:
        mark = side.writes()
        assert await side.allocate("pod-a", "main", GPU, 2) == ["GPU-0", "GPU-2"]
        assert side.writes() == mark

    await both(sim, real, same_again, "the same allocation again")
    seen = await both(sim, real, allocate("pod-b", ASCEND, 1), "allocate pod-b")
    assert allocated["simulator"] == allocated["real"] == ["npu-0"]


def register_error(side: Side, plugin: FakeDevicePlugin) -> str | None:
    """The plugin's last Register error, with the folder as the real kubelet names it."""
    error = plugin.last_register_error
    return None if error is None else error.replace(side.dir, "/var/lib/kubelet/device-plugins")


def stream_ends(side: Side, mark: int) -> int:
    """ListAndWatch streams the kubelet has seen end since `mark` (real) / streams now closed (simulator)."""
    if isinstance(side.kubelet, RealKubelet):
        msg = "ListAndWatch ended unexpectedly for device plugin"
        return len(side.kubelet.process.find("log", lambda e: e.get("msg") == msg, mark))
    raise AssertionError("simulator: use FakeKubelet.streams")


async def test_register_failures_read_the_same(sides: tuple[Side, Side]) -> None:
    """The kubelet's refusals word for word, and what a failed Register leaves behind: a version or a name
    refused (plugin/v1beta1/server.go Register), the options call failing after the dial (manager.go
    PluginConnected: the dialed connection stays open), and a second Register on a connected socket path
    (since PR 135437 refused, `device plugin already connected`; before it, accepted)."""
    sim, real = sides
    errors: dict[str, dict[str, str | None]] = {"simulator": {}, "real": {}}

    async def refused(side: Side) -> None:
        p = side.plugin(GPU, "nvidia-gpu.sock", ["GPU-0"], retry_interval=3600)
        p.register_enabled = False
        await p.start()
        p.register_enabled = True
        for label, attr, value in [
            ("version", "api_version", "v1alpha"),
            ("name", "register_resource_name", 'nvidia.com/g"pu'),
        ]:
            setattr(p, attr, value)
            assert not await p.register()
            errors[side.label][label] = register_error(side, p)
            p.api_version, p.register_resource_name = "v1beta1", GPU
        p.options_error = "device enumeration failed"
        assert not await p.register()
        errors[side.label]["options"] = register_error(side, p)
        p.options_error = None
        errors[side.label]["connections"] = str(_accepted_connections(p.socket_path))

    await both(sim, real, refused, "refused registrations")
    assert errors["simulator"] == errors["real"]
    assert errors["real"]["version"] == (
        'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
    )
    assert errors["real"]["connections"] == "1"  # the options call's connection, never closed

    async def register_twice(side: Side) -> None:
        p = side.plugins["nvidia-gpu.sock"]
        mark = side.writes()
        assert await p.register()
        await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the first answer's write")
        mark = side.writes()
        errors[side.label]["again"] = None if await p.register() else register_error(side, p)
        if errors[side.label]["again"] is None:  # accepted (before PR 135437): a second stream, a write
            await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the second answer's write")

    await both(sim, real, register_twice, "a second Register on the same socket")
    assert errors["simulator"]["again"] == errors["real"]["again"]

    async def crash(side: Side) -> None:
        mark = side.log_mark()
        await side.plugins["nvidia-gpu.sock"].crash()
        if isinstance(side.kubelet, RealKubelet):
            await wait_for(lambda: stream_ends(side, mark) >= 1, TIMEOUT, "the stream's end")
            await side.kubelet.capacity()  # a round trip: runClient has finished with the end by now
        else:
            kubelet = side.kubelet
            await wait_for(lambda: kubelet.streams(GPU) == 0, TIMEOUT, "the stream's end")

    seen = await both(sim, real, crash, "the plugin's crash after a second Register")
    if errors["real"]["again"] is not None:  # v1.37: the refusal forgot the old client; nothing disconnects
        assert seen["capacity"][1] == {GPU: 1}
        assert seen["allocatable"] == {(GPU, "GPU-0", None)}
    else:
        assert seen["capacity"][1] == {GPU: 0}


def _accepted_connections(path: str) -> int:

    return sum(1 for s in proc_net_unix() if s.state == ESTABLISHED and s.path == normalise(path))


async def test_an_old_instances_late_end_on_both(sides: tuple[Side, Side]) -> None:
    """kubernetes issue 121994: instance A registered, B registers for the same resource on another
    socket, then A dies. Before PR 135437 (v1.36.5; the simulator's reregister_race) the kubelet
    disconnects B, which keeps serving untold; since (v1.37.2; the default) only A's endpoint goes."""
    sim, real = sides

    async def two_instances(side: Side) -> None:
        for name, devices in [("gpu-a.sock", ["GPU-0"]), ("gpu-b.sock", ["GPU-0", "GPU-1", "GPU-2"])]:
            await written_after(side, side.plugin(GPU, name, devices).start, f"{name}'s write")

    seen = await both(sim, real, two_instances, "two instances registered")
    assert seen["capacity"][1] == {GPU: 3}

    async def a_dies(side: Side) -> None:
        mark = side.log_mark()
        await side.plugins["gpu-a.sock"].crash()
        if isinstance(side.kubelet, RealKubelet):
            await side.kubelet.wait_log(disconnected_log(side.kubelet.release), after=mark, timeout=TIMEOUT)
        else:
            kubelet = side.kubelet
            left = 0 if kubelet.reregister_race else 1  # the old kubelet also ends B's stream
            await wait_for(lambda: kubelet.streams(GPU) == left, TIMEOUT, "the disconnect")

    seen = await both(sim, real, a_dies, "the first instance's death")
    b = seen["calls"]["gpu-b.sock"]
    assert b["ListAndWatch"] == 1
    if seen["capacity"][1] == {GPU: 0}:  # disconnected the new one
        assert seen["allocatable"] == frozenset()
    else:
        assert seen["capacity"][1] == {GPU: 3}


async def test_pod_resources_rate_limit_on_both(new_sides: tuple[Side, Side]) -> None:
    """pkg/kubelet/apis/grpc/ratelimit.go over the PodResources server (100 QPS, burst 10): far faster calls
    are refused with ResourceExhausted `rejected by rate limit` on both."""
    answers: dict[str, set[tuple[str, str | None]]] = {}

    async def hammer(side: Side) -> None:
        async def one(call: Any) -> tuple[str, str | None]:
            try:
                await call(pr.AllocatableResourcesRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details()
            return "OK", None

        async with insecure_channel(side.pod_resources) as channel:
            call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
            answers[side.label] = set(await asyncio.gather(*(one(call) for _ in range(40))))

    await asyncio.gather(hammer(new_sides[0]), hammer(new_sides[1]))
    assert (
        answers["simulator"]
        == answers["real"]
        == {("OK", None), ("RESOURCE_EXHAUSTED", "rejected by rate limit")}
    )


# -- known gaps (docs/simulator-gaps.md): each test fails when its gap changes ----------------------------


async def test_gap_checksum(new_sides: tuple[Side, Side]) -> None:
    """Gap 1: the simulator's checksum is CRC-32 of its JSON, the kubelet's FNV-32a of a Go dump."""
    sim, real = new_sides
    for side in new_sides:
        await written_after(side, side.plugin(GPU, "nvidia-gpu.sock", ["GPU-0"]).start, "the first write")
    assert sim.checkpoint() == real.checkpoint()
    with open(os.path.join(sim.dir, CHECKPOINT_NAME), "rb") as f:
        assert is_simulator_checkpoint(f.read())
    with open(os.path.join(real.dir, CHECKPOINT_NAME), "rb") as f:
        assert not is_simulator_checkpoint(f.read())


async def test_gap_folder_named_in_errors(new_sides: tuple[Side, Side]) -> None:
    """Gap 2: the kubelet names plugin sockets under /var/lib/kubelet/device-plugins whatever folder a test
    gives it (a compile-time path); the simulator names its own folder."""
    sim = new_sides[0]
    errors = {}
    for side in new_sides:
        p = side.plugin(GPU, "nvidia-gpu.sock", ["GPU-0"], retry_interval=3600)
        await written_after(side, p.start, "the first write")
        assert not await p.register()
        errors[side.label] = p.last_register_error
    assert (
        errors["real"] == "device plugin already connected: /var/lib/kubelet/device-plugins/nvidia-gpu.sock"
    )
    assert errors["simulator"] == f"device plugin already connected: {sim.dir}/nvidia-gpu.sock"


async def test_gap_allocation_without_a_preference(new_sides: tuple[Side, Side]) -> None:
    """Gap 3: without a preferred allocation the kubelet takes devices in Go's set order (random); the
    simulator takes the lowest IDs. One device to each of 6 pods out of 16."""
    devices = [f"GPU-{i:02d}" for i in range(16)]
    picks: dict[str, list[str]] = {}
    for side in new_sides:
        p = side.plugin(GPU, "nvidia-gpu.sock", devices)
        p.get_preferred_allocation = False
        await written_after(side, p.start, "the first write")
        picks[side.label] = [(await side.allocate(f"pod-{i}", "main", GPU, 1))[0] for i in range(6)]
        assert p.calls["GetPreferredAllocation"] == 0
    assert picks["simulator"] == devices[:6]
    assert picks["real"] != devices[:6]  # by chance: 1 in 5.8 million were Go's order uniform


async def test_a_second_register_then_the_first_streams_end_on_both(sides: tuple[Side, Side]) -> None:
    """A plugin registers twice on its own socket, then ends its first ListAndWatch stream while its
    server keeps serving. v1.36.5 (reregister_race): the second Register replaces the client, and the
    first stream's end disconnects the second (runClient looks the client up by resource name); the
    first's connection stays with no stream, allocatable 0, pod-resources empty, no write. v1.37.2: the
    second Register is refused and both clients are forgotten (deregisterClient by path); the first
    stream's end disconnects nothing: the devices stay allocatable, two connections stay open."""
    sim, real = sides
    accepted: dict[str, bool] = {}

    async def register_twice(side: Side) -> None:
        p = side.plugin(GPU, "nvidia-gpu.sock", ["GPU-0", "GPU-1"], retry_interval=3600)
        await written_after(side, p.start, "the first answer's write")
        mark = side.writes()
        accepted[side.label] = await p.register()
        if accepted[side.label]:
            await wait_for(lambda: side.writes() > mark, TIMEOUT, f"{side.label}: the second answer's write")

    await both(sim, real, register_twice, "a second Register on the plugin's own socket")
    assert accepted["simulator"] == accepted["real"]
    streams = {s.label: s.plugins["nvidia-gpu.sock"].streams_open for s in (sim, real)}
    assert streams["simulator"] == streams["real"] == (2 if accepted["real"] else 1)

    async def first_stream_ends(side: Side) -> None:
        mark = side.log_mark()
        p = side.plugins["nvidia-gpu.sock"]
        p.end_stream("oldest")
        if isinstance(side.kubelet, RealKubelet):
            await wait_for(lambda: stream_ends(side, mark) >= 1, TIMEOUT, "the stream's end")
            if accepted["real"]:
                msg = disconnected_log(side.kubelet.release)
                await side.kubelet.wait_log(msg, after=mark, timeout=TIMEOUT)
            await side.kubelet.capacity()  # a round trip: runClient has finished with the end by now
        else:
            kubelet = side.kubelet
            await wait_for(lambda: kubelet.streams(GPU) == 0, TIMEOUT, "the streams' end")
        await wait_for(lambda: p.streams_open == 0, TIMEOUT, f"{side.label}: no stream on the plugin")

    seen = await both(sim, real, first_stream_ends, "the first stream's end")
    connections = {
        s.label: _accepted_connections(s.plugins["nvidia-gpu.sock"].socket_path) for s in (sim, real)
    }
    assert connections["simulator"] == connections["real"]
    if accepted["real"]:  # v1.36.5: the second disconnected, the first's connection left with no stream
        assert seen["capacity"][1] == {GPU: 0}
        assert seen["allocatable"] == frozenset()
        assert connections["real"] == 1
    else:  # v1.37.2: nothing disconnects; the refused dial and the first's connection stay open
        assert seen["capacity"][1] == {GPU: 2}
        assert connections["real"] == 2
    assert seen["checkpoint"]["RegisteredDevices"] == {GPU: frozenset({"GPU-0", "GPU-1"})}  # no write
