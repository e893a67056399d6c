"""Each kubelet fact the simulator emulates (docs/kubelet.md), one test each."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time

import grpc
import pytest

from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import DEVICE_PLUGIN, POD_RESOURCES, REGISTRATION, insecure_channel, unary
from sidecar.testing import (
    ERR_INVALID_RESOURCE_NAME,
    ERR_UNSUPPORTED_VERSION,
    FakeDevicePlugin,
    FakeKubelet,
    is_extended_resource_name,
)
from sidecar.watcher import FolderWatcher, FsEvent
from tests.conftest import wait_for

GPU = "nvidia.com/gpu"


def read_json(path: str) -> dict[str, object]:
    with open(path) as f:
        doc: dict[str, object] = json.load(f)
    return doc


def registered(kubelet: FakeKubelet) -> dict[str, list[str]]:
    data = read_json(kubelet.checkpoint_path)["Data"]
    assert isinstance(data, dict)
    result: dict[str, list[str]] = data["RegisteredDevices"]
    return result


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
    assert plugin.registrations == 1
    assert registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}
    assert kubelet.connected(GPU)
    assert plugin.calls["GetDevicePluginOptions"] == 1  # the kubelet's synchronous dial-back
    assert plugin.calls["ListAndWatch"] == 1


async def test_wrong_version_rejected_with_the_kubelets_wording(kubelet: FakeKubelet) -> None:
    err = await register(kubelet, dp.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=GPU))
    assert err is not None
    assert (
        err.details()
        == 'requested API version "v1alpha" is not supported by kubelet. Supported versions are ["v1beta1"]'
    )
    assert err.details() == ERR_UNSUPPORTED_VERSION.format("v1alpha")


@pytest.mark.parametrize(
    "name", ["gpu", "kubernetes.io/gpu", "requests.nvidia.com/gpu", "nvidia.com/", "Nvidia_com/gpu"]
)
async def test_invalid_resource_name_rejected_with_the_kubelets_wording(
    kubelet: FakeKubelet, name: str
) -> None:
    err = await register(
        kubelet, dp.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name=name)
    )
    assert err is not None
    assert err.details() == f'the ResourceName "{name}" is invalid' == ERR_INVALID_RESOURCE_NAME.format(name)


def test_extended_resource_names_follow_kubernetes() -> None:
    assert is_extended_resource_name("nvidia.com/gpu")
    assert is_extended_resource_name("huawei.com/Ascend910B3")
    assert not is_extended_resource_name("cpu")
    assert not is_extended_resource_name("foo.kubernetes.io/gpu")
    assert not is_extended_resource_name("nvidia.com/gpu/extra")
    assert not is_extended_resource_name("nvidia.com/" + "g" * 64)


async def test_register_calls_are_counted_even_when_rejected(kubelet: FakeKubelet) -> None:
    await register(kubelet, dp.RegisterRequest(version="v0", endpoint="x.sock", resource_name=GPU))
    await register(kubelet, dp.RegisterRequest(version="v1beta1", endpoint="missing.sock", resource_name=GPU))
    assert kubelet.register_calls[GPU] == 2


async def test_register_is_synchronous_and_fails_when_the_plugin_does_not_serve(kubelet: FakeKubelet) -> None:
    err = await register(
        kubelet, dp.RegisterRequest(version="v1beta1", endpoint="nothing.sock", resource_name=GPU)
    )
    assert err is not None
    assert err.details() == "failed to dial device plugin: context deadline exceeded"


async def test_hung_plugin_makes_register_fail_after_the_dial_timeout(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    plugin.hung = True
    started = time.monotonic()
    assert not await plugin.register()
    elapsed = time.monotonic() - started
    assert plugin.last_register_error == "failed to dial device plugin: context deadline exceeded"
    assert elapsed >= kubelet.dial_timeout  # it waited the dial timeout; upper bounds belong to bench/


async def test_options_error_fails_register_with_the_kubelets_wording(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    plugin.options_error = "device enumeration failed"
    assert not await plugin.register()
    assert plugin.last_register_error == (
        "failed to get device plugin options: rpc error: code = Internal desc = device enumeration failed"
    )


async def test_plugin_serves_before_registering(kubelet: FakeKubelet, dp_dir: str) -> None:
    plugin = FakeDevicePlugin(dp_dir, register_timeout=5)
    try:
        await plugin.start()
        assert plugin.registrations == 1 and plugin.last_register_error is None
    finally:
        await plugin.close()


async def test_each_listandwatch_update_rewrites_the_checkpoint_atomically(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin, dp_dir: str
) -> None:
    before = os.stat(kubelet.checkpoint_path)
    plugin.set_health("GPU-1", healthy=False)
    await wait_for(lambda: registered(kubelet) == {GPU: ["GPU-0"]})
    after = os.stat(kubelet.checkpoint_path)
    assert after.st_ino != before.st_ino  # written elsewhere, then renamed over
    assert not [n for n in os.listdir(dp_dir) if n.startswith(".")]  # no temporary file left
    doc = read_json(kubelet.checkpoint_path)
    assert set(doc) == {"Data", "Checksum"} and isinstance(doc["Checksum"], int)


async def test_zero_devices_are_recorded_as_none(kubelet: FakeKubelet, plugin: FakeDevicePlugin) -> None:
    plugin.set_devices([])
    await wait_for(lambda: registered(kubelet) == {GPU: []})


async def test_stream_end_marks_the_resources_devices_unhealthy(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    await plugin.crash()
    await wait_for(lambda: not kubelet.connected(GPU))
    assert kubelet.healthy_devices(GPU) == []
    assert GPU in kubelet.resources()  # capacity stays, allocatable drops


async def test_restart_deletes_sockets_but_not_the_checkpoint_nor_subfolders(
    kubelet: FakeKubelet, dp_dir: str
) -> None:
    plugin = FakeDevicePlugin(dp_dir, register_timeout=5)
    plugin.register_enabled = False
    await plugin.start()
    try:
        os.mkdir(os.path.join(dp_dir, "DEPRECATION"))
        seen: list[FsEvent] = []
        watcher = FolderWatcher(dp_dir, seen.append, asyncio.get_running_loop(), mode="inotify")
        assert watcher.start()
        await kubelet.restart()
        assert not os.path.exists(plugin.socket_path)
        assert os.path.isdir(os.path.join(dp_dir, "DEPRECATION"))
        assert os.path.isfile(kubelet.checkpoint_path)
        assert stat.S_ISSOCK(os.stat(kubelet.socket_path).st_mode)
        # kubelet.sock is a new file (its inode number may be reused, so events tell, not st_ino).
        await wait_for(lambda: FsEvent("created", "kubelet.sock") in seen)
        assert seen.index(FsEvent("deleted", "kubelet.sock")) < seen.index(FsEvent("created", "kubelet.sock"))
        assert FsEvent("deleted", "nvidia-gpu.sock") in seen
        assert FsEvent("deleted", "kubelet_internal_checkpoint") not in seen
        watcher.stop()
    finally:
        await plugin.close()


async def test_restart_keeps_the_checkpoints_resource_with_no_devices(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    plugin.register_enabled = False
    await kubelet.restart()
    assert registered(kubelet) == {GPU: []}
    await reacted_to_the_restart(plugin)
    assert registered(kubelet) == {GPU: []}
    assert kubelet.register_calls[GPU] == 1


async def test_plugin_registers_again_by_itself_after_a_kubelet_restart(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    await kubelet.restart()
    await wait_for(lambda: registered(kubelet) == {GPU: ["GPU-0", "GPU-1"]}, what="re-registration")
    assert kubelet.register_calls[GPU] == 2
    assert plugin.registrations == 2
    assert os.path.exists(plugin.socket_path)


async def test_stopped_kubelet_leaves_a_dead_socket_file(kubelet: FakeKubelet) -> None:
    inode = os.stat(kubelet.socket_path).st_ino
    await kubelet.stop()
    assert os.stat(kubelet.socket_path).st_ino == inode
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(ConnectionRefusedError):
        s.connect(kubelet.socket_path)
    await kubelet.start()


async def test_unknown_method_and_unknown_service_answer_with_grpc_go_wording(kubelet: FakeKubelet) -> None:
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


async def test_pod_resources_lists_allocatable_devices(
    kubelet: FakeKubelet, plugin: FakeDevicePlugin
) -> None:
    assert kubelet.pod_resources_socket
    async with insecure_channel(kubelet.pod_resources_socket) as channel:
        call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
        answer = await call(pr.AllocatableResourcesRequest(), timeout=2)
    assert [(d.resource_name, list(d.device_ids)) for d in answer.devices] == [(GPU, ["GPU-0", "GPU-1"])]


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
