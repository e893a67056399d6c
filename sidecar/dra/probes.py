"""A DRA driver's sockets, read without side effects: `GetInfo`, an empty `NodePrepareResources`.

Read-only towards the driver: `GetInfo` on its registration socket, and on its DRA service an
empty `NodePrepareResources` (no claims: the call the drivers' own probes make, which prepares
nothing), at most one in flight per driver (`ServiceProbe`); never `NotifyRegistrationStatus`,
which is the kubelet's verdict to give, never a call with claims. `sidecar.dra.watch` gathers a
round's readings from here, as `sidecar.deviceplugin.probes` serves the device plugins' round.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Collection

import grpc

from hami_guard.node.sockets import try_connect
from sidecar.dra.verdicts import KUBELET_CALL_TIMEOUT, FileId, Info
from sidecar.proto import pluginregistration_v1_pb2 as reg
from sidecar.rpc import insecure_channel, unary

REGISTRATION = reg.DESCRIPTOR.services_by_name["Registration"]


def socket_file(path: str) -> FileId | None:
    """The identity of the socket file at `path` (its change time included: a driver restarted on the
    same path may get the inode number back), None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


async def get_info(path: str, timeout: float) -> Info:
    """GetInfo on a registration socket, or why it did not answer."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        return Info("absent", f"{path}: {getattr(e, 'strerror', None) or e}: the driver is not serving")
    if not stat.S_ISSOCK(st.st_mode):
        return Info("not-socket", f"{path} is not a socket")
    try:
        async with insecure_channel(path) as channel:
            call = unary(channel, REGISTRATION, "GetInfo", reg.PluginInfo)
            answer = await call(reg.InfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Info("timeout", f"GetInfo on {path}: no answer within {timeout:g}s")
        if code == grpc.StatusCode.UNAVAILABLE and try_connect(path, timeout=0.2) is not None:
            return Info("refused", f"connection refused on {path}: nothing listens (a stale socket)")
        return Info("error", f"GetInfo on {path}: {code.name}: {e.details()}")
    except Exception as e:  # a malformed answer is the driver's failure, not the sidecar's
        return Info("error", f"GetInfo on {path}: {type(e).__name__}: {e}")
    if not isinstance(answer, reg.PluginInfo):  # grpcio answers None for bytes it cannot decode
        return Info("error", f"GetInfo on {path}: the answer is not a PluginInfo")
    return Info(
        "ok",
        "GetInfo answered",
        type=answer.type,
        name=answer.name,
        endpoint=answer.endpoint or path,
        versions=tuple(answer.supported_versions),
    )


# The DRA service's NodePrepareResources, by the service name GetInfo advertises, newest first (the
# kubelet's own preference: pkg/kubelet/cm/dra/plugin/dra_plugin.go, servicesSupportedByKubelet).
PREPARE_PATHS = (
    ("v1.DRAPlugin", "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"),
    ("v1beta1.DRAPlugin", "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources"),
)


def prepare_path(versions: Collection[str]) -> str:
    """The NodePrepareResources the kubelet would call, "" when GetInfo names no service it knows."""
    return next((path for name, path in PREPARE_PATHS if name in versions), "")


def _raw(data: bytes) -> bytes:
    return data


async def ask_service(path: str, method: str, deadline: float) -> tuple[bool | None, str]:
    """An empty NodePrepareResources (zero bytes: no claims) on the DRA service socket. (True, why):
    the service answered, with any status its server sent; (False, why): it stays silent (no answer
    by the deadline, or a socket that accepts a connection and never completes it); (None, why):
    nothing to ask (no socket, nothing listens)."""
    if socket_file(path) is None:
        return None, f"{path} is not a socket"
    try:
        async with insecure_channel(path) as channel:
            call = channel.unary_unary(method, request_serializer=_raw, response_deserializer=_raw)
            await call(b"", timeout=deadline)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False, f"an empty NodePrepareResources got no answer within {deadline:g}s"
        if code == grpc.StatusCode.UNAVAILABLE:
            if try_connect(path, timeout=0.2) is not None:
                return None, f"nothing listens on {path}"
            return False, f"{path} accepts a connection but its gRPC server never answers: {e.details()}"
        return True, f"answered {code.name}"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a malformed answer is still an answer
        return True, f"answered ({type(e).__name__})"
    return True, "answered"


class ServiceProbe:
    """One driver's DRA service: at most one empty NodePrepareResources in flight, so a hung service
    holds one call, never a pile of them; how long it has been silent, on the judge's clock."""

    def __init__(self, clock: Callable[[], float], deadline: float = KUBELET_CALL_TIMEOUT) -> None:
        self.clock = clock
        self.deadline = deadline
        self.path = ""
        self.ident: FileId | None = None
        self.task: asyncio.Task[tuple[bool | None, str]] | None = None
        self.started = 0.0  # the judge's clock when the call in flight began
        self.silent_since: float | None = None
        self.reason = "not asked"

    def reset(self) -> None:
        """Forget the service: cancel the call in flight, and its silence with it."""
        if self.task is not None:
            self.task.cancel()
        self.task, self.silent_since, self.reason = None, None, "not asked"

    async def read(self, path: str, method: str, wait: float) -> tuple[float | None, str]:
        """Ask (unless a call is in flight), wait up to `wait` seconds for it: (silent since, reason)."""
        ident = socket_file(path) if path else None
        if path != self.path or ident != self.ident:
            self.reset()  # another service socket: what the last one did says nothing of it
            self.path, self.ident = path, ident
        if not path or not method or ident is None:
            self.reset()
            return (
                None,
                "not asked: no service socket" if not method or not path else f"{path} does not exist",
            )
        task = self.task
        if task is None:
            self.started = self.clock()
            task = self.task = asyncio.create_task(ask_service(path, method, self.deadline))
        done, _ = await asyncio.wait({task}, timeout=wait)
        if not done:
            if self.silent_since is None:
                self.silent_since = self.started
            self.reason = f"an empty NodePrepareResources waits since {self.clock() - self.started:.0f}s"
            return self.silent_since, self.reason
        if self.task is task:  # (a round that ran beside this one may have taken it already)
            self.task = None
        answered: bool | None = None
        if task.cancelled():
            self.reason = "cancelled"
        else:
            answered, self.reason = task.result()
        if answered is False:
            if self.silent_since is None:
                self.silent_since = self.started
        else:
            self.silent_since = None
        return self.silent_since, self.reason

    def close(self) -> None:
        """Cancel the call in flight (the sidecar stops)."""
        self.reset()


def kubelet_alive(kubelet_socket: str) -> tuple[bool | None, FileId | None]:
    """Whether the kubelet answers on its socket (it accepts a connection) and which socket that is."""
    if not kubelet_socket:
        return None, None
    ident = socket_file(kubelet_socket)
    if ident is None:
        return False, None
    up = try_connect(kubelet_socket, timeout=0.2) is None
    after = socket_file(kubelet_socket)
    if after != ident:
        return None, after  # replaced while tried: a new kubelet, whose answer the next round takes
    return up, ident
