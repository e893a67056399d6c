"""FakeKubelet: the kubelet's device manager, as KUBELET-FACTS.md sections 3 and 4 describe it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections import Counter
from typing import Any

import grpc

from sidecar.checkpoint import CHECKPOINT_NAME, CheckpointError, read_checkpoint
from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import (
    API_VERSION,
    DEVICE_PLUGIN,
    POD_RESOURCES,
    REGISTRATION,
    insecure_channel,
    unary,
    unix_target,
)
from sidecar.testing.checkpointfile import write_checkpoint
from sidecar.testing.front import SocketFront
from sidecar.testing.grpcserve import GoStyleUnimplemented, server_stream, service_handler

logger = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
# The kubelet's own wording (pkg/kubelet/cm/devicemanager): tests and hami-doctor match on it.
ERR_UNSUPPORTED_VERSION = (
    'requested API version "{}" is not supported by kubelet. Supported versions are ["v1beta1"]'
)
ERR_INVALID_RESOURCE_NAME = 'the ResourceName "{}" is invalid'
ERR_DIAL = "failed to dial device plugin: {}"
ERR_OPTIONS = "failed to get device plugin options: {}"

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """Kubernetes' IsExtendedResourceName: `domain/name`, outside `kubernetes.io/`, not `requests.`."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, local = name.partition("/")
    return (
        "/" not in local
        and 0 < len(prefix) <= 253
        and bool(_DNS_SUBDOMAIN.match(prefix))
        and 0 < len(local) <= 63
        and bool(_QUALIFIED_NAME.match(local))
    )


def go_status(e: grpc.aio.AioRpcError) -> str:
    """A grpc-go style error text: `rpc error: code = DeadlineExceeded desc = ...`."""
    code = "".join(w.capitalize() for w in e.code().name.split("_"))
    return f"rpc error: code = {code} desc = {e.details()}"


class FakeKubelet:
    """Serves `Registration` on `kubelet.sock` and dials back every plugin that registers.

    State lives in memory like the kubelet's; only the checkpoint survives `restart()`.
    """

    def __init__(
        self,
        device_plugin_dir: str,
        pod_resources_socket: str | None = None,
        *,
        dial_timeout: float = 10.0,
        socket_name: str = KUBELET_SOCKET,
    ) -> None:
        self.dir = device_plugin_dir
        self.socket_path = os.path.join(device_plugin_dir, socket_name)
        self.checkpoint_path = os.path.join(device_plugin_dir, CHECKPOINT_NAME)
        self.pod_resources_socket = pod_resources_socket
        self.dial_timeout = dial_timeout
        self.register_calls: Counter[str] = Counter()  # kubelet_device_plugin_registration_total
        self.restarts = 0
        self._devices: dict[str, dict[str, bool]] = {}  # resource -> device ID -> healthy
        self._clients: dict[str, tuple[grpc.aio.Channel, asyncio.Task[None]]] = {}
        self._private = tempfile.mkdtemp(prefix="fake-kubelet-")
        self._server: grpc.aio.Server | None = None
        self._front: SocketFront | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._running = False

    # -- what a test reads -------------------------------------------------
    @property
    def running(self) -> bool:
        return self._running

    def healthy_devices(self, resource: str) -> list[str]:
        return sorted(d for d, ok in self._devices.get(resource, {}).items() if ok)

    def resources(self) -> list[str]:
        return sorted(self._devices)

    def connected(self, resource: str) -> bool:
        """The kubelet holds an open ListAndWatch stream for the resource."""
        client = self._clients.get(resource)
        return client is not None and not client[1].done()

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """The kubelet's start: clean the folder, reload the checkpoint, then listen."""
        os.makedirs(self.dir, mode=0o750, exist_ok=True)
        self._remove_sockets()
        self._devices = {}
        with contextlib.suppress(CheckpointError):
            # A restarted kubelet keeps each resource as a stopped endpoint with no devices.
            self._devices = {r: {} for r in read_checkpoint(self.checkpoint_path).registered}
        self._write_checkpoint()
        backend = os.path.join(self._private, "registration.sock")
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers(
            [
                service_handler(REGISTRATION, {"Register": self._register}),
                GoStyleUnimplemented({REGISTRATION.full_name: REGISTRATION}),
            ]
        )
        self._server.add_insecure_port(unix_target(backend))
        await self._server.start()
        self._front = SocketFront(self.socket_path, backend)
        await self._front.start()
        if self.pod_resources_socket and self._pr_server is None:
            await self._start_pod_resources(self.pod_resources_socket)
        self._running = True

    async def stop(self, unlink_socket: bool = False) -> None:
        """Stop like a killed kubelet: `kubelet.sock` stays behind as a dead file unless unlinked."""
        self._running = False
        if self._front is not None:
            await self._front.close(unlink=unlink_socket)
            self._front = None
        for resource in list(self._clients):
            await self._disconnect(resource)
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def restart(self, unlink_socket: bool = False) -> None:
        await self.stop(unlink_socket=unlink_socket)
        self.restarts += 1
        await self.start()

    async def close(self) -> None:
        await self.stop(unlink_socket=True)
        if self._pr_server is not None:
            await self._pr_server.stop(None)
            self._pr_server = None
        shutil.rmtree(self._private, ignore_errors=True)

    async def __aenter__(self) -> FakeKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- Registration ----------------------------------------------------------
    async def _register(
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.Empty:
        name = request.resource_name
        self.register_calls[name] += 1
        logger.info('"Got registration request from device plugin with resource" resourceName="%s"', name)
        if request.version != API_VERSION:
            await self._reject(context, ERR_UNSUPPORTED_VERSION.format(request.version), name)
        if not is_extended_resource_name(name):
            await self._reject(context, ERR_INVALID_RESOURCE_NAME.format(name), name)
        error = await self._connect(name, os.path.join(self.dir, request.endpoint))
        if error:
            logger.info('"Error connecting to device plugin client" err="%s"', error)
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return dp.Empty()

    async def _reject(self, context: grpc.aio.ServicerContext[Any, Any], error: str, name: str) -> None:
        logger.info('"Bad registration request from device plugin" resourceName="%s" err="%s"', name, error)
        await context.abort(grpc.StatusCode.UNKNOWN, error)

    async def _connect(self, resource: str, endpoint: str) -> str | None:
        """Since 1.25 Register is synchronous: dial, GetDevicePluginOptions, then ListAndWatch."""
        await self._disconnect(resource)
        channel = insecure_channel(endpoint)
        try:
            async with asyncio.timeout(self.dial_timeout):
                await channel.channel_ready()
        except TimeoutError:
            await channel.close()
            return ERR_DIAL.format("context deadline exceeded")
        try:
            await unary(channel, DEVICE_PLUGIN, "GetDevicePluginOptions", dp.DevicePluginOptions)(dp.Empty())
        except grpc.aio.AioRpcError as e:
            await channel.close()
            return ERR_OPTIONS.format(go_status(e))
        self._devices.setdefault(resource, {})
        task = asyncio.get_running_loop().create_task(self._list_and_watch(resource, channel))
        self._clients[resource] = (channel, task)
        return None

    async def _list_and_watch(self, resource: str, channel: grpc.aio.Channel) -> None:
        stream = server_stream(channel, DEVICE_PLUGIN, "ListAndWatch", dp.ListAndWatchResponse)(dp.Empty())
        try:
            async for update in stream:
                self._devices[resource] = {d.ID: d.health == "Healthy" for d in update.devices}
                self._write_checkpoint()
        except grpc.aio.AioRpcError as e:
            logger.info(
                '"ListAndWatch ended unexpectedly for device plugin" resource="%s" err="%s"', resource, e
            )
        finally:
            # The kubelet marks every device of the resource unhealthy; capacity stays.
            self._devices[resource] = dict.fromkeys(self._devices.get(resource, {}), False)

    async def _disconnect(self, resource: str) -> None:
        client = self._clients.pop(resource, None)
        if client is not None:
            channel, task = client
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await channel.close()

    # -- files -------------------------------------------------------------------
    def _remove_sockets(self) -> None:
        """Delete the sockets in the folder, in the order a directory walk finds them."""
        for entry in os.scandir(self.dir):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)

    def _write_checkpoint(self) -> None:
        write_checkpoint(
            self.checkpoint_path,
            {r: sorted(d for d, ok in devs.items() if ok) for r, devs in self._devices.items()},
        )

    # -- pod-resources -------------------------------------------------------------
    async def _start_pod_resources(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                service_handler(
                    POD_RESOURCES,
                    {
                        "GetAllocatableResources": self._allocatable,
                        "List": self._list_pods,
                        "Get": self._get_pod,
                    },
                )
            ]
        )
        server.add_insecure_port(unix_target(path))
        await server.start()
        self._pr_server = server

    async def _allocatable(
        self, _request: pr.AllocatableResourcesRequest, _context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.AllocatableResourcesResponse:
        return pr.AllocatableResourcesResponse(
            devices=[
                pr.ContainerDevices(resource_name=r, device_ids=self.healthy_devices(r))
                for r in self.resources()
                if self.healthy_devices(r)
            ]
        )

    async def _list_pods(
        self, _request: pr.ListPodResourcesRequest, _context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse()

    async def _get_pod(
        self, request: pr.GetPodResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.GetPodResourcesResponse:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found"
        )
