"""Live probes over gRPC and the kubelet's records, each side-effect free (docs/kubelet.md).

Never `Register` (it bumps the kubelet's registration metric and logs an attempt),
never `ListAndWatch` (a second stream steals health events from the kubelet's),
never `Allocate`.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import grpc

from hami_guard.node.sockets import try_connect
from sidecar.deviceplugin.checkpoint import Checkpoint, CheckpointError, read_checkpoint
from sidecar.proto import deviceplugin_v1beta1_pb2 as dp
from sidecar.proto import podresources_v1_pb2 as pr
from sidecar.rpc import DEVICE_PLUGIN, POD_RESOURCES, REGISTRATION, insecure_channel, unary, unary_path

# An unknown method of the kubelet's own service: the kubelet answers UNIMPLEMENTED without side effects.
KUBELET_PROBE_METHOD = f"/{REGISTRATION.full_name}/HamiGuardProbe"

SocketState = Literal["alive", "absent", "not-socket", "refused", "timeout", "wrong-service", "error"]
T = TypeVar("T")


@dataclass(frozen=True)
class Reading(Generic[T]):
    """What every reader returns: a value, or no value and why (the one error convention here)."""

    value: T | None
    error: str = ""

    @classmethod
    def failed(cls, error: str) -> Reading[T]:
        return cls(None, error)


@dataclass(frozen=True)
class SocketId:
    """What tells one socket file from its successor (inode numbers are reused at once)."""

    ino: int
    mtime_ns: int


@dataclass(frozen=True)
class ProbeResult:
    state: SocketState
    reason: str
    latency: float
    identity: SocketId | None = None
    verified: bool = False  # the kubelet's probe: the v1beta1 registration service itself answered

    @property
    def ok(self) -> bool:
        return self.state == "alive"

    @property
    def definitive(self) -> bool:
        """No waiting mends it: another service answers, or the file is not a socket."""
        return self.state in ("wrong-service", "not-socket")


def socket_identity(path: str) -> SocketId | None:
    """The socket file at `path`, or None when there is none (absent, or another kind of file: a symbolic
    link to a socket is not one, whatever it points at)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return SocketId(st.st_ino, st.st_mtime_ns) if stat.S_ISSOCK(st.st_mode) else None


def socket_refuses(path: str) -> bool:
    """A dead socket file: it exists and nothing listens (the kubelet that made it is gone)."""
    return try_connect(path, timeout=0.05) is not None


def _socket_or_result(path: str, absent: str) -> SocketId | ProbeResult:
    """The socket's identity, or the probe's result when there is no socket to call.

    One stat decides: asking twice (is it a socket? does anything exist?) would call a socket
    created between the two questions "not a socket", a definitive failure. It never follows a symbolic
    link: a link at the path to another plugin's socket, which the kubelet holds, is not this socket.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ProbeResult("absent", absent, 0.0)
    except OSError as e:
        return ProbeResult("error", f"cannot stat {path}: {e.strerror}", 0.0)
    if stat.S_ISLNK(st.st_mode):
        return ProbeResult("not-socket", f"{path} is a symbolic link, not a socket", 0.0)
    if not stat.S_ISSOCK(st.st_mode):
        return ProbeResult("not-socket", f"{path} is not a socket", 0.0)
    return SocketId(st.st_ino, st.st_mtime_ns)


async def probe_kubelet(path: str, timeout: float) -> ProbeResult:
    """Call an unknown method of `v1beta1.Registration`: "unknown method" proves the service is there.

    The answer is tied to the file it came from: a kubelet.sock replaced while probed (a restarting
    kubelet binds a new file over the dead one) may have answered from either file, so it is not
    taken as the old file answering; the result names the new file, and the next round probes it.
    """
    result = await _probe_kubelet(path, timeout)
    after = socket_identity(path) if result.ok else result.identity
    if after == result.identity:
        return result
    why = f"{path} was replaced while probed: the kubelet restarts"
    return ProbeResult("error", why, result.latency, after)


async def _probe_kubelet(path: str, timeout: float) -> ProbeResult:
    started = time.perf_counter()
    identity = _socket_or_result(path, f"{path} does not exist")
    if isinstance(identity, ProbeResult):
        return identity
    async with insecure_channel(path) as channel:
        try:
            await unary_path(channel, KUBELET_PROBE_METHOD, dp.Empty)(dp.Empty(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            latency = time.perf_counter() - started
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.UNIMPLEMENTED:
                if details.startswith("unknown method"):
                    return ProbeResult("alive", "serving v1beta1.Registration", latency, identity, True)
                if details.startswith("unknown service"):
                    return ProbeResult(
                        "wrong-service",
                        f"something else listens on {path}: {details} (not the kubelet's device plugin "
                        "registration; API or socket mix-up)",
                        latency,
                        identity,
                    )
                return ProbeResult("alive", f"alive, service not verified ({details})", latency, identity)
            return _failure(e, path, timeout, latency, identity)
    return ProbeResult("alive", "alive, service not verified (the unknown method answered)", 0.0, identity)


async def probe_plugin(path: str, timeout: float) -> ProbeResult:
    """`GetDevicePluginOptions`: side-effect free, answered by every v1beta1 plugin."""
    started = time.perf_counter()
    identity = _socket_or_result(path, f"{path} does not exist: the plugin is not serving")
    if isinstance(identity, ProbeResult):
        return identity
    async with insecure_channel(path) as channel:
        call = unary(channel, DEVICE_PLUGIN, "GetDevicePluginOptions", dp.DevicePluginOptions)
        try:
            await call(dp.Empty(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return _failure(e, path, timeout, time.perf_counter() - started, identity)
    return ProbeResult("alive", "GetDevicePluginOptions answered", time.perf_counter() - started, identity)


def _failure(
    e: grpc.aio.AioRpcError, path: str, timeout: float, latency: float, identity: SocketId | None
) -> ProbeResult:
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ProbeResult(
            "timeout", f"timeout: no answer on {path} within {timeout:g}s (hung?)", latency, identity
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        if socket_refuses(path):
            return ProbeResult("refused", f"connection refused on {path}: nothing listens", latency, identity)
        return ProbeResult("error", f"unavailable on {path}: {e.details()}", latency, identity)
    return ProbeResult("error", f"{code.name} on {path}: {e.details()}", latency, identity)


async def pod_resources_devices(path: str, timeout: float) -> Reading[dict[str, frozenset[str]]]:
    """The kubelet's live view, pod-resources `GetAllocatableResources`: healthy device IDs per resource.

    Distinct IDs: the kubelet lists a device once per NUMA node it spans.
    """
    if socket_identity(path) is None:
        return Reading.failed("pod-resources socket not mounted")
    async with insecure_channel(path) as channel:
        call = unary(channel, POD_RESOURCES, "GetAllocatableResources", pr.AllocatableResourcesResponse)
        try:
            answer = await call(pr.AllocatableResourcesRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return Reading.failed(f"pod-resources: {e.code().name}: {e.details()}")
    if not isinstance(answer, pr.AllocatableResourcesResponse):  # grpcio answers None for undecodable bytes
        return Reading.failed("pod-resources: an answer that is no AllocatableResourcesResponse")
    ids: dict[str, set[str]] = {}
    for d in answer.devices:
        ids.setdefault(d.resource_name, set()).update(d.device_ids)
    return Reading({r: frozenset(v) for r, v in ids.items()})


# Bounds on pod-resources List's answer, generous for the largest node HAMi serves (checkpoint.py's
# figures: 1,024 containers with devices, 25,600 device IDs): gRPC's 4 MiB receive limit bounds the
# bytes; these bound what is kept of a kubelet (or something else on the socket) that answers more.
MAX_LISTED_PODS = 4096
MAX_HELD_DEVICES = 65_536


async def pod_resources_held(path: str, timeout: float) -> Reading[dict[str, dict[str, str]]]:
    """pod-resources `List`: each device ID a running pod's container holds, per resource, and the pod
    (`namespace/name`). Read-only, like `GetAllocatableResources`; an answer over the bounds is no
    answer (who holds what cannot then be told)."""
    if socket_identity(path) is None:
        return Reading.failed("pod-resources socket not mounted")
    async with insecure_channel(path) as channel:
        call = unary(channel, POD_RESOURCES, "List", pr.ListPodResourcesResponse)
        try:
            answer = await call(pr.ListPodResourcesRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return Reading.failed(f"pod-resources List: {e.code().name}: {e.details()}")
    if not isinstance(answer, pr.ListPodResourcesResponse):  # grpcio answers None for undecodable bytes
        return Reading.failed("pod-resources List: an answer that is no ListPodResourcesResponse")
    if len(answer.pod_resources) > MAX_LISTED_PODS:
        return Reading.failed(f"pod-resources List: over {MAX_LISTED_PODS} pods")
    held: dict[str, dict[str, str]] = {}
    count = 0
    for pod in answer.pod_resources:
        who = f"{pod.namespace}/{pod.name}"
        for container in pod.containers:
            for d in container.devices:
                count += len(d.device_ids)
                if count > MAX_HELD_DEVICES:
                    return Reading.failed(f"pod-resources List: over {MAX_HELD_DEVICES} devices held")
                mine = held.setdefault(d.resource_name, {})
                for device in d.device_ids:
                    mine.setdefault(device, who)
    return Reading(held)


async def read_checkpoint_async(path: str, executor: Executor) -> Reading[Checkpoint]:
    """Off the loop: a checkpoint can be megabytes of JSON, and /healthz must not wait for it."""
    try:
        return Reading(await asyncio.get_running_loop().run_in_executor(executor, read_checkpoint, path))
    except CheckpointError as e:
        return Reading.failed(str(e))
