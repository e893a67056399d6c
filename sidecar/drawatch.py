"""A DRA driver's evidence, read from the node each round; `sidecar.dra` judges it.

Read-only towards the driver: `GetInfo` on its registration socket and nothing else (never
`NotifyRegistrationStatus`, which is the kubelet's verdict to give, never a DRA call). The
kubelet's connections to the service socket come from the kernel's socket table
(`sidecar.unixdiag`), as for the device plugins' sockets.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable, Collection, Sequence

import grpc

from initcheck.checks import try_connect
from sidecar.dra import DEFAULT_GRACE, DraJudge, DraSpec, Evidence, FileId, Info, Judgement
from sidecar.proto import pluginregistration_v1_pb2 as reg
from sidecar.rpc import insecure_channel, unary
from sidecar.unixdiag import (
    KUBELET_PROCESS_NAMES,
    DiagUnavailable,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    normalise,
)

REGISTRATION = reg.DESCRIPTOR.services_by_name["Registration"]


def socket_file(path: str) -> FileId | None:
    """(st_dev, st_ino) of a socket file at `path`, None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


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


def kubelet_alive(kubelet_socket: str) -> tuple[bool | None, FileId | None]:
    """Whether the kubelet answers on its socket (it accepts a connection) and which socket that is."""
    if not kubelet_socket:
        return None, None
    ident = socket_file(kubelet_socket)
    if ident is None:
        return False, None
    return try_connect(kubelet_socket, timeout=0.2) is None, ident


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

    async def round(self) -> dict[str, tuple[Evidence, Judgement]]:
        infos = await asyncio.gather(*(get_info(s.registration, self.timeout) for s in self.specs))
        for spec, info in zip(self.specs, infos, strict=True):
            if info.ok and info.endpoint:
                self.endpoints[spec.name] = info.endpoint
        services = [s.service or self.endpoints.get(s.name, "") for s in self.specs]
        up, kubelet_id = kubelet_alive(self.kubelet_socket)
        paths = {normalise(p) for p in services if p}
        # Only the sockets bound to the files that matter: a host's namespace holds thousands.
        files = {i for p in (self.kubelet_socket, *paths) if (i := socket_file(p))}
        try:
            mine: list[UnixSocket] | str = diag_dump(files)
        except DiagUnavailable as e:
            mine = str(e)
        connections = kubelet_connections(self.kubelet_socket, self.proc, self.names, mine=mine, paths=paths)
        self.connections_source = connections if isinstance(connections, str) else connections.source
        out: dict[str, tuple[Evidence, Judgement]] = {}
        for spec, info, service in zip(self.specs, infos, services, strict=True):
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
            )
            out[spec.name] = (ev, self.judge.judge(spec.name, ev))
        self.last = out
        return out
