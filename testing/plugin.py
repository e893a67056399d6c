"""FakeDevicePlugin: a device plugin that behaves like HAMi's, with faults switchable at run time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc

from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.rpc import (
    API_VERSION,
    DEVICE_PLUGIN,
    REGISTRATION,
    unary,
    unix_target,
)
from sidecar.tasks import TaskSet
from sidecar.watcher import FolderWatcher, FsEvent
from testing.front import SocketFront
from testing.grpcserve import service_handler
from testing.kubelet import KUBELET_SOCKET

logger = logging.getLogger(__name__)

# A channel of its own (as sidecar.rpc.insecure_channel), retrying a refused connect soon.
_DIAL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# HAMi's deviceSplitCount default (charts/hami/values.yaml: devicePlugin.deviceSplitCount).
HAMI_SPLIT_COUNT = 10


def hami_device_ids(uuids: Iterable[str], split: int = HAMI_SPLIT_COUNT) -> list[str]:
    """The device IDs HAMi advertises for physical GPUs: `<GPU-UUID>-<n>`, n = 0..split-1, each GPU in turn
    (GetPluginDevices, pkg/device-plugin/nvidiadevice/nvinternal/rm/devices.go in Project-HAMi/HAMi).
    MIG devices keep their own IDs (HAMi decides by the first ID containing "MIG")."""
    ids = list(uuids)
    if ids and "MIG" in ids[0]:
        return ids
    return [f"{u}-{n}" for u in ids for n in range(split)]


class FakeDevicePlugin:
    """Serves `DevicePlugin` on its socket, then registers; registers again when `kubelet.sock` is created.

    Fault switches (attributes, effective at once):
    `register_enabled`, `hung`, `answer_delay`, `options_error`, `api_version`,
    `register_resource_name`, `get_preferred_allocation`; methods `set_devices`, `set_health`, `crash`.
    `numa` maps a device ID to its NUMA nodes, sent in `Device.topology` (a device not in it has no
    topology; an empty list sends an empty topology, which the kubelet's pod-resources then leaves out).
    """

    def __init__(
        self,
        device_plugin_dir: str,
        resource: str = "nvidia.com/gpu",
        socket_name: str = "nvidia-gpu.sock",
        devices: Iterable[str] = ("GPU-0", "GPU-1"),
        *,
        kubelet_socket: str = KUBELET_SOCKET,
        register_timeout: float = 30.0,
        retry_interval: float = 30.0,
        numa: Mapping[str, Sequence[int]] | None = None,
        dial_timeout: float = 5.0,
    ) -> None:
        self.dir = device_plugin_dir
        self.resource = resource
        self.socket_name = socket_name
        self.socket_path = os.path.join(device_plugin_dir, socket_name)
        self.kubelet_socket = os.path.join(device_plugin_dir, kubelet_socket)
        self.register_timeout = register_timeout
        # HAMi dials kubelet.sock blocking for up to 5 s before Register (plugin.dial(kubeletSocket,
        # 5*time.Second) in nvinternal/plugin/server.go Register): kubelet.sock can exist before it listens.
        self.dial_timeout = dial_timeout
        self.retry_interval = retry_interval  # HAMi and NVIDIA retry a failed Register after 30 s
        # HAMi's failed start: a refused Register stops the plugin (its socket goes) and the whole start
        # (serve, Register) is tried again `retry_interval` later; False: Register alone is retried.
        self.stop_on_register_failure = False
        # Go's net.Listen binds the socket file, then listens: the gap between the two, in seconds (the
        # file's creation event comes before anything listens on it).
        self.listen_delay = 0.0
        self._devices: dict[str, str] = dict.fromkeys(devices, "Healthy")
        self.numa: dict[str, list[int]] = {d: list(n) for d, n in (numa or {}).items()}
        # Fault switches.
        self.register_enabled = True
        self.answer_delay = 0.0
        self.options_error: str | None = None
        self.api_version = API_VERSION
        self.register_resource_name = resource
        self.get_preferred_allocation = True  # GetDevicePluginOptions offers GetPreferredAllocation
        self._hung = False
        # What happened.
        self.calls: Counter[str] = Counter()
        self.register_attempts = 0  # Register calls made
        self.registrations = 0  # Register calls the kubelet accepted
        self.last_register_error: str | None = None
        self._private = tempfile.mkdtemp(prefix="fake-plugin-")
        self._server: grpc.aio.Server | None = None
        self._front: SocketFront | None = None
        # Open ListAndWatch streams in the order they opened: False pushes the devices, True ends it.
        self._streams: dict[int, asyncio.Queue[bool]] = {}
        self._next_stream = 0
        self._watcher: FolderWatcher | None = None
        self._tasks = TaskSet()
        self._retry: asyncio.TimerHandle | None = None
        self._serial = 0

    # -- faults ---------------------------------------------------------------
    @property
    def hung(self) -> bool:
        return self._front is not None and self._front.hung

    @hung.setter
    def hung(self, value: bool) -> None:
        """Accepts connections and never answers a frame (a deadlocked process)."""
        self._hung = value
        if self._front is not None:
            self._front.hung = value

    @property
    def devices(self) -> dict[str, str]:
        """Device ID -> health, as the next ListAndWatch answer sends them."""
        return dict(self._devices)

    def set_devices(self, devices: Iterable[str], numa: Mapping[str, Sequence[int]] | None = None) -> None:
        """Replace the devices (all healthy), pushed on every open stream; `numa` replaces the topology."""
        self._devices = dict.fromkeys(devices, "Healthy")
        if numa is not None:
            self.numa = {d: list(n) for d, n in numa.items()}
        self._notify()

    def set_health(self, device: str, healthy: bool) -> None:
        self._devices[device] = "Healthy" if healthy else "Unhealthy"
        self._notify()

    async def crash(self, remove_socket: bool = True) -> None:
        """The process dies: nothing serves; its socket is removed (or left as a dead file)."""
        await self._stop_serving(unlink=remove_socket)

    # -- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        """Serve first, then register (the kubelet dials back during Register)."""
        loop = asyncio.get_running_loop()
        self._watcher = FolderWatcher(self.dir, self._on_event, loop, polling_interval=0.05)
        self._watcher.start()
        await self._serve()
        await self.register()

    async def restart(self) -> None:
        """What HAMi does when `kubelet.sock` is created: restart the server, register again."""
        if self._retry is not None:
            self._retry.cancel()  # HAMi's restart replaces a failed start's pending retry
            self._retry = None
        await self._stop_serving(unlink=True)
        await self._serve()
        await self.register()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._retry is not None:
            self._retry.cancel()
        await self._tasks.cancel()
        await self._stop_serving(unlink=True)
        shutil.rmtree(self._private, ignore_errors=True)

    async def __aenter__(self) -> FakeDevicePlugin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def serving(self) -> bool:
        return self._front is not None

    async def _serve(self) -> None:
        self._serial += 1
        backend = os.path.join(self._private, f"plugin-{self._serial}.sock")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                service_handler(
                    DEVICE_PLUGIN,
                    {
                        "GetDevicePluginOptions": self._options,
                        "GetPreferredAllocation": self._preferred,
                        "Allocate": self._allocate,
                        "PreStartContainer": self._prestart,
                    },
                    {"ListAndWatch": self._list_and_watch},
                )
            ]
        )
        server.add_insecure_port(unix_target(backend))
        await server.start()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        front = SocketFront(self.socket_path, backend, self.listen_delay)
        await front.start()
        front.hung = self._hung
        self._server, self._front = server, front

    async def _stop_serving(self, unlink: bool) -> None:
        if self._front is not None:
            await self._front.close(unlink=unlink)
            self._front = None
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    # -- registration -------------------------------------------------------------
    async def register(self) -> bool:
        """One Register call to the kubelet; on failure, retry after `retry_interval` like HAMi."""
        if not self.register_enabled:
            return False
        request = dp.RegisterRequest(
            version=self.api_version,
            endpoint=self.socket_name,
            resource_name=self.register_resource_name,
            options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        self.register_attempts += 1
        channel = grpc.aio.insecure_channel(unix_target(self.kubelet_socket), options=_DIAL_OPTIONS)
        try:
            async with asyncio.timeout(self.dial_timeout):
                await channel.channel_ready()
            await unary(channel, REGISTRATION, "Register", dp.Empty)(request, timeout=self.register_timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            if isinstance(e, grpc.aio.AioRpcError):
                self.last_register_error = e.details() or e.code().name
            else:
                self.last_register_error = "context deadline exceeded"  # grpc-go's blocking dial
            logger.info("Could not register device plugin: %s", self.last_register_error)
            self._schedule_retry()
            return False
        finally:
            await channel.close()
        self.registrations += 1
        self.last_register_error = None
        return True

    def _schedule_retry(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        loop = asyncio.get_running_loop()
        if self.stop_on_register_failure:
            self._tasks.spawn(self._stop_serving(unlink=True))
            self._retry = loop.call_later(self.retry_interval, lambda: self._tasks.spawn(self.restart()))
        else:
            self._retry = loop.call_later(self.retry_interval, lambda: self._tasks.spawn(self.register()))

    def _on_event(self, event: FsEvent) -> None:
        if event.kind == "created" and event.name == os.path.basename(self.kubelet_socket) and self.serving:
            self._tasks.spawn(self.restart())

    # -- DevicePlugin ---------------------------------------------------------------
    async def _answer(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls[method] += 1
        if self.answer_delay:
            await asyncio.sleep(self.answer_delay)

    async def _options(
        self, _req: dp.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.DevicePluginOptions:
        await self._answer("GetDevicePluginOptions", context)
        if self.options_error is not None:
            await context.abort(grpc.StatusCode.INTERNAL, self.options_error)
        return dp.DevicePluginOptions(get_preferred_allocation_available=self.get_preferred_allocation)

    async def _list_and_watch(
        self, _req: dp.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        await self._answer("ListAndWatch", context)
        changed: asyncio.Queue[bool] = asyncio.Queue()
        stream, self._next_stream = self._next_stream, self._next_stream + 1
        self._streams[stream] = changed
        try:
            while True:
                yield dp.ListAndWatchResponse(devices=[self._device(d, h) for d, h in self._devices.items()])
                if await changed.get():
                    return  # the plugin ends the stream: the call completes, the connection stays
        finally:
            self._streams.pop(stream, None)

    def _device(self, device: str, health: str) -> dp.Device:
        if device not in self.numa:
            return dp.Device(ID=device, health=health)
        nodes = [dp.NUMANode(ID=n) for n in self.numa[device]]
        return dp.Device(ID=device, health=health, topology=dp.TopologyInfo(nodes=nodes))

    def _notify(self) -> None:
        for q in self._streams.values():
            q.put_nowait(False)

    @property
    def streams_open(self) -> int:
        """ListAndWatch streams open on this plugin's server, as the plugin sees them."""
        return len(self._streams)

    def end_stream(self, which: str = "oldest") -> None:
        """End the oldest (or newest) open ListAndWatch stream while the server keeps serving."""
        if not self._streams:
            raise RuntimeError("no open stream")
        order = sorted(self._streams)
        self._streams.pop(order[0] if which == "oldest" else order[-1]).put_nowait(True)

    async def _preferred(
        self, req: dp.PreferredAllocationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.PreferredAllocationResponse:
        await self._answer("GetPreferredAllocation", context)
        answers = []
        for c in req.container_requests:
            # The devices it must include, then the lowest IDs (the kubelet sends an unsorted set).
            must = list(dict.fromkeys(c.must_include_deviceIDs))
            rest = sorted(set(c.available_deviceIDs) - set(must))
            answers.append(
                dp.ContainerPreferredAllocationResponse(deviceIDs=(must + rest)[: c.allocation_size])
            )
        return dp.PreferredAllocationResponse(container_responses=answers)

    async def _allocate(
        self, req: dp.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.AllocateResponse:
        await self._answer("Allocate", context)
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(c.devices_ids)})
                for c in req.container_requests
            ]
        )

    async def _prestart(
        self, _req: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.PreStartContainerResponse:
        await self._answer("PreStartContainer", context)
        return dp.PreStartContainerResponse()
