"""FakeKubelet: the kubelet's device manager, written after its code (pkg/kubelet/cm/devicemanager).

Each behaviour names the kubernetes source it follows; tests/test_simulator.py holds one test per fact.
The structure follows the kubelet's: a registration server holding *clients* (one gRPC connection and
one `ListAndWatch` stream per registered plugin, plugin/v1beta1/{server,handler,client}.go) and a
manager holding *endpoints*, the device sets and the pod devices (manager.go, endpoint.go).
Where kubernetes changed behaviour, the default is the current release (v1.37, after PR 135437);
`reregister_race=True` runs the older code path of kubernetes issue 121994.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
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
from testing.checkpointfile import write_checkpoint
from testing.front import SocketFront
from testing.grpcserve import GoStyleUnimplemented, server_stream, service_handler

logger = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
# The folder a real kubelet uses whatever its --root-dir (pkg/kubelet/apis/deviceplugin/v1beta1/constants.go
# in k8s.io/kubelet: DevicePluginPath). The simulator refuses to run there.
REAL_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
SUPPORTED_VERSIONS = (API_VERSION,)  # k8s.io/kubelet deviceplugin/v1beta1 constants.go: SupportedVersions
# endpointStopGracePeriod (pkg/kubelet/cm/devicemanager/types.go): a stopped endpoint's resource
# leaves the node's capacity this long after its plugin disconnected (or the kubelet started).
STOP_GRACE = 300.0
# The kubelet's node status loop calls GetCapacity every nodeStatusUpdateFrequency (10 s by default).
CAPACITY_INTERVAL = 10.0
NODE_WITHOUT_TOPOLOGY = -1  # nodeWithoutTopology (pkg/kubelet/cm/devicemanager/types.go)
# The PodResources server's rate limit (pkg/kubelet/apis/podresources/constants.go DefaultQPS,
# DefaultBurstTokens; pkg/kubelet/apis/grpc/ratelimit.go: a token bucket over every method).
POD_RESOURCES_QPS = 100.0
POD_RESOURCES_BURST = 10
ERR_RATE_LIMIT = "rejected by rate limit"

# The kubelet's own wording (pkg/kubelet/cm/devicemanager/plugin/v1beta1/api.go, handler.go, client.go,
# manager.go). The `{}` templates are exact for names Go's %q leaves alone; the simulator itself
# formats with go_quote, as fmt's %q does (see unsupported_version_error, invalid_resource_name_error).
ERR_UNSUPPORTED_VERSION = (
    'requested API version "{}" is not supported by kubelet. Supported version is ["v1beta1"]'
)
ERR_INVALID_RESOURCE_NAME = 'the ResourceName "{}" is invalid'
ERR_DIAL = "failed to dial device plugin: {}"
ERR_OPTIONS = "failed to get device plugin options: {}"
ERR_ALREADY_CONNECTED = "device plugin already connected: {}"

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GO_ESCAPES = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t", "\v": r"\v"}
# The simulator's checkpoint checksum: CRC-32 of the canonical JSON of `Data` (see checkpointfile.py).
# The kubelet's is FNV-32a over a Go dump of the struct; a real checkpoint matches this only by chance.


def go_quote(s: str) -> str:
    """Go's strconv.Quote (fmt's %q on a string)."""
    out = ['"']
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def unsupported_version_error(version: str) -> str:
    """errUnsupportedVersion: `requested API version %q is not supported by kubelet. Supported version is %q`
    formatted with the version and SupportedVersions (a Go array, so `["v1beta1"]`)."""
    supported = "[" + " ".join(go_quote(v) for v in SUPPORTED_VERSIONS) + "]"
    return (
        f"requested API version {go_quote(version)} is not supported by kubelet. "
        f"Supported version is {supported}"
    )


def invalid_resource_name_error(name: str) -> str:
    """errInvalidResourceName: `the ResourceName %q is invalid`."""
    return f"the ResourceName {go_quote(name)} is invalid"


def is_extended_resource_name(name: str) -> bool:
    """IsExtendedResourceName (pkg/apis/core/v1/helper/helpers.go): `domain/name`, no `kubernetes.io/`,
    no `requests.` prefix, and `requests.<name>` a qualified name."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, local = name.partition("/")
    quota_prefix = "requests." + prefix
    return (
        "/" not in local
        and len(quota_prefix) <= 253
        and bool(_DNS_SUBDOMAIN.match(quota_prefix))
        and 0 < len(local) <= 63
        and bool(_QUALIFIED_NAME.match(local))
    )


def go_status(e: grpc.aio.AioRpcError) -> str:
    """A grpc-go style error text: `rpc error: code = DeadlineExceeded desc = ...`."""
    code = "".join(w.capitalize() for w in e.code().name.split("_"))
    return f"rpc error: code = {code} desc = {e.details()}"


def _canonical(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def is_simulator_checkpoint(raw: bytes) -> bool:
    """The file carries the simulator's checksum (testing.checkpointfile), not a kubelet's."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(doc, dict) or "Data" not in doc:
        return False
    checksum = doc.get("Checksum")
    return isinstance(checksum, int) and checksum == zlib.crc32(_canonical(doc["Data"]))


def looks_like_kubelet_checkpoint(raw: bytes) -> bool:
    """A JSON object with `Data` and `Checksum`: what a kubelet's checkpoint manager writes."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and "Data" in doc and "Checksum" in doc


class RealKubeletFolderError(RuntimeError):
    """FakeKubelet will not run where a real kubelet keeps its state (pass force=True to insist)."""


class DeviceManagerError(Exception):
    """An error the kubelet's device manager returns (its wording), e.g. from Allocate."""


@dataclass(eq=False)
class _Endpoint:
    """endpointImpl (endpoint.go): one registered plugin, or a stopped one read from the checkpoint."""

    resource: str
    socket: str  # "" for a stopped endpoint made at start (newStoppedEndpointImpl)
    channel: grpc.aio.Channel | None
    options: dp.DevicePluginOptions | None
    stop_time: float | None = None


@dataclass(eq=False)
class _Client:
    """client (plugin/v1beta1/client.go): the kubelet's connection to one plugin and its stream."""

    resource: str
    socket: str
    channel: grpc.aio.Channel | None = None
    task: asyncio.Task[None] | None = None
    streaming: bool = False


@dataclass
class _Allocation:
    """deviceAllocateInfo (pod_devices.go): device IDs per NUMA node and the plugin's answer."""

    device_ids: dict[int, list[str]]
    alloc_resp: bytes


@dataclass
class _Pod:
    name: str
    namespace: str
    containers: list[str] = field(default_factory=list)


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
        stop_grace: float = STOP_GRACE,
        capacity_interval: float | None = CAPACITY_INTERVAL,
        reregister_race: bool = False,
        force: bool = False,
        pod_resources_qps: float | None = POD_RESOURCES_QPS,
        pod_resources_burst: int = POD_RESOURCES_BURST,
    ) -> None:
        self.dir = device_plugin_dir
        self.socket_path = os.path.join(device_plugin_dir, socket_name)
        self.checkpoint_path = os.path.join(device_plugin_dir, CHECKPOINT_NAME)
        self.pod_resources_socket = pod_resources_socket
        self.dial_timeout = dial_timeout
        self.stop_grace = stop_grace
        self.capacity_interval = capacity_interval
        self.reregister_race = reregister_race
        self.force = force
        self.pod_resources_qps = pod_resources_qps
        self.pod_resources_burst = pod_resources_burst
        self._tokens = float(pod_resources_burst)
        self._tokens_at = time.monotonic()
        self.register_calls: Counter[str] = Counter()  # kubelet_device_plugin_registration_total
        self.checkpoint_writes = 0
        self.restarts = 0
        self._private = tempfile.mkdtemp(prefix="fake-kubelet-")
        self._server: grpc.aio.Server | None = None
        self._front: SocketFront | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._running = False
        self._started_once = False
        self._reset()

    def _reset(self) -> None:
        """A new kubelet process: nothing in memory (NewManagerImpl, NewServer)."""
        # Registration server (plugin/v1beta1/server.go): resource -> clients. Before PR 135437 one client
        # per resource (a map of Client); since, a list told apart by socket path.
        self._clients: dict[str, list[_Client]] = {}
        self._streams: set[_Client] = set()  # every client whose run loop is alive, current or not
        self._leaked: list[grpc.aio.Channel] = []
        # Manager (manager.go).
        self._endpoints: dict[str, _Endpoint] = {}
        self._endpoint_store: dict[str, dict[str, _Endpoint]] = {}  # since PR 135437
        self._healthy: dict[str, set[str]] = {}
        self._unhealthy: dict[str, set[str]] = {}
        self._all: dict[str, dict[str, dp.Device]] = {}
        self._pod_devices: dict[str, dict[str, dict[str, _Allocation]]] = {}
        self._allocated: dict[str, set[str]] = {}
        self._pods: dict[str, _Pod] = {}

    # -- what a test reads -------------------------------------------------
    @property
    def running(self) -> bool:
        return self._running

    def healthy_devices(self, resource: str) -> list[str]:
        return sorted(self._healthy.get(resource, ()))

    def unhealthy_devices(self, resource: str) -> list[str]:
        return sorted(self._unhealthy.get(resource, ()))

    def resources(self) -> list[str]:
        """The resources the device manager knows (in the node's capacity until GetCapacity drops them)."""
        return sorted(set(self._healthy) | set(self._unhealthy))

    def connected(self, resource: str) -> bool:
        """The kubelet holds an open ListAndWatch stream for the resource."""
        return any(c.resource == resource and c.streaming for c in self._streams)

    def stopped(self, resource: str) -> bool:
        """The resource's endpoint is stopped (disconnected, or read from the checkpoint at start)."""
        e = self._endpoints.get(resource)
        return e is not None and e.stop_time is not None

    def streams(self, resource: str) -> int:
        """ListAndWatch streams the kubelet holds open for the resource (more than one only while an
        older registration's stream lingers)."""
        return sum(1 for c in self._streams if c.resource == resource and c.streaming)

    def stop_grace_expired(self, resource: str) -> bool:
        """The resource's endpoint is stopped and its stop grace ran out: the next GetCapacity drops it."""
        e = self._endpoints.get(resource)
        return e is not None and e.stop_time is not None and time.monotonic() - e.stop_time > self.stop_grace

    def capacity_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Capacity and allocatable as the device manager holds them now, without GetCapacity's expiry."""
        capacity = {r: len(d) for r, d in self._healthy.items()}
        allocatable = dict(capacity)
        for r, d in self._unhealthy.items():
            capacity[r] = capacity.get(r, 0) + len(d)
        return capacity, allocatable

    def pod_devices(self, pod_uid: str, container: str) -> dict[str, list[str]]:
        """The devices allocated to a container, per resource."""
        resources = self._pod_devices.get(pod_uid, {}).get(container, {})
        return {r: sorted({d for ids in a.device_ids.values() for d in ids}) for r, a in resources.items()}

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """The kubelet's start: NewManagerImpl's checkpoint store creates the folder (0755, util/store
        filestore.go NewFileStore); manager.go Start reads the checkpoint; plugin/v1beta1/server.go Start
        (MkdirAll 0750, a no-op by then) removes the sockets in it and listens. Nothing is written."""
        self._refuse_a_real_kubelets_folder()
        self._reset()
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        self._read_checkpoint()
        self._cleanup_plugin_directory()
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
        if self.pod_resources_socket:
            await self._start_pod_resources(self.pod_resources_socket)
        if self.capacity_interval is not None:
            self._ticker = asyncio.get_running_loop().create_task(self._capacity_loop(self.capacity_interval))
        self._running = True
        self._started_once = True

    async def stop(self, unlink_socket: bool = False) -> None:
        """Stop like a killed kubelet: `kubelet.sock` stays behind as a dead file unless unlinked (a
        graceful Stop unlinks it). The plugins' connections close; nothing is written."""
        self._running = False
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        if self._front is not None:
            await self._front.close(unlink=unlink_socket)
            self._front = None
        # server.Stop: disconnect every client; their run loops then find no client and return.
        for resource, clients in list(self._clients.items()):
            for c in list(clients):
                self._disconnect_client(resource, c)
        for c in list(self._streams):
            self._close_channel(c)
        for ch in self._leaked:
            await ch.close()
        self._leaked = []
        tasks = [c.task for c in self._streams if c.task is not None] + list(self._closing)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        if self._pr_server is not None:
            await self._pr_server.stop(None)  # grpcio unlinks its socket
            self._pr_server = None
            if not unlink_socket and self.pod_resources_socket:
                _dead_socket_file(self.pod_resources_socket)  # a killed kubelet leaves it, refusing

    async def restart(self, unlink_socket: bool = False) -> None:
        await self.stop(unlink_socket=unlink_socket)
        self.restarts += 1
        await self.start()

    async def close(self) -> None:
        await self.stop(unlink_socket=True)
        shutil.rmtree(self._private, ignore_errors=True)

    async def __aenter__(self) -> FakeKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _refuse_a_real_kubelets_folder(self) -> None:
        """The simulator's checkpoint would be taken as corrupt by a real kubelet, which then loses its
        pod-to-device assignments: never run in a real kubelet's folder."""
        if self.force:
            return
        if os.path.realpath(self.dir) == REAL_DEVICE_PLUGIN_DIR:
            raise RealKubeletFolderError(
                f"{self.dir} is the real kubelet's device-plugins folder; FakeKubelet would delete its "
                "sockets and overwrite its checkpoint (pass force=True to insist)"
            )
        if self._started_once:
            return  # a restart: the folder is the simulator's; a foreign checkpoint now is a test's doing
        try:
            with open(self.checkpoint_path, "rb") as f:
                raw = f.read()
        except OSError:
            return
        if looks_like_kubelet_checkpoint(raw) and not is_simulator_checkpoint(raw):
            raise RealKubeletFolderError(
                f"{self.checkpoint_path} was written by a real kubelet (its checksum is not the "
                "simulator's); FakeKubelet would overwrite it (pass force=True to insist)"
            )

    # -- Registration (plugin/v1beta1/server.go, handler.go, client.go) ----------
    async def _register(
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.Empty:
        name = request.resource_name
        self.register_calls[name] += 1
        logger.info('"Got registration request from device plugin with resource" resourceName="%s"', name)
        if request.version not in SUPPORTED_VERSIONS:
            error = unsupported_version_error(request.version)
            logger.info(
                '"Bad registration request from device plugin with resource" resourceName="%s" err="%s"',
                name,
                error,
            )
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        if not is_extended_resource_name(name):
            error = invalid_resource_name_error(name)
            logger.info('"Bad registration request from device plugin" err="%s"', error)
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        # filepath.Join(socketDir, endpoint): the endpoint is not validated, only joined and cleaned.
        socket = os.path.normpath(self.dir + "/" + request.endpoint)
        failure = await self._connect_client(name, socket)
        if failure:
            logger.info('"Error connecting to device plugin client" err="%s"', failure)
            await context.abort(grpc.StatusCode.UNKNOWN, failure)
        return dp.Empty()

    async def _connect_client(self, name: str, socket: str) -> str | None:
        """connectClient (handler.go): register the client, Connect (dial, PluginConnected), then run it.

        Since 1.25 this is synchronous within Register, so a plugin must serve before registering."""
        c = _Client(name, socket)
        self._register_client(name, c)
        try:
            error = await self._client_connect(c)
        except asyncio.CancelledError:  # the plugin gave up on Register: Go's ctx is cancelled
            self._deregister_client(name, socket)
            raise
        if error:
            self._deregister_client(name, socket)
            return error
        c.task = asyncio.get_running_loop().create_task(self._run_client(name, c))
        c.streaming = True
        self._streams.add(c)
        return None

    def _register_client(self, name: str, c: _Client) -> None:
        if self.reregister_race:
            self._clients[name] = [c]  # s.clients[name] = c: the old client is replaced, not stopped
        else:
            self._clients.setdefault(name, []).append(c)

    def _deregister_client(self, name: str, socket: str) -> None:
        if self.reregister_race:
            self._clients.pop(name, None)  # delete(s.clients, name): whatever client is there
            return
        kept = [c for c in self._clients.get(name, []) if c.socket != socket]
        if kept:
            self._clients[name] = kept
        else:
            self._clients.pop(name, None)

    def _get_client(self, name: str, socket: str) -> _Client | None:
        clients = self._clients.get(name, [])
        if self.reregister_race:
            return clients[0] if clients else None  # s.clients[name]: by resource name only
        return next((c for c in clients if c.socket == socket), None)

    async def _client_connect(self, c: _Client) -> str | None:
        """client.Connect: a blocking dial (10 s), then the manager's PluginConnected."""
        channel = insecure_channel(c.socket)
        try:
            async with asyncio.timeout(self.dial_timeout):
                await channel.channel_ready()
        except TimeoutError:
            await channel.close()
            logger.info('"Unable to connect to device plugin client with socket path" path="%s"', c.socket)
            return ERR_DIAL.format("context deadline exceeded")
        c.channel = channel
        return await self._plugin_connected(c)

    async def _plugin_connected(self, c: _Client) -> str | None:
        """PluginConnected (manager.go): GetDevicePluginOptions, then the endpoint replaces the resource's.

        When it fails, nobody closes the connection the dial opened: it stays open to the plugin."""
        assert c.channel is not None
        try:
            options = await unary(c.channel, DEVICE_PLUGIN, "GetDevicePluginOptions", dp.DevicePluginOptions)(
                dp.Empty()
            )
        except grpc.aio.AioRpcError as err:
            self._leak(c)
            return ERR_OPTIONS.format(go_status(err))
        endpoint = _Endpoint(c.resource, c.socket, c.channel, options)
        if not self.reregister_race:
            store = self._endpoint_store.setdefault(c.resource, {})
            if c.socket in store:
                self._leak(c)
                return ERR_ALREADY_CONNECTED.format(c.socket)
            store[c.socket] = endpoint
        self._endpoints[c.resource] = endpoint
        logger.info('"Device plugin connected" resourceName="%s"', c.resource)
        return None

    def _leak(self, c: _Client) -> None:
        if c.channel is not None:
            self._leaked.append(c.channel)
            c.channel = None

    async def _run_client(self, name: str, c: _Client) -> None:
        """runClient (handler.go): Run until the stream ends, then disconnect the client found *now*:
        by socket path since PR 135437, by resource name before it (kubernetes issue 121994)."""
        try:
            await self._client_run(c)
        finally:
            c.streaming = False
            self._streams.discard(c)
        current = self._get_client(name, c.socket)
        if current is not c and c.channel is not None:
            # Nobody closes this client's connection (Go's ClientConn outlives the stream): it stays
            # open with no stream, replaced in the map (up to 1.36) or forgotten by a refusal (1.37).
            self._leaked.append(c.channel)
        if current is not None:
            self._disconnect_client(name, current)

    async def _client_run(self, c: _Client) -> None:
        """client.Run: one ListAndWatch stream; every answer goes to PluginListAndWatchReceiver."""
        if c.channel is None:
            return
        stream = server_stream(c.channel, DEVICE_PLUGIN, "ListAndWatch", dp.ListAndWatchResponse)(dp.Empty())
        try:
            async for update in stream:
                self._device_update(c.resource, update.devices)
        except grpc.aio.AioRpcError as e:
            logger.info(
                '"ListAndWatch ended unexpectedly for device plugin" resource="%s" err="%s"', c.resource, e
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            logger.info('"ListAndWatch ended unexpectedly for device plugin" resource="%s"', c.resource)

    def _disconnect_client(self, name: str, c: _Client) -> None:
        """disconnectClient: deregister it, close its connection (client.Disconnect), PluginDisconnected."""
        self._deregister_client(name, c.socket)
        self._close_channel(c)
        self._plugin_disconnected(name, c.socket)
        logger.info('"Device plugin disconnected" resource="%s"', name)

    def _close_channel(self, c: _Client) -> None:
        """grpc.ClientConn.Close: at once; the stream on it ends."""
        if c.channel is not None:
            channel, c.channel = c.channel, None
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _plugin_disconnected(self, name: str, socket: str) -> None:
        """PluginDisconnected (manager.go): the stop grace starts; the devices turn unhealthy in memory
        (allocatable 0, capacity kept). Nothing is written."""
        now = time.monotonic()
        if self.reregister_race:
            e = self._endpoints.get(name)
            if e is not None:
                self._mark_resource_unhealthy(name)
                e.stop_time = now
            return
        store = self._endpoint_store.get(name)
        if not store or socket not in store:
            return
        store[socket].stop_time = now
        if len(store) == 1:
            del self._endpoint_store[name]
            self._mark_resource_unhealthy(name)
        else:
            del store[socket]
            self._endpoints[name] = next(iter(store.values()))

    def _mark_resource_unhealthy(self, name: str) -> None:
        healthy: set[str] = set()
        if name in self._healthy:
            healthy, self._healthy[name] = self._healthy[name], set()
        self._unhealthy[name] = self._unhealthy.get(name, set()) | healthy

    def _device_update(self, name: str, devices: Any) -> None:
        """genericDeviceUpdateCallback (manager.go): the answer replaces the resource's devices, then the
        checkpoint is written."""
        self._healthy[name] = {d.ID for d in devices if d.health == "Healthy"}
        self._unhealthy[name] = {d.ID for d in devices if d.health != "Healthy"}
        self._all[name] = {d.ID: d for d in devices}
        self._write_checkpoint()

    # -- faults --------------------------------------------------------------------
    async def drop(self, resource: str) -> None:
        """The kubelet loses a registered plugin (kubernetes issue 131013): it closes its connection, the
        stream ends, the devices turn unhealthy in memory and the stop grace starts. The plugin is not
        told and keeps serving; nothing is rewritten."""
        clients = [c for c in self._streams if c.resource == resource]
        for c in clients:
            self._close_channel(c)
        tasks = [c.task for c in clients if c.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- GetCapacity (manager.go) ---------------------------------------------------
    async def capacity(self) -> tuple[dict[str, int], dict[str, int], list[str]]:
        """GetCapacity: capacity, allocatable, and the resources dropped now because their endpoint is
        gone or its stop grace ran out. A drop rewrites the checkpoint."""
        now = time.monotonic()

        def expired(r: str) -> bool:
            e = self._endpoints.get(r)
            return e is None or (e.stop_time is not None and now - e.stop_time > self.stop_grace)

        capacity: dict[str, int] = {}
        allocatable: dict[str, int] = {}
        deleted: set[str] = set()
        for r, devices in self._healthy.items():
            if expired(r):
                deleted.add(r)
            else:
                capacity[r] = allocatable[r] = len(devices)
        for r, devices in self._unhealthy.items():
            if expired(r):
                deleted.add(r)
            else:
                capacity[r] = capacity.get(r, 0) + len(devices)
        for r in deleted:
            self._endpoints.pop(r, None)
            self._healthy.pop(r, None)
            self._unhealthy.pop(r, None)
        if deleted:
            self._write_checkpoint()
        return capacity, allocatable, sorted(deleted)

    async def _capacity_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.capacity()

    # -- Allocate (manager.go allocateContainerResources, devicesToAllocate) ---------
    async def allocate(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        count: int,
        *,
        pod_name: str | None = None,
        namespace: str = "default",
    ) -> list[str]:
        """Allocate `count` devices of `resource` to a container, as the kubelet's admission does.

        Raises DeviceManagerError with the kubelet's wording. Writes the checkpoint when the container's
        devices changed; the devices the container holds are returned."""
        pod = self._pods.setdefault(pod_uid, _Pod(pod_name or pod_uid, namespace))
        if container not in pod.containers:
            pod.containers.append(container)
        if resource not in self._healthy and resource not in self._allocated:
            return []  # isDevicePluginResource: not a device plugin resource, nothing to do
        devices = await self._devices_to_allocate(pod_uid, container, resource, count)
        if devices:
            e = self._endpoints.get(resource)
            if e is None:
                self._allocated = self._pod_allocated()
                raise DeviceManagerError(f"unknown Device Plugin {resource}")
            ids = list(devices)
            try:
                if e.stop_time is not None or e.channel is None:
                    raise DeviceManagerError(f"endpoint {resource} has been stopped")
                resp = await unary(e.channel, DEVICE_PLUGIN, "Allocate", dp.AllocateResponse)(
                    dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
                )
            except (grpc.aio.AioRpcError, DeviceManagerError) as err:
                self._allocated = self._pod_allocated()
                if isinstance(err, DeviceManagerError):
                    raise
                raise DeviceManagerError(go_status(err)) from None
            if not resp.container_responses:
                raise DeviceManagerError(f"no containers return in allocation response {resp}")
            per_numa: dict[int, list[str]] = {}
            for d in ids:
                dev = self._all.get(resource, {}).get(d)
                nodes = (
                    [n.ID for n in dev.topology.nodes] if dev is not None and dev.HasField("topology") else []
                )
                for n in nodes or [NODE_WITHOUT_TOPOLOGY]:
                    per_numa.setdefault(n, []).append(d)
            self._pod_devices.setdefault(pod_uid, {}).setdefault(container, {})[resource] = _Allocation(
                per_numa, resp.container_responses[0].SerializeToString()
            )
            self._write_checkpoint()
        return self.pod_devices(pod_uid, container).get(resource, [])

    async def _devices_to_allocate(self, pod: str, container: str, resource: str, required: int) -> set[str]:
        needed = required
        held = self._pod_devices.get(pod, {}).get(container, {}).get(resource)
        devices = {d for ids in held.device_ids.values() for d in ids} if held else None
        if devices is not None:
            needed -= len(devices)
            if needed != 0:
                raise DeviceManagerError(
                    f"pod {go_quote(pod)} container {go_quote(container)} changed request for resource "
                    f"{go_quote(resource)} from {len(devices)} to {required}"
                )
        healthy = self._healthy.get(resource)
        if healthy is None:
            raise DeviceManagerError(f"cannot allocate unregistered device {resource}")
        if not healthy:
            raise DeviceManagerError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}"
            )
        if devices and not devices <= healthy:
            raise DeviceManagerError(
                "previously allocated devices are no longer healthy; "
                f"cannot allocate unhealthy devices {resource}"
            )
        if needed == 0:
            return set()
        allocated: set[str] = set()
        in_use = self._allocated.setdefault(resource, set())

        def take(candidates: list[str]) -> bool:
            nonlocal needed
            for d in candidates:
                if d in allocated:
                    continue
                in_use.add(d)
                allocated.add(d)
                needed -= 1
                if needed == 0:
                    return True
            return False

        available = healthy - in_use
        if len(available) < needed:
            raise DeviceManagerError(
                f"requested number of devices unavailable for {resource}. Requested: {needed}, "
                f"Available: {len(available)}"
            )
        # No topology hint (the topology manager's policy "none"): every device is "no affinity", and the
        # plugin's preferred allocation, when it offers one, goes first.
        preferred = await self._preferred_allocation(resource, available | allocated, allocated, required)
        if take(sorted(preferred & available)) or take(sorted(available)):
            return allocated
        raise DeviceManagerError(
            "unexpectedly allocated less resources than required. "
            f"Requested: {required}, Got: {required - needed}"
        )

    async def _preferred_allocation(
        self, resource: str, available: set[str], must_include: set[str], size: int
    ) -> set[str]:
        """callGetPreferredAllocationIfAvailable: only when the plugin's options say it implements it."""
        e = self._endpoints.get(resource)
        if e is None:
            raise DeviceManagerError(f"endpoint not found in cache for a registered resource: {resource}")
        if e.options is None or not e.options.get_preferred_allocation_available:
            return set()
        if e.stop_time is not None or e.channel is None:
            raise DeviceManagerError(
                "device plugin GetPreferredAllocation rpc failed with err: "
                f"endpoint {resource} has been stopped"
            )
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(available),
                    must_include_deviceIDs=sorted(must_include),
                    allocation_size=size,
                )
            ]
        )
        try:
            resp = await unary(
                e.channel, DEVICE_PLUGIN, "GetPreferredAllocation", dp.PreferredAllocationResponse
            )(request)
        except grpc.aio.AioRpcError as err:
            raise DeviceManagerError(
                f"device plugin GetPreferredAllocation rpc failed with err: {go_status(err)}"
            ) from None
        return set(resp.container_responses[0].deviceIDs) if resp.container_responses else set()

    def _pod_allocated(self) -> dict[str, set[str]]:
        """podDevices.devices(): resource -> every device some container holds."""
        out: dict[str, set[str]] = {}
        for containers in self._pod_devices.values():
            for resources in containers.values():
                for r, a in resources.items():
                    out.setdefault(r, set()).update(d for ids in a.device_ids.values() for d in ids)
        return out

    # -- files -------------------------------------------------------------------
    def _cleanup_plugin_directory(self) -> None:
        """CleanupPluginDirectory (manager.go): remove every socket in the folder (os.Stat follows
        symlinks), in the order the directory lists them (Readdirnames does not sort), except the
        checkpoint; folders and other files stay."""
        for entry in os.scandir(self.dir):
            if entry.path == self.checkpoint_path:
                continue
            try:
                mode = os.stat(entry.path).st_mode
            except OSError:
                continue
            if stat.S_ISSOCK(mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _read_checkpoint(self) -> None:
        """readCheckpoint (manager.go): pod devices back, and each registered resource as a stopped
        endpoint with no device, its stop grace running from now. A file that fails the checksum (here:
        not the simulator's) is ignored, as the kubelet ignores a corrupt one."""
        try:
            with open(self.checkpoint_path, "rb") as f:
                raw = f.read()
        except OSError:
            return
        if not is_simulator_checkpoint(raw):
            logger.info(
                '"Continue after failing to read checkpoint file. '
                'Device allocation info may NOT be up-to-date"'
            )
            return
        data = json.loads(raw)["Data"]
        for entry in data.get("PodDeviceEntries") or []:
            try:
                alloc_resp = base64.b64decode(entry.get("AllocResp") or "")
                dp.ContainerAllocateResponse.FromString(alloc_resp)
                ids = {int(n): list(d) for n, d in (entry.get("DeviceIDs") or {}).items()}
            except (binascii.Error, ValueError, TypeError, AttributeError):
                continue
            uid, container = str(entry.get("PodUID")), str(entry.get("ContainerName"))
            self._pod_devices.setdefault(uid, {}).setdefault(container, {})[
                str(entry.get("ResourceName"))
            ] = _Allocation(ids, alloc_resp)
            pod = self._pods.setdefault(uid, _Pod(uid, "default"))
            if container not in pod.containers:
                pod.containers.append(container)
        self._allocated = self._pod_allocated()
        now = time.monotonic()
        for resource in data.get("RegisteredDevices") or {}:
            self._healthy[resource] = set()
            self._unhealthy[resource] = set()
            self._endpoints[resource] = _Endpoint(resource, "", None, None, stop_time=now)

    def _write_checkpoint(self) -> None:
        """writeCheckpoint (manager.go): every key of the healthy-device map with its healthy devices, and
        the pod devices (DeviceIDs keyed by NUMA node, AllocResp base64). The store creates the folder
        (0755) when it is missing, then writes a `.`-prefixed temporary file and renames it."""
        entries: list[dict[str, Any]] = []
        for uid, containers in self._pod_devices.items():
            for container, resources in containers.items():
                for resource, a in resources.items():
                    entries.append(
                        {
                            "PodUID": uid,
                            "ContainerName": container,
                            "ResourceName": resource,
                            "DeviceIDs": {
                                str(n): list(a.device_ids[n]) for n in sorted(a.device_ids, key=str)
                            },
                            "AllocResp": base64.b64encode(a.alloc_resp).decode(),
                        }
                    )
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        write_checkpoint(
            self.checkpoint_path,
            {r: sorted(d) for r, d in self._healthy.items()},
            entries or None,
        )
        self.checkpoint_writes += 1

    # -- pod-resources (pkg/kubelet/apis/podresources/server_v1.go) -----------------
    async def _start_pod_resources(self, path: str) -> None:
        """pkg/kubelet/server/server.go ListenAndServePodResources → CreateListener (k8s.io/cri-client
        pkg/util/util_unix.go): unlink the old socket, MkdirAll 0750, listen."""
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
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

    def allocatable_devices(self) -> list[pr.ContainerDevices]:
        """GetAllocatableDevices (manager.go: allDevices filtered by healthyDevices), converted as
        containerDevicesFromResourceDeviceInstances (pkg/kubelet/cm/container_manager.go) does: one entry
        per (device, NUMA node); a device without topology once, with none."""
        out: list[pr.ContainerDevices] = []
        for resource in sorted(self._healthy):
            devices = self._all.get(resource)
            if devices is None:
                continue
            for device_id in sorted(self._healthy[resource] & devices.keys()):
                dev = devices[device_id]
                out.extend(_container_devices(resource, device_id, dev if dev.HasField("topology") else None))
        return out

    def container_devices(self, pod_uid: str, container: str) -> list[pr.ContainerDevices]:
        """GetDevices (podDevices.getContainerDevices): the NUMA nodes recorded at allocation."""
        out: list[pr.ContainerDevices] = []
        for resource, a in sorted(self._pod_devices.get(pod_uid, {}).get(container, {}).items()):
            nodes: dict[str, list[int]] = {}
            without: set[str] = set()
            for n, ids in a.device_ids.items():
                for d in ids:
                    if n == NODE_WITHOUT_TOPOLOGY:
                        without.add(d)
                    else:
                        nodes.setdefault(d, []).append(n)
            for d in sorted(without | nodes.keys()):
                if d in nodes:
                    dev = dp.Device(
                        ID=d, topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=n) for n in nodes[d]])
                    )
                    out.extend(_container_devices(resource, d, dev))
                else:
                    out.extend(_container_devices(resource, d, None))
        return out

    async def _rate_limit(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """LimiterUnaryServerInterceptor (pkg/kubelet/apis/grpc/ratelimit.go): golang.org/x/time/rate's
        Allow(), else ResourceExhausted `rejected by rate limit`."""
        if self.pod_resources_qps is None:
            return
        now = time.monotonic()
        self._tokens = min(
            float(self.pod_resources_burst), self._tokens + (now - self._tokens_at) * self.pod_resources_qps
        )
        self._tokens_at = now
        if self._tokens < 1:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, ERR_RATE_LIMIT)
        self._tokens -= 1

    async def _allocatable(
        self, _request: pr.AllocatableResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.AllocatableResourcesResponse:
        await self._rate_limit(context)
        return pr.AllocatableResourcesResponse(devices=self.allocatable_devices())

    def _pod_resources(self, uid: str) -> pr.PodResources:
        pod = self._pods[uid]
        return pr.PodResources(
            name=pod.name,
            namespace=pod.namespace,
            containers=[
                pr.ContainerResources(name=c, devices=self.container_devices(uid, c)) for c in pod.containers
            ],
        )

    async def _list_pods(
        self, _request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.ListPodResourcesResponse:
        await self._rate_limit(context)
        return pr.ListPodResourcesResponse(pod_resources=[self._pod_resources(uid) for uid in self._pods])

    async def _get_pod(
        self, request: pr.GetPodResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pr.GetPodResourcesResponse:
        await self._rate_limit(context)
        for uid, pod in self._pods.items():
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=self._pod_resources(uid))
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )
        raise AssertionError("unreachable")


def _dead_socket_file(path: str) -> None:
    """A socket file nothing listens on (connect() is refused), as a killed process leaves behind."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.bind(path)


def _container_devices(resource: str, device_id: str, dev: dp.Device | None) -> list[pr.ContainerDevices]:
    """containerDevicesFromResourceDeviceInstances for one device: no topology -> one entry without
    topology; otherwise one entry per NUMA node (none at all for an empty topology)."""
    if dev is None:
        return [pr.ContainerDevices(resource_name=resource, device_ids=[device_id])]
    return [
        pr.ContainerDevices(
            resource_name=resource,
            device_ids=[device_id],
            topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n.ID)]),
        )
        for n in dev.topology.nodes
    ]


def registered_devices(checkpoint: Mapping[str, Any]) -> dict[str, set[str]]:
    """RegisteredDevices of a parsed checkpoint as sets (the kubelet writes them unsorted)."""
    data = checkpoint.get("Data") or {}
    return {r: set(ids or ()) for r, ids in (data.get("RegisteredDevices") or {}).items()}
