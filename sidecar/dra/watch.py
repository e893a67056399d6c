"""A DRA driver's evidence, read from the node each round; `sidecar.dra.verdicts` judges it.

Read-only towards the driver: `GetInfo` on its registration socket, and on its DRA service an
empty `NodePrepareResources` (no claims: the call the drivers' own probes make, which prepares
nothing), at most one in flight per driver; never `NotifyRegistrationStatus`, which is the
kubelet's verdict to give, never a call with claims. The kubelet's connections to the service
socket come from the kernel's socket table (`hami_guard.node.unixdiag`), as for the device plugins'
sockets.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import grpc

from hami_guard.node.netunix import socket_inodes
from hami_guard.node.sockets import try_connect
from hami_guard.node.unixdiag import (
    KUBELET_PROCESS_NAMES,
    DiagUnavailable,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    normalise,
)
from sidecar.dra.slices import ApiAccess, Slices, read_slices
from sidecar.dra.verdicts import (
    DEFAULT_GRACE,
    KUBELET_CALL_TIMEOUT,
    DraJudge,
    DraSpec,
    Evidence,
    FileId,
    Info,
    Judgement,
)
from sidecar.proto import pluginregistration_v1_pb2 as reg
from sidecar.rpc import insecure_channel, unary

REGISTRATION = reg.DESCRIPTOR.services_by_name["Registration"]
# The ResourceSlices are read at most this often: the kubelet's wiping delay.
SLICES_EVERY = 30.0


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


class DraWatch:
    """Each round: every driver's evidence, then the judge's verdicts."""

    def __init__(
        self,
        specs: Sequence[DraSpec],
        kubelet_socket: str,
        *,
        grace: float = DEFAULT_GRACE,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        proc: str = "/proc",
        names: Collection[str] = KUBELET_PROCESS_NAMES,
        api: ApiAccess | None = None,
        node: str = "",
    ) -> None:
        self.specs = tuple(specs)
        self.kubelet_socket = kubelet_socket
        self.timeout = timeout
        self.proc = proc
        self.names = names
        self.judge = DraJudge(tuple(s.name for s in self.specs), grace, clock)
        self.connections_source = ""
        self.last: dict[str, tuple[Evidence, Judgement]] = {}
        # The service socket each driver's GetInfo named last: a driver that stops answering (hung,
        # restarting) keeps its service socket, and the kubelet may still hold it.
        self.endpoints: dict[str, str] = {}
        self.methods: dict[str, str] = {}  # the NodePrepareResources GetInfo's services name
        self.services = {s.name: ServiceProbe(clock) for s in self.specs}
        # The node's ResourceSlices (sidecar.dra.slices), only with API access configured and a node
        # name: read at most every SLICES_EVERY seconds.
        self.api = api if node else None
        self.node = node
        self.clock = clock
        self.slices: Slices | None = None
        self.slices_read = 0.0

    async def _slices(self) -> Slices | None:
        if self.api is None:
            return None
        now = self.clock()
        if self.slices is None or now - self.slices_read >= SLICES_EVERY:
            self.slices_read = now
            self.slices = await read_slices(self.api, self.node, max(self.timeout, 1.0))
        return self.slices

    async def _info(self, spec: DraSpec) -> Info:
        info = await get_info(spec.registration, self.timeout)
        if info.ok and info.endpoint:
            self.endpoints[spec.name] = info.endpoint
            self.methods[spec.name] = prepare_path(info.versions)
        return info

    async def _service(self, spec: DraSpec, info: Info) -> tuple[float | None, str]:
        """The DRA service, when GetInfo answers, within the round's timeout."""
        if not info.ok:  # (a call in flight stays: one call at most, never a new one)
            return None, "not asked: GetInfo did not answer"
        service = spec.service or self.endpoints.get(spec.name, "")
        return await self.services[spec.name].read(service, self.methods.get(spec.name, ""), self.timeout)

    def close(self) -> None:
        """Cancel the service calls in flight."""
        for probe in self.services.values():
            probe.close()

    async def round(self) -> dict[str, tuple[Evidence, Judgement]]:
        infos = await asyncio.gather(*(self._info(s) for s in self.specs))
        services = [s.service or self.endpoints.get(s.name, "") for s in self.specs]
        up, kubelet_id = kubelet_alive(self.kubelet_socket)
        paths = {normalise(p) for p in services if p}
        # Only the sockets bound to the files that matter: a host's namespace holds thousands.
        files = {(i[0], i[1]) for p in (self.kubelet_socket, *paths) if (i := socket_file(p))}
        # This process's own sockets, read before the kernel's table: a service call's connection that
        # gRPC closes in between is then in neither, never in the table alone (counted as the kubelet's).
        own = socket_inodes("/proc", "self")
        try:
            mine: list[UnixSocket] | str = diag_dump(files)
        except DiagUnavailable as e:
            mine = str(e)
        connections = kubelet_connections(self.kubelet_socket, self.proc, self.names, mine=mine, paths=paths)
        if not isinstance(connections, str) and connections.exact and own:
            # This process's own service calls are connections to the service socket too, in the
            # kubelet's namespace when the sidecar shares it: never the kubelet's (where the
            # kubelet's descriptors cannot be read, nothing else tells them apart).
            connections = replace(
                connections, sockets=tuple(s for s in connections.sockets if s.ino not in own)
            )
        self.connections_source = connections if isinstance(connections, str) else connections.source
        # The DRA services after the kubelet's connections are read: a round's reading of the kubelet
        # is as quick as without them (a restart's short gap stays visible).
        silences, slices = await asyncio.gather(
            asyncio.gather(*(self._service(s, i) for s, i in zip(self.specs, infos, strict=True))),
            self._slices(),
        )
        out: dict[str, tuple[Evidence, Judgement]] = {}
        for spec, info, (silent, service_reason), service in zip(
            self.specs, infos, silences, services, strict=True
        ):
            if isinstance(connections, str):
                count: int | None = None
                why = connections
            elif not service:
                count, why = None, "the service socket is not known until GetInfo answers"
            else:
                count, why = connections.to(service), ""
            ev = Evidence(
                info=info,
                registration_id=socket_file(spec.registration),
                service=service,
                service_id=socket_file(service) if service else None,
                kubelet_up=up,
                kubelet_id=kubelet_id,
                connections=count,
                connections_why=why,
                service_silent_since=silent,
                service_reason=service_reason,
                slices=None if slices is None else slices.of(spec.name),
                slices_why="" if slices is None else slices.why,
            )
            out[spec.name] = (ev, self.judge.judge(spec.name, ev))
        self.last = out
        return out
