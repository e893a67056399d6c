"""The kubelet's real device manager (tests/realkubelet, docs/real-kubelet.md), release by release.

By default "new", k8s.io/kubernetes v1.37.2 (with PR 135437: endpoints told apart by socket path),
and v1.30.14, the oldest supported (without it); REALKUBELET_RELEASES=v1.33.13,old,... (or "all")
runs other releases instead (docs/kubelet-releases.md; make real-slow runs every one). Each test
waits for events with timeouts, never blindly.
Without the fixture (`make kubelet-fixtures`) the tests skip; under CI=true they fail.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import AsyncIterator

import pytest

from sidecar.deviceplugin.checkpoint import read_checkpoint
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import POD_RESOURCES, insecure_channel, unary
from testing.realkubelet import (
    FixtureError,
    RealKubelet,
    RealPlugin,
    Release,
    disconnected_log,
    fast_takeover,
    has_pr_135437,
    minor,
    missing_reason,
    selected_releases,
)

RESOURCE = "nvidia.com/gpu"
RELEASES: list[Release] = selected_releases()  # "new" and v1.30.14, or $REALKUBELET_RELEASES


def require_fixture(release: Release) -> None:
    """Skip when the fixture of a release is not built (or Go is missing); fail under CI=true."""
    reason = missing_reason(release)
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI builds it: .ci/run runs that make target)")
    pytest.skip(reason)


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> Release:
    rel: Release = request.param
    require_fixture(rel)
    return rel


@pytest.fixture
def pod_resources_socket(short_tmp: str) -> str:
    return os.path.join(short_tmp, "pod-resources", "kubelet.sock")


@pytest.fixture
async def real_kubelet(
    dp_dir: str, pod_resources_socket: str, release: Release
) -> AsyncIterator[RealKubelet]:
    async with RealKubelet(dp_dir, pod_resources_socket, release=release) as k:
        yield k


@pytest.fixture
async def plugins() -> AsyncIterator[list[RealPlugin]]:
    """Plugins a test starts; closed (and reaped) whatever happens."""
    started: list[RealPlugin] = []
    try:
        yield started
    finally:
        for p in started:
            await p.close()


def registered(k: RealKubelet) -> dict[str, set[str]]:
    return {r: set(ids) for r, ids in read_checkpoint(k.checkpoint_path).registered.items()}


def pod_device_entries(k: RealKubelet) -> list[dict[str, object]]:
    with open(k.checkpoint_path) as f:
        return list(json.load(f)["Data"]["PodDeviceEntries"] or [])


async def allocatable_entries(path: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """GetAllocatableResources: (resource, device, NUMA nodes) for each ContainerDevices entry."""
    channel = insecure_channel(path)
    try:
        call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
        resp = await call(pr.AllocatableResourcesRequest(), timeout=5)
    finally:
        await channel.close()
    return sorted(
        (d.resource_name, dev_id, tuple(n.ID for n in d.topology.nodes))
        for d in resp.devices
        for dev_id in d.device_ids
    )


def refuses(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except ConnectionRefusedError:
        return True
    finally:
        s.close()
    return False


async def start_plugin(
    plugins: list[RealPlugin], plugin: RealPlugin, kubelet: RealKubelet | None = None
) -> RealPlugin:
    """Start a plugin (closed by the test's teardown); wait until the kubelet's stream reaches it and,
    given the kubelet, until the kubelet has taken in its first answer (it then writes its checkpoint)."""
    plugins.append(plugin)
    mark = plugin.mark()
    kmark = kubelet.mark() if kubelet is not None else 0
    await plugin.start()
    assert plugin.last_register_error is None
    await plugin.wait_event("stream-open", after=mark)
    if kubelet is not None:
        await kubelet.wait_checkpoint(after=kmark)
    return plugin


async def test_register_stream_checkpoint_capacity_pod_resources(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    k = real_kubelet
    p = await start_plugin(
        plugins, RealPlugin(dp_dir, devices=("GPU-0@0", "GPU-1@0,1", "GPU-2"), release=release), k
    )
    assert await p.streams_open() == 1
    assert registered(k) == {RESOURCE: {"GPU-0", "GPU-1", "GPU-2"}}
    cap = await k.capacity()
    assert cap["capacity"] == {RESOURCE: 3}
    assert cap["allocatable"] == {RESOURCE: 3}
    # One entry per (device, NUMA node): GPU-1 spans two nodes and is listed twice.
    assert k.pod_resources_socket is not None
    assert await allocatable_entries(k.pod_resources_socket) == [
        (RESOURCE, "GPU-0", (0,)),
        (RESOURCE, "GPU-1", (0,)),
        (RESOURCE, "GPU-1", (1,)),
        (RESOURCE, "GPU-2", ()),
    ]
    calls = await p.calls()
    assert calls == {"GetDevicePluginOptions": 1, "ListAndWatch": 1}


@pytest.mark.parametrize("graceful", [False, True], ids=["sigkill", "graceful"])
async def test_kubelet_restart_cleans_sockets_keeps_checkpoint(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release, graceful: bool
) -> None:
    k = real_kubelet
    p = await start_plugin(plugins, RealPlugin(dp_dir, release=release, watch_kubelet=False), k)
    before = read_checkpoint(k.checkpoint_path)
    old = os.stat(k.socket_path)
    mark = p.mark()
    await k.stop(unlink_socket=graceful)
    await p.wait_event("stream-closed", after=mark)
    if graceful:
        assert not os.path.exists(k.socket_path)  # Stop() unlinks kubelet.sock
    else:
        assert refuses(k.socket_path)  # a dead file outlives a killed kubelet
    await k.start()
    # The new kubelet removed every socket, made a new kubelet.sock, and did not write its checkpoint.
    assert not os.path.exists(p.socket_path)
    assert not refuses(k.socket_path)
    new = os.stat(k.socket_path)
    # A new file; the filesystem may hand it the old inode number again: compare more than that.
    assert (new.st_ino, new.st_ctime_ns) != (old.st_ino, old.st_ctime_ns)
    state = await k.state()
    assert state["checkpoints_written"] == 0
    assert read_checkpoint(k.checkpoint_path) == before
    # The resource read from the checkpoint is a stopped endpoint: listed, with nothing in it.
    cap = await k.capacity()
    assert cap["capacity"] == {RESOURCE: 0}
    assert cap["allocatable"] == {RESOURCE: 0}
    # A plugin that missed the creation of kubelet.sock stays unregistered; a restart registers it.
    assert await p.streams_open() == 0
    mark, kmark = p.mark(), k.mark()
    assert await p.restart()
    await p.wait_event("stream-open", after=mark)
    await k.wait_checkpoint(after=kmark)
    assert registered(k) == {RESOURCE: {"GPU-0", "GPU-1"}}
    assert (await k.capacity())["allocatable"] == {RESOURCE: 2}


@pytest.mark.parametrize("graceful", [False, True], ids=["sigkill", "graceful"])
async def test_plugin_registers_again_when_kubelet_sock_is_created(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release, graceful: bool
) -> None:
    k = real_kubelet
    p = await start_plugin(plugins, RealPlugin(dp_dir, release=release, watch_kubelet=True), k)
    mark = p.mark()
    await k.restart(unlink_socket=graceful)
    await p.wait_event("kubelet-sock-created", after=mark)
    await p.wait_event("registered", after=mark)
    await p.wait_event("stream-open", after=mark)
    await k.wait_checkpoint()  # the new kubelet's first write: the plugin's first answer
    assert await p.streams_open() == 1
    assert os.path.exists(p.socket_path)
    assert (await k.capacity())["allocatable"] == {RESOURCE: 2}


async def test_health_change_rewrites_checkpoint_with_healthy_devices(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    k = real_kubelet
    p = await start_plugin(plugins, RealPlugin(dp_dir, release=release), k)
    mark = k.mark()
    await p.set_health("GPU-1", healthy=False)
    await k.wait_checkpoint(after=mark)
    assert registered(k) == {RESOURCE: {"GPU-0"}}
    cap = await k.capacity()
    assert cap["capacity"] == {RESOURCE: 2}
    assert cap["allocatable"] == {RESOURCE: 1}
    assert k.pod_resources_socket is not None
    assert [d for _, d, _ in await allocatable_entries(k.pod_resources_socket)] == ["GPU-0"]


async def test_plugin_stop_closes_stream_without_rewriting_checkpoint(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    k = real_kubelet
    p = await start_plugin(plugins, RealPlugin(dp_dir, release=release), k)
    before = read_checkpoint(k.checkpoint_path)
    kmark, pmark = k.mark(), p.mark()
    await p.stop_serving()
    await p.wait_event("stream-closed", after=pmark)
    await k.wait_log(disconnected_log(release), after=kmark)
    cap = await k.capacity()
    assert cap["capacity"] == {RESOURCE: 2}  # the devices count as unhealthy for the stop grace
    assert cap["allocatable"] == {RESOURCE: 0}
    assert k.pod_resources_socket is not None
    assert await allocatable_entries(k.pod_resources_socket) == []
    assert not k.process.find("checkpoint", after=kmark)
    assert read_checkpoint(k.checkpoint_path) == before


async def test_allocate_writes_pod_device_entries(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    k = real_kubelet
    p = await start_plugin(plugins, RealPlugin(dp_dir, devices=("GPU-0@0", "GPU-1@1"), release=release), k)
    assert pod_device_entries(k) == []
    mark = k.mark()
    devices = await k.allocate("pod-1", "main", RESOURCE, 1)
    await k.wait_checkpoint(after=mark)
    assert len(devices) == 1
    [entry] = pod_device_entries(k)
    assert (entry["PodUID"], entry["ContainerName"], entry["ResourceName"]) == ("pod-1", "main", RESOURCE)
    numa = "0" if devices == ["GPU-0"] else "1"
    assert entry["DeviceIDs"] == {numa: devices}
    assert (await p.calls())["Allocate"] == 1
    state = await k.state()
    assert state["pods"] == {"pod-1": {"main": {RESOURCE: devices}}}
    # Allocated devices stay allocatable in the node's view (pod-resources lists the node's devices).
    assert (await k.capacity())["allocatable"] == {RESOURCE: 2}


async def test_stub_plugin_registers(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    k = real_kubelet
    mark = k.mark()
    p = RealPlugin(dp_dir, devices=("GPU-0", "GPU-1"), release=release, impl="stub", watch_kubelet=False)
    plugins.append(p)
    await p.start()
    assert p.last_register_error is None
    await k.wait_checkpoint(after=mark)
    assert registered(k) == {RESOURCE: {"GPU-0", "GPU-1"}}
    assert (await k.capacity())["allocatable"] == {RESOURCE: 2}
    with pytest.raises(FixtureError, match="Stub cannot tell"):
        await p.streams_open()


@pytest.mark.parametrize("same_socket", [False, True], ids=["new-socket", "same-socket"])
async def test_second_instance_and_late_end_of_the_first(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release, same_socket: bool
) -> None:
    """kubernetes issue 121994: A registered, B registers, then A's stream ends."""
    k = real_kubelet
    a = await start_plugin(
        plugins, RealPlugin(dp_dir, socket_name="gpu-a.sock", release=release, watch_kubelet=False), k
    )
    b_socket = "gpu-a.sock" if same_socket else "gpu-b.sock"
    b = RealPlugin(
        dp_dir,
        socket_name=b_socket,
        devices=("GPU-0", "GPU-1", "GPU-2"),
        release=release,
        watch_kubelet=False,
    )
    plugins.append(b)
    bmark, kmark = b.mark(), k.mark()
    await b.start()  # B binds its socket (same name: A's file is replaced), then registers
    if has_pr_135437(release) and same_socket:
        # PR 135437: one endpoint per (resource, socket path); A's still holds the path.
        assert "device plugin already connected" in (b.last_register_error or "")
        assert await b.streams_open() == 0
        # The rejection also forgot A's client; when A's stream ends nothing disconnects its endpoint:
        # the kubelet keeps A's devices healthy with no stream at all, and B stays rejected.
        kmark = k.mark()
        await a.crash(remove_socket=True)
        await k.wait_log("ListAndWatch ended unexpectedly for device plugin", after=kmark)
        assert (await k.capacity())["allocatable"] == {RESOURCE: 2}
        assert not k.process.find("log", lambda e: e["msg"] == disconnected_log(release), after=kmark)
        assert not await b.register()
        assert "device plugin already connected" in (b.last_register_error or "")
        assert await b.streams_open() == 0
        return
    assert b.last_register_error is None
    await b.wait_event("stream-open", after=bmark)
    await k.wait_checkpoint(after=kmark)
    assert await a.streams_open() == 1  # the kubelet never stopped A's client
    kmark, bmark = k.mark(), b.mark()
    await a.crash(remove_socket=True)  # A's stream ends (its socket file is removed only if still A's)
    await k.wait_log(disconnected_log(release), after=kmark)
    if not has_pr_135437(release):
        # The old kubelet disconnects the client it holds now, B's: B keeps serving, unregistered.
        await b.wait_event("stream-closed", after=bmark)
        assert await b.streams_open() == 0
        assert (await b.state())["serving"]
        cap = await k.capacity()
        assert cap["allocatable"] == {RESOURCE: 0}
        assert cap["capacity"] == {RESOURCE: 3}
    else:
        # The new kubelet drops A's endpoint only; B's stream and devices stay.
        assert await b.streams_open() == 1
        assert not b.process.find("stream-closed", after=bmark)
        assert (await k.capacity())["allocatable"] == {RESOURCE: 3}
    assert os.path.exists(b.socket_path)


async def test_fast_takeover_on_one_socket_path(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    """kubernetes PR 139338: a Register reaches the path's new owner before it registers itself."""
    k = real_kubelet
    kmark = k.mark()
    first, second = await fast_takeover(dp_dir, release=release, second_devices=("GPU-0", "GPU-1", "GPU-2"))
    plugins += [first, second]
    await k.wait_checkpoint(after=kmark)
    assert await first.streams_open() == 0
    assert await second.streams_open() == 1  # the kubelet's stream runs on the new owner's server
    assert (await k.capacity())["allocatable"] == {RESOURCE: 3}
    if not has_pr_135437(release):
        # Before PR 135437 the owner's own Register replaces the endpoint: accepted.
        assert await second.register()
        return
    for _ in range(3):  # rejected, however often it retries
        assert not await second.register()
        assert "device plugin already connected" in (second.last_register_error or "")
    # ... while a stream of the stale endpoint stays open on its server and its devices count.
    assert await second.streams_open() == 1
    assert (await k.capacity())["allocatable"] == {RESOURCE: 3}
    # Restarting the server ends that stream, but the refusal had forgotten the stale client: nothing
    # disconnects the endpoint, its devices stay allocatable with no stream, and Register is refused.
    mark = second.mark()
    assert not await second.restart()
    await second.wait_event("stream-closed", after=mark)
    assert "device plugin already connected" in (second.last_register_error or "")
    assert await second.streams_open() == 0
    assert (await k.capacity())["allocatable"] == {RESOURCE: 3}
    # A kubelet restart clears it.
    await k.restart()
    mark = second.mark()
    assert await second.restart()
    await second.wait_event("stream-open", after=mark)
    await k.wait_checkpoint()
    assert (await k.capacity())["allocatable"] == {RESOURCE: 3}


async def test_a_dropped_resource_is_listed_empty_at_the_next_write(
    real_kubelet: RealKubelet, dp_dir: str, plugins: list[RealPlugin], release: Release
) -> None:
    """No write when a stream ends; the next write of any kind lists that resource with no device."""
    k = real_kubelet
    gpu = await start_plugin(plugins, RealPlugin(dp_dir, release=release, watch_kubelet=False), k)
    fpga = await start_plugin(
        plugins,
        RealPlugin(dp_dir, "example.com/fpga", "fpga.sock", ("F-0",), release=release, watch_kubelet=False),
        k,
    )
    assert registered(k) == {RESOURCE: {"GPU-0", "GPU-1"}, "example.com/fpga": {"F-0"}}
    kmark = k.mark()
    await gpu.stop_serving()
    await k.wait_log(disconnected_log(release), after=kmark)
    assert registered(k)[RESOURCE] == {"GPU-0", "GPU-1"}
    await fpga.set_devices(["F-0", "F-1"])
    await k.wait_checkpoint(after=kmark)
    assert registered(k) == {RESOURCE: set(), "example.com/fpga": {"F-0", "F-1"}}


async def test_start_removes_sockets_or_every_file(
    dp_dir: str, pod_resources_socket: str, release: Release
) -> None:
    """CleanupPluginDirectory (manager.go), before the listen: up to 1.32 (os.Lstat) every entry but
    folders and the checkpoint goes, regular files and links too; from 1.33 (os.Stat) sockets only,
    and a dangling link, which cannot be stat'ed, stays (docs/kubelet-releases.md)."""
    os.mkdir(os.path.join(dp_dir, "sub"))
    with open(os.path.join(dp_dir, "notes.txt"), "w"):
        pass
    os.symlink("nowhere", os.path.join(dp_dir, "dangling"))
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(os.path.join(dp_dir, "stale.sock"))
    stale.close()
    async with RealKubelet(dp_dir, pod_resources_socket, release=release):
        left = sorted(os.listdir(dp_dir))
    if minor(release) < 33:
        assert left == ["kubelet.sock", "sub"]
    else:
        assert left == ["dangling", "kubelet.sock", "notes.txt", "sub"]


async def test_start_over_a_regular_file_named_kubelet_sock(
    dp_dir: str, pod_resources_socket: str, release: Release
) -> None:
    """A kubelet.sock that is a regular file: up to 1.32 the start's cleanup removes it and the listen
    succeeds; from 1.33 the cleanup keeps it (not a socket) and the listen fails: no device manager."""
    path = os.path.join(dp_dir, "kubelet.sock")
    with open(path, "w"):
        pass
    k = RealKubelet(dp_dir, pod_resources_socket, release=release)
    try:
        if minor(release) < 33:
            await k.start()
            assert stat.S_ISSOCK(os.lstat(path).st_mode)
        else:
            with pytest.raises(FixtureError):
                await k.start(timeout=10)
            assert stat.S_ISREG(os.lstat(path).st_mode)
            assert "listen" in str(k.process.find("start-failed")[-1].get("error"))
    finally:
        await k.close()
