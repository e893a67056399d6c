"""A DRA driver's round: its evidence, read from the node, then `sidecar.dra.verdicts`' verdicts.

The readings of the driver's sockets (`GetInfo`, the DRA service's silence, the kubelet's socket)
come from `sidecar.dra.probes`; the kubelet's connections to the service socket from the kernel's
socket table (`hami_guard.node.unixdiag`), as for the device plugins' sockets
(`sidecar.deviceplugin.watch`); the node's ResourceSlices, when configured, from `sidecar.dra.slices`.

In the sidecar (`DraWatch.attach`), each round's verdicts go into the sidecar's checks
(`dra-plugin:<driver>`, `dra-registered:<driver>`) and metrics beside the device plugins'; hami-doctor
reads them as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Protocol

from hami_guard.node.netunix import socket_inodes
from hami_guard.node.unixdiag import (
    KUBELET_PROCESS_NAMES,
    Connections,
    DiagUnavailable,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    normalise,
)
from sidecar.dra.probes import ServiceProbe, get_info, kubelet_alive, prepare_path, socket_file
from sidecar.dra.slices import ApiAccess, Slices, read_slices
from sidecar.dra.spec import DEFAULT_GRACE, DraSpec
from sidecar.dra.verdicts import RESTART_BUDGET, DraJudge, Evidence, FileId, Info, Judgement
from sidecar.health import CheckKey, HealthState, Kind

# The ResourceSlices are read at most this often: the kubelet's wiping delay.
SLICES_EVERY = 30.0


class Publisher(Protocol):
    """What the sidecar publishes of a driver's verdicts (`sidecar.server.metrics.MetricsPublisher`)."""

    def series(self, resource: str, *, registrations: bool = True) -> None:
        """Every series of a driver, from the start."""

    def restart_requested(self, resource: str) -> None:
        """The driver's liveness failure episode began."""

    def connected(self, resource: str, count: int | None) -> None:
        """The kubelet's connections to the driver's service socket (None: cannot be seen)."""

    def budget(self, resource: str, spent: bool) -> None:
        """Whether the driver's restart budget is spent."""


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
        self._into: tuple[HealthState, Publisher] | None = None

    def attach(self, state: HealthState, publish: Publisher) -> None:
        """From now on each round's verdicts go into `state`'s checks and `publish`'s metrics: two checks
        per driver, judged here whole (the DRA judge has its own graces)."""
        for spec in self.specs:
            for kind in (Kind.DRA_PLUGIN, Kind.DRA_REGISTERED):
                key = CheckKey(kind, spec.name)
                state.add(key)
                state.checks[key.name].judged_elsewhere = True
            publish.series(spec.name, registrations=False)
        self._into = (state, publish)

    def _publish(self, verdicts: dict[str, tuple[Evidence, Judgement]]) -> None:
        """The round's verdicts into the attached checks and metrics."""
        if self._into is None:
            return
        state, publish = self._into
        for name, (ev, j) in verdicts.items():
            for kind, v in ((Kind.DRA_PLUGIN, j.plugin), (Kind.DRA_REGISTERED, j.registered)):
                key = CheckKey(kind, name).name
                was = state.checks[key].live_failed
                state.assign(key, v.status, v.reason, restarts=v.restarts)
                if v.live_failed and not was:
                    publish.restart_requested(name)
            publish.connected(name, ev.connections)
            publish.budget(name, j.restarts_in_vain >= RESTART_BUDGET)

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

    def _table(self, paths: set[str]) -> tuple[bool | None, FileId | None, Connections | str]:
        """kubelet.sock's state and the kubelet's connections to the service sockets `paths` (blocking)."""
        up, kubelet_id = kubelet_alive(self.kubelet_socket)
        # Only the sockets bound to the files that matter: a host's namespace holds thousands.
        files = {(i[0], i[1]) for p in (self.kubelet_socket, *paths) if (i := socket_file(p))}
        # This process's own sockets, read before the kernel's table: a service call's connection that
        # gRPC closes in between is then in neither, never in the table alone (counted as the kubelet's).
        own = socket_inodes("/proc", "self")
        try:
            mine: list[UnixSocket] | str = diag_dump(files)
        except DiagUnavailable as e:
            mine = str(e)
        connections = kubelet_connections(
            self.kubelet_socket, self.proc, self.names, mine=mine, paths=paths, served=paths
        )
        if not isinstance(connections, str) and connections.exact and own:
            # This process's own service calls are connections to the service socket too, in the
            # kubelet's namespace when the sidecar shares it: never the kubelet's (where the
            # kubelet's descriptors cannot be read, nothing else tells them apart).
            connections = replace(
                connections, sockets=tuple(s for s in connections.sockets if s.ino not in own)
            )
        return up, kubelet_id, connections

    async def round(self) -> dict[str, tuple[Evidence, Judgement]]:
        """Every driver's evidence and the judge's verdict on it, by driver name (also kept in `last`, and
        published when attached)."""
        infos = await asyncio.gather(*(self._info(s) for s in self.specs))
        services = [s.service or self.endpoints.get(s.name, "") for s in self.specs]
        paths = {normalise(p) for p in services if p}
        # Off the loop: a host's namespace may hold 100,000 sockets, a read of a few hundred ms.
        up, kubelet_id, connections = await asyncio.to_thread(self._table, paths)
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
            else:  # a count that cannot be told (/proc, by path) is no count, never 0
                held = connections.held(service)
                count, why = (None, held) if isinstance(held, str) else (held, "")
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
        self._publish(out)
        return out
