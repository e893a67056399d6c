"""Each kubelet fact the simulator emulates, one test each, citing the kubernetes source it follows.

Paths are in kubernetes/kubernetes (v1.37 unless a test says otherwise); `devicemanager/` stands for
pkg/kubelet/cm/devicemanager/.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

import testing.kubelet as kubelet_module
from hami_guard.node.unixdiag import ESTABLISHED, normalise, proc_net_unix
from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import DEVICE_PLUGIN, POD_RESOURCES, REGISTRATION, insecure_channel, unary
from sidecar.watcher import FolderWatcher, FsEvent
from testing import (
    ERR_INVALID_RESOURCE_NAME,
    ERR_RATE_LIMIT,
    ERR_UNSUPPORTED_VERSION,
    DeviceManagerError,
    FakeDevicePlugin,
    FakeKubelet,
    RealKubeletFolderError,
    go_quote,
    hami_device_ids,
    is_extended_resource_name,
    is_simulator_checkpoint,
)
from tests.conftest import wait_for

GPU = "nvidia.com/gpu"
ASCEND = "huawei.com/Ascend910B3"


def read_json(path: str) -> dict[str, object]:
    with open(path) as f:
        doc: dict[str, object] = json.load(f)
    return doc


def registered(kubelet: FakeKubelet) -> dict[str, list[str]]:
    data = read_json(kubelet.checkpoint_path)["Data"]
    assert isinstance(data, dict)
    result: dict[str, list[str]] = data["RegisteredDevices"]
    return result


def checkpoint_bytes(kubelet: FakeKubelet) -> tuple[int, bytes]:
    """The checkpoint's inode and content: both unchanged means it was not rewritten."""
    with open(kubelet.checkpoint_path, "rb") as f:
        return os.fstat(f.fileno()).st_ino, f.read()


Entry = tuple[str, tuple[str, ...], tuple[int, ...] | None]


def entries(devices: object) -> list[Entry]:
    """ContainerDevices as (resource, device IDs, NUMA nodes or None when there is no topology), sorted."""
    out: list[Entry] = []
    for d in devices:  # type: ignore[attr-defined]
        numa = tuple(n.ID for n in d.topology.nodes) if d.HasField("topology") else None
        out.append((d.resource_name, tuple(d.device_ids), numa))
    return sorted(out, key=repr)


async def allocatable(kubelet: FakeKubelet) -> list[Entry]:
    assert kubelet.pod_resources_socket
    async with insecure_channel(kubelet.pod_resources_socket) as channel:
        call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
        answer = await call(pr.AllocatableResourcesRequest(), timeout=2)
    return entries(answer.devices)


async def listed_pods(kubelet: FakeKubelet) -> pr.ListPodResourcesResponse:
    assert kubelet.pod_resources_socket
    async with insecure_channel(kubelet.pod_resources_socket) as channel:
        call = unary(channel, POD_RESOURCES, "List", pr.ListPodResourcesResponse)
        return await call(pr.ListPodResourcesRequest(), timeout=2)


def accepted_connections(path: str) -> int:
    """Connections accepted on the listener bound at `path` in this process's namespace (/proc/net/unix)."""
    return sum(1 for s in proc_net_unix() if s.state == ESTABLISHED and s.path == normalise(path))


@pytest.fixture
async def make_kubelet(dp_dir: str, short_tmp: str) -> AsyncIterator[Callable[..., FakeKubelet]]:
    """FakeKubelets with settings of the test's own, on the shared folder; closed at the end."""
    made: list[FakeKubelet] = []
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")

    def make(**kwargs: Any) -> FakeKubelet:
        kwargs.setdefault("dial_timeout", 0.5)
        made.append(FakeKubelet(dp_dir, pod_resources, **kwargs))
        return made[-1]

    yield make
    for k in made:
        await k.close()


async def reacted_to_the_restart(plugin: FakeDevicePlugin) -> None:
    """Wait until the plugin has answered the new kubelet.sock as HAMi does: its server restarted on a
    new socket (the kubelet deleted the old one) and its Register decided, whatever it was."""
    await wait_for(lambda: plugin.serving and os.path.exists(plugin.socket_path), what="the plugin's restart")


async def register(kubelet: FakeKubelet, request: dp.RegisterRequest) -> grpc.aio.AioRpcError | None:
    async with insecure_channel(kubelet.socket_path) as channel:
        try:
            await unary(channel, REGISTRATION, "Register", dp.Empty)(request, timeout=5)
        except grpc.aio.AioRpcError as e:
            return e
    return None


async def test_registration_accepted_and_checkpoint_lists_the_devices(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/plugin/v1beta1/handler.go connectClient: dial (client.go Connect), manager.go
    PluginConnected (GetDevicePluginOptions), then one ListAndWatch stream (client.go Run)."""
    assert plugin.registrations == 1
    assert registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}
    assert kubelet.connected(GPU) and kubelet.streams(GPU) == 1
    assert plugin.calls["GetDevicePluginOptions"] == 1  # the kubelet's synchronous dial-back
    assert plugin.calls["ListAndWatch"] == 1


async def test_wrong_version_rejected_with_the_kubelets_wording(kubelet: FakeKubelet) -> None:
    """devicemanager/plugin/v1beta1/api.go errUnsupportedVersion, `... Supported version is %q`, formatted in
    server.go Register with api.SupportedVersions, a Go array (k8s.io/kubelet deviceplugin/v1beta1
    constants.go): %q prints it as ["v1beta1"]. A plain Go error: grpc-go answers code Unknown."""
    err = await register(kubelet, dp.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=GPU))
    assert err is not None
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert (
        err.details()
        == 'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
    )
    assert err.details() == ERR_UNSUPPORTED_VERSION.format("v1alpha")
    err = await register(kubelet, dp.RegisterRequest(version='v"1\n', endpoint="x.sock", resource_name=GPU))
    assert err is not None
    assert err.details() == (
        'requested API version "v\\"1\\n" is not supported by kubelet. Supported version is ["v1beta1"]'
    )


@pytest.mark.parametrize(
    "name", ["gpu", "kubernetes.io/gpu", "requests.nvidia.com/gpu", "nvidia.com/", "Nvidia_com/gpu"]
)
async def test_invalid_resource_name_rejected_with_the_kubelets_wording(
    kubelet: FakeKubelet, name: str
) -> None:
    """devicemanager/plugin/v1beta1/api.go errInvalidResourceName, `the ResourceName %q is invalid`."""
    err = await register(
        kubelet, dp.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name=name)
    )
    assert err is not None
    assert err.details() == f'the ResourceName "{name}" is invalid' == ERR_INVALID_RESOURCE_NAME.format(name)


async def test_kubelet_errors_quote_as_go_does(kubelet: FakeKubelet) -> None:
    """fmt's %q is strconv.Quote: escapes for quotes, backslashes and control characters, \\u for other
    non-printable runes, printable runes kept (src/strconv/quote.go)."""
    err = await register(
        kubelet, dp.RegisterRequest(version="v1beta1", endpoint="x", resource_name='a.io/g"\\')
    )
    assert err is not None
    assert err.details() == 'the ResourceName "a.io/g\\"\\\\" is invalid'
    assert go_quote("a\x00\x7fé\u200b\U0001f600\t") == '"a\\x00\\x7fé\\u200b\U0001f600\\t"'


def test_extended_resource_names_follow_kubernetes() -> None:
    """pkg/apis/core/v1/helper/helpers.go IsExtendedResourceName: not native (has a `/`, no
    `kubernetes.io/`), no `requests.` prefix, and `requests.<name>` a qualified name (253 for the prefix)."""
    assert is_extended_resource_name("nvidia.com/gpu")
    assert is_extended_resource_name("huawei.com/Ascend910B3")
    assert not is_extended_resource_name("cpu")
    assert not is_extended_resource_name("foo.kubernetes.io/gpu")
    assert not is_extended_resource_name("nvidia.com/gpu/extra")
    assert not is_extended_resource_name("nvidia.com/" + "g" * 64)
    assert is_extended_resource_name("a" * 244 + "/gpu")  # "requests." + 244 = 253
    assert not is_extended_resource_name("a" * 245 + "/gpu")


async def test_register_calls_are_counted_even_when_rejected(kubelet: FakeKubelet) -> None:
    """devicemanager/plugin/v1beta1/server.go Register: DevicePluginRegistrationCount before any check."""
    await register(kubelet, dp.RegisterRequest(version="v0", endpoint="x.sock", resource_name=GPU))
    await register(kubelet, dp.RegisterRequest(version="v1beta1", endpoint="missing.sock", resource_name=GPU))
    assert kubelet.register_calls[GPU] == 2


async def test_register_is_synchronous_and_fails_when_the_plugin_does_not_serve(kubelet: FakeKubelet) -> None:
    """devicemanager/plugin/v1beta1/client.go dial: a blocking DialContext with a 10 s timeout,
    `failed to dial device plugin: context deadline exceeded` (errFailedToDialDevicePlugin)."""
    err = await register(
        kubelet, dp.RegisterRequest(version="v1beta1", endpoint="nothing.sock", resource_name=GPU)
    )
    assert err is not None
    assert err.details() == "failed to dial device plugin: context deadline exceeded"


async def test_hung_plugin_makes_register_fail_after_the_dial_timeout(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/plugin/v1beta1/client.go dial (WithBlock): a listener that never answers times out."""
    plugin.hung = True
    started = time.monotonic()
    assert not await plugin.register()
    elapsed = time.monotonic() - started
    assert plugin.last_register_error == "failed to dial device plugin: context deadline exceeded"
    assert elapsed >= kubelet.dial_timeout  # it waited the dial timeout; upper bounds belong to bench/


async def test_options_error_fails_register_with_the_kubelets_wording(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/manager.go PluginConnected: `failed to get device plugin options: %v`."""
    plugin.options_error = "device enumeration failed"
    assert not await plugin.register()
    assert plugin.last_register_error == (
        "failed to get device plugin options: rpc error: code = Internal desc = device enumeration failed"
    )


async def test_a_register_that_fails_after_the_dial_leaves_the_connection_open(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    """devicemanager/plugin/v1beta1/client.go Connect keeps the dialed connection before manager.go
    PluginConnected runs; when that fails, handler.go connectClient only deregisters the client and nobody
    closes the connection: the plugin's socket keeps a kubelet connection that carries no stream."""
    plugin = FakeDevicePlugin(dp_dir, register_timeout=5)
    plugin.options_error = "device enumeration failed"
    async with plugin:
        assert plugin.registrations == 0 and plugin.calls["ListAndWatch"] == 0
        assert not kubelet.connected(GPU)
        assert accepted_connections(plugin.socket_path) == 1


async def test_plugin_serves_before_registering(kubelet: FakeKubelet, dp_dir: str) -> None:
    """devicemanager/plugin/v1beta1/handler.go connectClient dials back inside Register, so a plugin serves
    first (HAMi's Start: Serve, then Register, nvinternal/plugin/server.go in Project-HAMi/HAMi)."""
    plugin = FakeDevicePlugin(dp_dir, register_timeout=5)
    try:
        await plugin.start()
        assert plugin.registrations == 1 and plugin.last_register_error is None
    finally:
        await plugin.close()


async def test_each_listandwatch_update_rewrites_the_checkpoint_atomically(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin, dp_dir: str
) -> None:
    """devicemanager/manager.go genericDeviceUpdateCallback → writeCheckpoint (healthy devices only);
    pkg/kubelet/util/store/filestore.go writeFile: a `.`-prefixed temporary file, fsync, rename."""
    before = os.stat(kubelet.checkpoint_path)
    plugin.set_health("GPU-1", healthy=False)
    await wait_for(lambda: registered(kubelet) == {GPU: ["GPU-0"]})
    after = os.stat(kubelet.checkpoint_path)
    assert after.st_ino != before.st_ino  # written elsewhere, then renamed over
    assert not [n for n in os.listdir(dp_dir) if n.startswith(".")]  # no temporary file left
    doc = read_json(kubelet.checkpoint_path)
    assert list(doc) == ["Data", "Checksum"] and isinstance(doc["Checksum"], int)
    assert read_json(kubelet.checkpoint_path)["Data"] == {
        "PodDeviceEntries": None,  # Go's nil slice
        "RegisteredDevices": {GPU: ["GPU-0"]},
    }


async def test_zero_devices_are_recorded_as_none(kubelet: FakeKubelet, plugin: FakeDevicePlugin) -> None:
    """devicemanager/manager.go writeCheckpoint: devices.UnsortedList() of an empty set is `[]`."""
    plugin.set_devices([])
    await wait_for(lambda: registered(kubelet) == {GPU: []})


async def test_stream_end_turns_the_devices_unhealthy_in_memory_only(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/manager.go PluginDisconnected: markResourceUnhealthy and setStopTime, no writeCheckpoint;
    capacity keeps the unhealthy devices (GetCapacity), GetAllocatableDevices filters them out at once."""
    assert await allocatable(kubelet) == [(GPU, ("GPU-0",), None), (GPU, ("GPU-1",), None)]
    before, writes = checkpoint_bytes(kubelet), kubelet.checkpoint_writes
    await plugin.crash()
    await wait_for(lambda: kubelet.stopped(GPU), what="the kubelet to see the stream end")
    assert not kubelet.connected(GPU)
    assert kubelet.healthy_devices(GPU) == [] and kubelet.unhealthy_devices(GPU) == ["GPU-0", "GPU-1"]
    assert GPU in kubelet.resources()
    assert kubelet.capacity_counts() == ({GPU: 2}, {GPU: 0})
    assert await kubelet.capacity() == ({GPU: 2}, {GPU: 0}, [])  # within the stop grace
    assert await allocatable(kubelet) == []
    assert checkpoint_bytes(kubelet) == before and kubelet.checkpoint_writes == writes


async def test_start_reads_the_checkpoint_and_does_not_rewrite_it(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/manager.go Start → readCheckpoint: each RegisteredDevices resource becomes a stopped
    endpoint (endpoint.go newStoppedEndpointImpl, stop time = now) with empty device sets; then
    plugin/v1beta1/server.go Start cleans the folder and listens. No writeCheckpoint on the way."""
    plugin.register_enabled = False
    before = checkpoint_bytes(kubelet)
    await kubelet.restart()
    await reacted_to_the_restart(plugin)
    assert checkpoint_bytes(kubelet) == before  # still lists the old devices as healthy
    assert registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}
    assert kubelet.resources() == [GPU] and kubelet.healthy_devices(GPU) == [] and kubelet.stopped(GPU)
    assert await kubelet.capacity() == ({GPU: 0}, {GPU: 0}, [])
    assert await allocatable(kubelet) == []
    assert kubelet.register_calls[GPU] == 1


async def test_start_creates_a_missing_folder_as_the_checkpoint_store_does(short_tmp: str) -> None:
    """devicemanager/manager.go NewManagerImpl → checkpointmanager.NewCheckpointManager → pkg/kubelet/util/
    store/filestore.go NewFileStore: MkdirAll(dir, 0755) before plugin/v1beta1/server.go Start's 0750."""
    folder = os.path.join(short_tmp, "fresh", "device-plugins")
    umask = os.umask(0o022)
    try:
        async with FakeKubelet(folder):
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755
    finally:
        os.umask(umask)


async def test_restart_deletes_sockets_but_not_the_checkpoint_nor_other_files(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin, dp_dir: str, short_tmp: str
) -> None:
    """devicemanager/manager.go CleanupPluginDirectory: every socket (os.Stat follows a symlink; RemoveAll
    removes the link, not its target) except the checkpoint; folders and other files stay."""
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(os.path.join(dp_dir, "stale.sock"))
    elsewhere = socket.socket(socket.AF_UNIX)
    elsewhere.bind(os.path.join(short_tmp, "elsewhere.sock"))
    os.symlink(os.path.join(short_tmp, "elsewhere.sock"), os.path.join(dp_dir, "link"))
    os.mkdir(os.path.join(dp_dir, "DEPRECATION"))
    with open(os.path.join(dp_dir, "notes.txt"), "w"):
        pass
    seen: list[FsEvent] = []
    watcher = FolderWatcher(dp_dir, seen.append, asyncio.get_running_loop(), mode="inotify")
    assert watcher.start()
    try:
        await kubelet.restart()
        # kubelet.sock is a new file (its inode number may be reused, so events tell, not st_ino).
        await wait_for(lambda: FsEvent("created", "kubelet.sock") in seen)
        assert seen.index(FsEvent("deleted", "kubelet.sock")) < seen.index(FsEvent("created", "kubelet.sock"))
        for name in ("nvidia-gpu.sock", "stale.sock", "link"):
            assert FsEvent("deleted", name) in seen
        assert FsEvent("deleted", "kubelet_internal_checkpoint") not in seen
        assert os.path.isdir(os.path.join(dp_dir, "DEPRECATION"))
        assert os.path.isfile(os.path.join(dp_dir, "notes.txt"))
        assert os.path.isfile(kubelet.checkpoint_path)
        assert stat.S_ISSOCK(os.stat(kubelet.socket_path).st_mode)
        assert stat.S_ISSOCK(os.stat(os.path.join(short_tmp, "elsewhere.sock")).st_mode)
    finally:
        watcher.stop()
        stale.close()
        elsewhere.close()


async def test_restart_removes_the_sockets_in_the_directorys_order(kubelet: FakeKubelet, dp_dir: str) -> None:
    """devicemanager/manager.go CleanupPluginDirectory lists the folder with Readdirnames(-1), which does not
    sort: the sockets go in the order getdents yields them (os.listdir reads the same order), a dead
    kubelet.sock among them. A test picks an order by picking names (ext4 hashes them)."""
    held = []
    for i in range(6):
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(dp_dir, f"p{i}.sock"))
        held.append(s)
    order = [n for n in os.listdir(dp_dir) if n.endswith(".sock")]
    seen: list[FsEvent] = []
    watcher = FolderWatcher(dp_dir, seen.append, asyncio.get_running_loop(), mode="inotify")
    assert watcher.start()
    try:
        await kubelet.restart()  # killed: kubelet.sock stays as a dead file for the new kubelet to remove
        await wait_for(lambda: FsEvent("created", "kubelet.sock") in seen)
        assert [e.name for e in seen if e.kind == "deleted"] == order
    finally:
        watcher.stop()
        for s in held:
            s.close()


async def test_plugin_registers_again_by_itself_after_a_kubelet_restart(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """HAMi restarts its plugins (serve, then Register) when fsnotify reports kubelet.sock's creation
    (cmd/device-plugin/nvidia in Project-HAMi/HAMi: `inotify: kubelet.sock created, restarting.`); the
    kubelet's first answer rewrites the checkpoint (devicemanager/manager.go genericDeviceUpdateCallback)."""
    before = checkpoint_bytes(kubelet)
    await kubelet.restart()
    await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"], what="re-registration")
    assert checkpoint_bytes(kubelet)[0] != before[0]  # its ListAndWatch answer rewrote the checkpoint
    assert registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}
    assert kubelet.register_calls[GPU] == 2
    assert plugin.registrations == 2
    assert os.path.exists(plugin.socket_path)


async def test_stopped_kubelet_leaves_a_dead_socket_file(kubelet: FakeKubelet) -> None:
    """A killed kubelet leaves kubelet.sock behind (only a graceful devicemanager/plugin/v1beta1/server.go
    Stop closes the listener, which unlinks it); the next start removes it with the other sockets. So does
    its PodResources socket, which the next start replaces (CreateListener, k8s.io/cri-client pkg/util)."""
    inode = os.stat(kubelet.socket_path).st_ino
    await kubelet.stop()
    assert os.stat(kubelet.socket_path).st_ino == inode
    assert kubelet.pod_resources_socket
    for path in (kubelet.socket_path, kubelet.pod_resources_socket):
        with socket.socket(socket.AF_UNIX) as s, pytest.raises(ConnectionRefusedError):
            s.connect(path)
    await kubelet.start()
    assert len(await allocatable(kubelet)) == 0  # a new pod-resources server on the same path


async def test_unknown_method_and_unknown_service_answer_with_grpc_go_wording(kubelet: FakeKubelet) -> None:
    """grpc-go's server.go (google.golang.org/grpc) answers Unimplemented `unknown method %v for service %v`
    and `unknown service %v`; the kubelet registers only v1beta1.Registration on kubelet.sock."""
    async with insecure_channel(kubelet.socket_path) as channel:
        for path, wording in [
            ("/v1beta1.Registration/Probe", "unknown method Probe for service v1beta1.Registration"),
            ("/grpc.health.v1.Health/Check", "unknown service grpc.health.v1.Health"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(path)(b"", timeout=2)  # type: ignore[arg-type]
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert err.value.details() == wording
    assert sum(kubelet.register_calls.values()) == 0


async def test_pod_resources_lists_healthy_devices_once_per_numa_node(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    """pkg/kubelet/apis/podresources/server_v1.go GetAllocatableResources: devicemanager/manager.go
    GetAllocatableDevices (allDevices.Filter(healthyDevices)) converted by
    containerDevicesFromResourceDeviceInstances (pkg/kubelet/cm/container_manager.go): one entry per
    (device, NUMA node); a device without topology once, with none; an empty topology, not at all."""
    devices = ["GPU-0", "GPU-1", "GPU-2", "GPU-3", "GPU-4"]
    numa = {"GPU-0": [0, 1], "GPU-1": [1], "GPU-3": [], "GPU-4": [0]}
    async with FakeDevicePlugin(dp_dir, devices=devices, numa=numa, register_timeout=5) as plugin:
        plugin.set_health("GPU-4", healthy=False)
        await wait_for(lambda: kubelet.unhealthy_devices(GPU) == ["GPU-4"])
        assert await allocatable(kubelet) == sorted(
            [
                (GPU, ("GPU-0",), (0,)),
                (GPU, ("GPU-0",), (1,)),
                (GPU, ("GPU-1",), (1,)),
                (GPU, ("GPU-2",), None),
            ],
            key=repr,
        )
        assert kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]


async def test_pod_resources_is_rate_limited_like_the_kubelets(kubelet: FakeKubelet) -> None:
    """pkg/kubelet/apis/podresources/constants.go DefaultQPS 100, DefaultBurstTokens 10, applied to every
    method by pkg/kubelet/apis/grpc/ratelimit.go: ResourceExhausted `rejected by rate limit`."""
    assert kubelet.pod_resources_socket

    async def one(call: Any) -> tuple[grpc.StatusCode, str | None]:
        try:
            await call(pr.AllocatableResourcesRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, None

    async with insecure_channel(kubelet.pod_resources_socket) as channel:
        call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
        codes = await asyncio.gather(*(one(call) for _ in range(40)))  # far faster than 100 a second
    assert codes.count((grpc.StatusCode.OK, None)) >= 10  # the burst
    assert (grpc.StatusCode.RESOURCE_EXHAUSTED, ERR_RATE_LIMIT) in codes
    assert set(codes) <= {(grpc.StatusCode.OK, None), (grpc.StatusCode.RESOURCE_EXHAUSTED, ERR_RATE_LIMIT)}


async def test_allocate_rewrites_the_checkpoint_with_pod_devices_by_numa_node(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    """devicemanager/manager.go allocateContainerResources: devicesToAllocate (GetPreferredAllocation first
    when the plugin's options offer it), the plugin's Allocate, podDevices.insert keyed by NUMA node (-1,
    nodeWithoutTopology, for none), then writeCheckpoint; nothing is written when the container already
    holds its devices. pod_devices.go toCheckpointData, checkpoint/checkpoint.go PodDevicesEntry
    (DeviceIDs map[int64][]string: string keys in JSON; AllocResp []byte: base64)."""
    numa = {"GPU-0": [0, 1], "GPU-1": [1]}
    async with FakeDevicePlugin(
        dp_dir, devices=["GPU-0", "GPU-1", "GPU-2"], numa=numa, register_timeout=5
    ) as p:
        await wait_for(lambda: len(kubelet.healthy_devices(GPU)) == 3)
        assert await kubelet.allocate("pod-a", "main", GPU, 2) == ["GPU-0", "GPU-1"]
        assert p.calls["GetPreferredAllocation"] == 1 and p.calls["Allocate"] == 1
        data = read_json(kubelet.checkpoint_path)["Data"]
        assert isinstance(data, dict)
        (entry,) = data["PodDeviceEntries"]
        assert (entry["PodUID"], entry["ContainerName"], entry["ResourceName"]) == ("pod-a", "main", GPU)
        assert {n: set(ids) for n, ids in entry["DeviceIDs"].items()} == {
            "0": {"GPU-0"},
            "1": {"GPU-0", "GPU-1"},
        }
        answer = dp.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
        assert set(answer.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == {"GPU-0", "GPU-1"}

        before = checkpoint_bytes(kubelet)
        assert await kubelet.allocate("pod-a", "main", GPU, 2) == ["GPU-0", "GPU-1"]
        assert checkpoint_bytes(kubelet) == before and p.calls["Allocate"] == 1

        assert await kubelet.allocate("pod-b", "main", GPU, 1) == ["GPU-2"]
        data = read_json(kubelet.checkpoint_path)["Data"]
        assert isinstance(data, dict)
        by_pod = {e["PodUID"]: e["DeviceIDs"] for e in data["PodDeviceEntries"]}
        assert by_pod["pod-b"] == {"-1": ["GPU-2"]}
        with pytest.raises(DeviceManagerError) as err:
            await kubelet.allocate("pod-c", "main", GPU, 1)
        assert (
            str(err.value)
            == "requested number of devices unavailable for nvidia.com/gpu. Requested: 1, Available: 0"
        )
        with pytest.raises(DeviceManagerError) as err:
            await kubelet.allocate("pod-a", "main", GPU, 3)
        assert (
            str(err.value)
            == 'pod "pod-a" container "main" changed request for resource "nvidia.com/gpu" from 2 to 3'
        )

        # pod-resources List: GetDevices per container (pod_devices.go getContainerDevices), same conversion.
        pods = await listed_pods(kubelet)
        listed = {
            (pod.name, c.name): entries(c.devices) for pod in pods.pod_resources for c in pod.containers
        }
        assert listed[("pod-a", "main")] == sorted(
            [(GPU, ("GPU-0",), (0,)), (GPU, ("GPU-0",), (1,)), (GPU, ("GPU-1",), (1,))], key=repr
        )
        assert listed[("pod-b", "main")] == [(GPU, ("GPU-2",), None)]
        assert listed[("pod-c", "main")] == []

        # The pod devices survive a restart (readCheckpoint → podDevices.fromCheckpointData).
        await kubelet.restart()
        assert kubelet.pod_devices("pod-a", "main") == {GPU: ["GPU-0", "GPU-1"]}


async def test_a_write_lists_a_dropped_or_unregistered_resource_as_empty(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin, dp_dir: str
) -> None:
    """devicemanager/manager.go writeCheckpoint dumps every key of healthyDevices; markResourceUnhealthy
    (after a disconnect) and readCheckpoint (at start) leave that key with an empty set, so the next write
    of any kind lists the dropped or not-yet-registered resource as []."""
    async with FakeDevicePlugin(dp_dir, ASCEND, "Ascend910B3.sock", ["npu-0"], register_timeout=5) as ascend:
        await wait_for(lambda: registered(kubelet) == {GPU: ["GPU-0", "GPU-1"], ASCEND: ["npu-0"]})
        before = checkpoint_bytes(kubelet)
        await kubelet.drop(GPU)
        assert checkpoint_bytes(kubelet) == before  # a disconnect writes nothing
        ascend.set_devices(["npu-0", "npu-1"])
        await wait_for(lambda: registered(kubelet) == {GPU: [], ASCEND: ["npu-0", "npu-1"]})

        assert await plugin.register()  # a fresh Register brings the devices back
        await wait_for(lambda: registered(kubelet) == {GPU: ["GPU-0", "GPU-1"], ASCEND: ["npu-0", "npu-1"]})
        plugin.register_enabled = False
        await kubelet.restart()
        await wait_for(lambda: registered(kubelet)[GPU] == [], what="Ascend's answer after the restart")
        assert registered(kubelet) == {GPU: [], ASCEND: ["npu-0", "npu-1"]}


async def test_capacity_drops_a_resource_once_its_stop_grace_ran_out(
    make_kubelet: Callable[..., FakeKubelet], dp_dir: str
) -> None:
    """devicemanager/manager.go GetCapacity: capacity and allocatable per resource; a resource whose
    endpoint's stop grace ran out (endpoint.go stopGracePeriodExpired, types.go endpointStopGracePeriod =
    5 minutes) is deleted, reported as removed, and the checkpoint is rewritten."""
    assert FakeKubelet(dp_dir).stop_grace == 300.0
    kubelet = make_kubelet(stop_grace=0.2, capacity_interval=None)
    await kubelet.start()
    async with FakeDevicePlugin(dp_dir, register_timeout=5) as plugin:
        await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"])
        assert await kubelet.capacity() == ({GPU: 2}, {GPU: 2}, [])
        plugin.register_enabled = False
        await kubelet.restart()
        before = checkpoint_bytes(kubelet)
        assert await kubelet.capacity() == ({GPU: 0}, {GPU: 0}, [])
        assert checkpoint_bytes(kubelet) == before
        await wait_for(lambda: kubelet.stop_grace_expired(GPU), what="the stop grace to run out")
        assert await kubelet.capacity() == ({}, {}, [GPU])
        assert registered(kubelet) == {} and kubelet.resources() == []
        assert await kubelet.capacity() == ({}, {}, [])


async def test_the_capacity_tick_rewrites_the_checkpoint_when_the_grace_runs_out(
    make_kubelet: Callable[..., FakeKubelet], dp_dir: str
) -> None:
    """The kubelet's node status loop calls GetCapacity every nodeStatusUpdateFrequency (10 s):
    pkg/kubelet/nodestatus/setters.go MachineInfo → devicePluginResourceCapacityFunc →
    devicemanager/manager.go GetCapacity. A stream's end writes nothing; the tick after the grace does."""
    assert FakeKubelet(dp_dir).capacity_interval == 10.0
    kubelet = make_kubelet(stop_grace=0.2, capacity_interval=0.02)
    await kubelet.start()
    async with FakeDevicePlugin(dp_dir, register_timeout=5) as plugin:
        await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"])
        assert registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}
        writes = kubelet.checkpoint_writes
        await plugin.crash()
        await wait_for(lambda: kubelet.stopped(GPU))
        assert kubelet.checkpoint_writes == writes
        await wait_for(lambda: kubelet.checkpoint_writes > writes, what="the capacity tick after the grace")
        assert registered(kubelet) == {} and kubelet.resources() == []


async def test_drop_loses_the_plugin_which_keeps_serving_untold(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """kubernetes issue 131013: the kubelet's stream ends and is never re-established. The end runs as any
    other (devicemanager/plugin/v1beta1/handler.go runClient → disconnectClient; client.go Disconnect closes
    the connection; manager.go PluginDisconnected). The plugin is not told; a fresh Register mends it."""
    before = checkpoint_bytes(kubelet)
    await kubelet.drop(GPU)
    assert not kubelet.connected(GPU) and kubelet.stopped(GPU)
    assert kubelet.healthy_devices(GPU) == [] and kubelet.capacity_counts() == ({GPU: 2}, {GPU: 0})
    assert await allocatable(kubelet) == []
    assert checkpoint_bytes(kubelet) == before
    assert plugin.serving and os.path.exists(plugin.socket_path)
    assert plugin.registrations == 1 and kubelet.register_calls[GPU] == 1
    await plugin.restart()
    await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"] and kubelet.connected(GPU))


@pytest.mark.parametrize("race", [False, True], ids=["v1.37", "before-PR-135437"])
async def test_an_old_streams_end_disconnects_the_new_client_before_pr_135437(
    make_kubelet: Callable[..., FakeKubelet], dp_dir: str, race: bool
) -> None:
    """kubernetes issue 121994, fixed by PR 135437. Before it (v1.36 devicemanager/plugin/v1beta1/handler.go):
    registerClient replaces s.clients[name] without stopping the old client; when the old stream ends,
    runClient disconnects getClient(name), the NEW client, and manager.go PluginDisconnected(resourceName)
    marks the resource unhealthy. Since: clients and endpoints are told apart by socket path
    (manager.go endpointStore), so the old one's end only removes it."""
    kubelet = make_kubelet(reregister_race=race)
    await kubelet.start()
    old = FakeDevicePlugin(dp_dir, GPU, "old.sock", ["GPU-0"], register_timeout=5)
    new = FakeDevicePlugin(dp_dir, GPU, "new.sock", ["GPU-1"], register_timeout=5)
    try:
        await old.start()
        await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-0"])
        await new.start()
        await wait_for(lambda: kubelet.healthy_devices(GPU) == ["GPU-1"] and kubelet.streams(GPU) == 2)
        await old.crash()
        if race:
            await wait_for(lambda: kubelet.streams(GPU) == 0, what="both streams to end")
            assert kubelet.healthy_devices(GPU) == [] and kubelet.stopped(GPU)
            assert new.serving and new.registrations == 1  # never told
        else:
            await wait_for(lambda: kubelet.streams(GPU) == 1, what="the old stream to end")
            assert kubelet.healthy_devices(GPU) == ["GPU-1"] and not kubelet.stopped(GPU)
            assert kubelet.connected(GPU)
    finally:
        await old.close()
        await new.close()


async def test_a_second_register_on_the_same_socket_is_refused_while_connected(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    """devicemanager/manager.go PluginConnected (since PR 135437): an endpoint already stored for that socket
    path fails the Register, `device plugin already connected: <path>`; handler.go connectClient then
    deregisters every client of that path, the old one too, so the old stream's end disconnects nothing:
    the devices stay as they were, and the path stays taken until the kubelet restarts (kubernetes PR 139338
    documents this state)."""
    refused = f"device plugin already connected: {plugin.socket_path}"
    assert not await plugin.register()
    assert plugin.last_register_error == refused
    assert kubelet.connected(GPU)  # the first stream goes on
    await plugin.crash()
    await wait_for(lambda: not kubelet.connected(GPU))
    assert kubelet.healthy_devices(GPU) == ["GPU-0", "GPU-1"] and not kubelet.stopped(GPU)
    await plugin.restart()
    assert plugin.registrations == 1 and plugin.last_register_error == refused
    await kubelet.restart()
    await wait_for(lambda: plugin.registrations == 2 and kubelet.connected(GPU), what="registration")


async def test_refuses_a_folder_holding_a_real_kubelets_checkpoint(dp_dir: str) -> None:
    """A real kubelet verifies its checkpoint's checksum (pkg/kubelet/checkpointmanager/checkpoint_manager.go
    GetCheckpoint → VerifyChecksum; checksum/checksum.go: FNV-32a over a Go dump of the struct). To it the
    simulator's file is corrupt, and with a corrupt checkpoint it starts without its pod-to-device
    assignments (devicemanager/manager.go Start: "Continue after failing to read checkpoint file"). So the
    simulator refuses a folder whose checkpoint it did not write, and (force=True) ignores such a file as the
    kubelet ignores a corrupt one."""
    path = os.path.join(dp_dir, "kubelet_internal_checkpoint")
    real = (
        b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":["GPU-0"]}},'
        b'"Checksum":2867316482}'
    )
    with open(path, "wb") as f:
        f.write(real)
    assert not is_simulator_checkpoint(real)
    refused = FakeKubelet(dp_dir)
    with pytest.raises(RealKubeletFolderError, match="written by a real kubelet"):
        await refused.start()
    await refused.close()
    assert not os.path.exists(os.path.join(dp_dir, "kubelet.sock"))
    async with FakeKubelet(dp_dir, force=True) as forced:
        assert forced.resources() == []
        with open(path, "rb") as f:
            assert f.read() == real


async def test_refuses_the_real_kubelets_folder(dp_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """pkg/kubelet/apis/deviceplugin/v1beta1 (k8s.io/kubelet constants.go) DevicePluginPath: the folder every
    kubelet uses. Here the test's folder stands for it."""
    monkeypatch.setattr(kubelet_module, "REAL_DEVICE_PLUGIN_DIR", os.path.realpath(dp_dir))
    refused = FakeKubelet(dp_dir)
    with pytest.raises(RealKubeletFolderError, match="real kubelet's device-plugins folder"):
        await refused.start()
    await refused.close()


async def test_the_simulators_checkpoint_is_recognised(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    with open(kubelet.checkpoint_path, "rb") as f:
        raw = f.read()
    assert is_simulator_checkpoint(raw)
    assert not is_simulator_checkpoint(raw.replace(b"GPU-0", b"GPU-9"))


def test_hami_device_ids_split_each_gpu() -> None:
    """Project-HAMi/HAMi pkg/device-plugin/nvidiadevice/nvinternal/rm/devices.go GetPluginDevices:
    fmt.Sprintf("%v-%v", dev.ID, i) for i below deviceSplitCount (10 by default); MIG devices keep theirs."""
    assert hami_device_ids(["GPU-a", "GPU-b"], split=3) == [
        "GPU-a-0",
        "GPU-a-1",
        "GPU-a-2",
        "GPU-b-0",
        "GPU-b-1",
        "GPU-b-2",
    ]
    assert len(hami_device_ids(["GPU-a", "GPU-b"])) == 20
    assert hami_device_ids(["MIG-1", "MIG-2"]) == ["MIG-1", "MIG-2"]


async def test_hami_plugin_sends_split_ids_with_their_gpus_numa_node(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    """HAMi's GetPluginDevices copies each GPU's topology (one NUMA node) and health to its split IDs;
    health changes are pushed on the open ListAndWatch stream."""
    ids = hami_device_ids(["GPU-aaaa", "GPU-bbbb"], split=2)
    numa = {d: [0] if d.startswith("GPU-aaaa") else [1] for d in ids}
    async with FakeDevicePlugin(dp_dir, devices=ids, numa=numa, register_timeout=5) as plugin:
        await wait_for(lambda: kubelet.healthy_devices(GPU) == sorted(ids))
        assert await allocatable(kubelet) == sorted(
            [(GPU, (d,), (0,) if d.startswith("GPU-aaaa") else (1,)) for d in ids], key=repr
        )
        for d in ids[:2]:
            plugin.set_health(d, healthy=False)
        await wait_for(lambda: kubelet.healthy_devices(GPU) == ids[2:])
        assert plugin.calls["ListAndWatch"] == 1


async def test_plugin_counts_calls_and_answers_slowly_on_demand(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    plugin.answer_delay = 0.3
    async with insecure_channel(plugin.socket_path) as channel:
        call = unary(channel, DEVICE_PLUGIN, "GetDevicePluginOptions", dp.DevicePluginOptions)
        started = time.monotonic()
        await call(dp.Empty(), timeout=2)
        assert time.monotonic() - started >= 0.3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(dp.Empty(), timeout=0.1)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert plugin.calls["GetDevicePluginOptions"] == 3
    assert plugin.calls["Allocate"] == plugin.calls["PreStartContainer"] == 0


async def test_plugin_that_does_not_register_leaves_the_kubelet_unaware(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    async with FakeDevicePlugin(dp_dir) as plugin:
        plugin.register_enabled = False
        await kubelet.restart()
        await reacted_to_the_restart(plugin)
        assert kubelet.register_calls[GPU] == 1 and not kubelet.connected(GPU)
