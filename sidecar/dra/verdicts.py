"""Is a DRA driver registered with the kubelet? The judgement, pure and clock-injected.

A DRA kubelet plugin registers through the kubelet's plugin watcher: it serves the plugin
registration API on a socket in `plugins_registry`, the kubelet calls `GetInfo`, hands the
driver to its DRA manager, and the DRA manager opens a gRPC connection to the driver's
service socket (the `endpoint` GetInfo names) that it keeps open and reconnects when it
ends (docs/kubelet.md#dra). So the kubelet's live evidence of a registered driver is its
open connection to the service socket; a registration socket that answers `GetInfo` says
only that the driver is alive.

Two checks per driver, in the health vocabulary of the device plugins:

- `dra-plugin:<driver>`: the driver answers `GetInfo` on its registration socket with its own
  name and the type `DRAPlugin`, and its DRA service answers an empty `NodePrepareResources`
  (no claims: the drivers' own self-probe, which changes nothing). A driver that stopped
  answering (socket gone, nothing listens, hung) fails liveness; so does a DRA service that
  stays silent for the grace while registration answers: the kubelet keeps such a driver
  registered and its connection looks open (gRPC reports it connected before the server's
  first frame), so only Pods see it, their claims failing to prepare after the kubelet's
  45 s call timeout, again and again (docs/kubelet.md#dra-hung-service). One that answers
  for another driver or type is a setting to fix, which no restart mends.
- `dra-registered:<driver>`: the kubelet holds a connection to the driver's service socket.
  Not registered for the grace (which covers the kubelet's registration retry, at most
  2 min 2 s apart) fails liveness; so does a connection that stays lost for the grace. While
  the kubelet is down, or its connections cannot be seen, it is readiness only: a driver
  restart is not the remedy. After `RESTART_BUDGET` driver restarts that did not register
  it, liveness stops failing (the restart budget, as for device plugins).

Every "start of a spell" (the sidecar's start, a new registration or service socket, a new
kubelet, a lost connection) starts the grace again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from sidecar.dra.spec import DEFAULT_GRACE
from sidecar.health import Status

PLUGIN_TYPE = "DRAPlugin"
# The kubelet retries a failed registration of one socket after 0.5 s, doubling up to 2 min 2 s
# (pkg/util/goroutinemap/exponentialbackoff: initialDurationBeforeRetry, maxDurationBeforeRetry).
KUBELET_RETRY_CAP = 122.0
# GetInfo timeouts in a row that make a hung driver (one slow answer is not a hang); also the rounds in
# a row that must see the DRA service silent before its silence can fail liveness.
HUNG_ROUNDS = 2
# The kubelet's deadline for each call to a DRA driver (pkg/kubelet/cm/dra/plugin/dra_plugin.go:
# defaultClientCallTimeout); the default grace outlasts three of them.
KUBELET_CALL_TIMEOUT = 45.0
RESTART_BUDGET = 3

InfoKind = Literal["ok", "absent", "not-socket", "refused", "timeout", "error"]
# A socket file's identity: (st_dev, st_ino, st_ctime_ns). The inode number alone comes back when a
# socket is removed and bound again on the same path (ext4 hands out the freed one at once), and a
# driver or kubelet restarted between two rounds would pass unseen.
FileId = tuple[int, int, int]


@dataclass(frozen=True)
class Info:
    """The answer to GetInfo on the registration socket, or why there is none."""

    kind: InfoKind
    reason: str
    type: str = ""
    name: str = ""
    endpoint: str = ""
    versions: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """GetInfo answered (for whichever driver and type: the verdict checks those)."""
        return self.kind == "ok"


@dataclass(frozen=True)
class Evidence:
    """One round's readings for one driver. None where a reading is not available."""

    info: Info
    registration_id: FileId | None  # the registration socket file now
    service: str  # the service socket's path (the setting, else GetInfo's endpoint)
    service_id: FileId | None  # the service socket file now
    kubelet_up: bool | None  # the kubelet answers on its socket; None: not known
    kubelet_id: FileId | None  # the kubelet's socket file: a new one is a new kubelet
    connections: int | None  # the kubelet's open connections to the service socket
    connections_why: str = ""  # why connections is None
    # The DRA service's silence: since when (the judge's clock) its answer to an empty
    # NodePrepareResources is awaited in vain; None when it answered or was not asked.
    service_silent_since: float | None = None
    service_reason: str = ""  # the last service reading, for the verdicts
    # The node's ResourceSlices of the driver (slices, devices) from the API server, when configured
    # (sidecar.dra.slices): reasons only, never a verdict. None: not read; slices_why says why.
    slices: tuple[int, int] | None = None
    slices_why: str = ""


@dataclass(frozen=True)
class Verdict:
    """One check's verdict on a driver, with its reason, as the health state takes it whole."""

    status: Status
    reason: str
    restarts: bool = True  # a failure fails liveness

    @property
    def live_failed(self) -> bool:
        """Failed, and a driver restart is its remedy: it fails liveness."""
        return self.status is Status.FAILED and self.restarts


@dataclass
class _Driver:
    since: float  # monotonic start of the current spell (the grace runs from it)
    plugin_since: float
    registration_id: FileId | None = None
    service_id: FileId | None = None
    kubelet_id: FileId | None = None
    connected: bool = False  # the kubelet's connection was seen in this spell
    answered: bool = False  # GetInfo answered since plugin_since
    timeouts: int = 0
    silent_rounds: int = 0  # rounds in a row that saw the DRA service silent
    failing_live: bool = False  # dra-registered failed liveness in this spell
    gone: bool = False  # the registration socket went
    restarts_in_vain: int = 0
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Judgement:
    """One round's verdicts on a driver: `dra-plugin` (it answers GetInfo, its DRA service answers)
    and `dra-registered` (the kubelet holds a connection to its service socket)."""

    plugin: Verdict
    registered: Verdict
    spell_started: float  # monotonic
    restarts_in_vain: int


def slices_note(ev: Evidence) -> str:
    """What the node's ResourceSlices add to the registration verdict's reason ("" when not read)."""
    if ev.slices is None:
        return f"ResourceSlices: {ev.slices_why}" if ev.slices_why else ""
    n, devices = ev.slices
    if n:
        return f"{n} ResourceSlice{'s' * (n != 1)} of the driver on this node ({devices} devices)"
    return (
        "no ResourceSlice of the driver on this node (the kubelet deletes them 30 s after it gives the "
        "driver up, and at its start; or the driver publishes none)"
    )


class DraJudge:
    """Whether the kubelet holds each configured DRA driver, from each round's evidence: the grace
    of each spell, hung drivers and services, and each driver's restart budget."""

    def __init__(
        self,
        drivers: tuple[str, ...],
        grace: float = DEFAULT_GRACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.clock = clock
        now = clock()
        self._d = {name: _Driver(since=now, plugin_since=now) for name in drivers}

    def restarts_in_vain(self, driver: str) -> int:
        """Driver restarts in vain (a new instance after one that failed liveness for not being
        registered), counted until the kubelet holds the driver again: the restart budget's count."""
        return self._d[driver].restarts_in_vain

    def judge(self, driver: str, ev: Evidence) -> Judgement:
        """Judge one round's evidence of `driver`: a new spell first, then its two checks."""
        d = self._d[driver]
        now = self.clock()
        self._spells(d, ev, now)
        plugin = self._plugin(driver, d, ev, now)
        registered = self._registered(driver, d, ev, now, plugin)
        if note := slices_note(ev):
            registered = Verdict(registered.status, f"{registered.reason}; {note}", registered.restarts)
        d.failing_live = d.failing_live or registered.live_failed
        return Judgement(plugin, registered, d.since, d.restarts_in_vain)

    def _spells(self, d: _Driver, ev: Evidence, now: float) -> None:
        """Start the grace again on what restarts registration."""
        if ev.registration_id is None and d.registration_id is not None:
            # The registration socket went (an orderly stop): a new instance has the grace to come.
            if d.failing_live:
                d.restarts_in_vain += 1
            self._restart(d, now, plugin=True)
            d.registration_id = None
            d.gone = True
        if ev.registration_id is not None and ev.registration_id != d.registration_id:
            if d.registration_id is not None:
                # A new driver instance: if the last one failed liveness for not being registered,
                # that restart was in vain until this one registers.
                if d.failing_live:
                    d.restarts_in_vain += 1
                self._restart(d, now, plugin=True)
            elif d.gone:
                self._restart(d, now, plugin=True)
            d.registration_id, d.gone = ev.registration_id, False
        if ev.service_id is not None and ev.service_id != d.service_id:
            if d.service_id is not None:
                self._restart(d, now)
            d.service_id = ev.service_id
        if ev.kubelet_id is not None and ev.kubelet_id != d.kubelet_id:
            if d.kubelet_id is not None:
                # A new kubelet: a new grace. The restart budget stays: the new kubelet registers the
                # driver itself from plugins_registry, and what kept the last one from it (a refusal,
                # a folder the kubelet does not use) a driver restart does not mend.
                self._restart(d, now)
            d.kubelet_id = ev.kubelet_id
        if ev.kubelet_up is False and d.connected:
            self._restart(d, now)
        if ev.connections == 0 and d.connected:
            self._restart(d, now)  # lost: the kubelet reconnects, or restarts, within the grace

    @staticmethod
    def _restart(d: _Driver, now: float, plugin: bool = False) -> None:
        d.since, d.connected, d.failing_live = now, False, False
        if plugin:
            d.plugin_since, d.answered, d.timeouts = now, False, 0

    def _plugin(self, driver: str, d: _Driver, ev: Evidence, now: float) -> Verdict:
        info = ev.info
        if info.ok:
            d.answered, d.timeouts = True, 0
            if info.type != PLUGIN_TYPE or info.name != driver:
                return Verdict(
                    Status.FAILED,
                    f"the registration socket serves {info.type or '?'} {info.name or '?'}, not the DRA "
                    f"driver {driver}: the setting names another driver's socket",
                    restarts=False,
                )
            if ev.service_silent_since is None:
                d.silent_rounds = 0
                services = ", ".join(info.versions) or "none"
                return Verdict(
                    Status.OK, f"GetInfo answers: {PLUGIN_TYPE} {driver}, service {info.endpoint}, {services}"
                )
            return self._silent(d, ev, now)
        if info.kind in ("timeout", "error"):
            # A socket that accepts but does not answer: hung once it stays so (one slow or failed
            # answer is not a hang).
            d.timeouts += 1
            if d.answered and d.timeouts < HUNG_ROUNDS:
                return Verdict(Status.PENDING, f"{info.reason} (once; hung after {HUNG_ROUNDS} in a row)")
            if d.timeouts >= HUNG_ROUNDS:
                return Verdict(Status.FAILED, f"hung: {d.timeouts} GetInfo failures in a row; {info.reason}")
        else:
            d.timeouts = 0
        left = d.plugin_since + self.grace - now
        if not d.answered and left > 0:
            return Verdict(Status.PENDING, f"{info.reason} (grace: {left:.0f}s left)")
        return Verdict(Status.FAILED, info.reason)

    def _silent(self, d: _Driver, ev: Evidence, now: float) -> Verdict:
        """GetInfo answers, the DRA service does not: hung once it stayed silent for the grace and
        more than one round saw it (a slow answer, or a clock that jumped, is not a hang)."""
        d.silent_rounds += 1
        silent = now - (ev.service_silent_since or now)
        why = f"the DRA service {ev.service} has not answered for {silent:.0f}s ({ev.service_reason})"
        if silent >= self.grace and d.silent_rounds >= HUNG_ROUNDS:
            return Verdict(
                Status.FAILED,
                f"hung DRA service: {why}; registration still answers, so the kubelet keeps the "
                f"driver and every claim it prepares fails after {KUBELET_CALL_TIMEOUT:.0f}s",
            )
        return Verdict(Status.PENDING, f"{why} (hung after {self.grace:.0f}s)")

    def _registered(self, driver: str, d: _Driver, ev: Evidence, now: float, plugin: Verdict) -> Verdict:
        spell = now - d.since
        left = self.grace - spell
        if ev.connections is not None and ev.connections > 0 and ev.service_id is not None:
            d.connected = True
            if d.restarts_in_vain:
                d.restarts_in_vain = 0
            n = ev.connections
            return Verdict(Status.OK, f"the kubelet holds {n} connection{'s' * (n != 1)} to {ev.service}")
        if plugin.status is not Status.OK:
            why = "the driver does not answer (dra-plugin)"
            if plugin.status is Status.FAILED and not plugin.restarts:
                why = "the registration socket is another driver's (dra-plugin)"
            return self._not_yet(why, left, restarts=False)
        if ev.kubelet_up is False:
            return Verdict(
                Status.FAILED, "the kubelet is not running: restarting the driver does not register it", False
            )
        if ev.connections is None:
            return Verdict(
                Status.FAILED,
                f"the kubelet's connections cannot be seen ({ev.connections_why}): not judged",
                restarts=False,
            )
        if ev.service_id is None:
            why = f"the service socket {ev.service or '(unnamed)'} does not exist: the kubelet cannot connect"
        else:
            why = f"the kubelet holds no connection to {ev.service}"
        if left > 0:
            return Verdict(Status.PENDING, f"{why} (grace: {left:.0f}s left)")
        why = f"not registered: {why} for {spell:.0f}s"
        if d.restarts_in_vain >= RESTART_BUDGET:
            return Verdict(
                Status.FAILED,
                f"{why}; restart budget spent: {d.restarts_in_vain} driver restarts did not register it",
                restarts=False,
            )
        return Verdict(Status.FAILED, why)

    @staticmethod
    def _not_yet(why: str, left: float, restarts: bool) -> Verdict:
        if left > 0:
            return Verdict(Status.PENDING, f"{why} (grace: {left:.0f}s left)", restarts)
        return Verdict(Status.FAILED, why, restarts)
