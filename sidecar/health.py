"""The health vocabulary: checks, their status, transitions and the registration grace.

Pure and clock-injected: probes and events report outcomes here; the HTTP views
and the metrics only read. Grace (docs/design.md#grace): a check that has not passed
since the last event that resets it is *pending*, not failed, until the grace has run out.

Liveness and readiness read the same checks differently: a failure fails liveness only
when it `restarts` (a plugin restart is its remedy); readiness wants every check ok.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class Kind(enum.Enum):
    """What a check is about; with a resource, the check's key."""

    KUBELET = "kubelet"
    CHECKPOINT = "checkpoint"
    PLUGIN = "plugin"
    REGISTERED = "registered"
    KUBELET_CLIENT = "kubelet-client"  # the kubelet keeps the plugin's client (1.37 forgets it on a refusal)
    DEVICES = "devices"
    RECOVER = "recover"  # devices HAMi can never mark healthy again, re-read by a plugin restart (opt-in)
    DRA_PLUGIN = "dra-plugin"  # a DRA driver answers GetInfo (sidecar.dra.verdicts)
    DRA_REGISTERED = "dra-registered"  # the kubelet holds the DRA driver's service connection
    HAMI = "hami"  # HAMi's scheduler sees the GPUs the kubelet lists (sidecar.hami.verdicts)


@dataclass(frozen=True)
class CheckKey:
    """A check's identity: its kind, and the resource (or DRA driver) it is about, if any."""

    kind: Kind
    resource: str = ""

    @property
    def name(self) -> str:
        """The public spelling: `kubelet`, `registered:<resource>`."""
        return f"{self.kind.value}:{self.resource}" if self.resource else self.kind.value


class Status(enum.Enum):
    """A check's status: ok, failed, or pending (not passed since its last reset, within the grace)."""

    OK = "ok"
    FAILED = "failed"
    PENDING = "pending"

    @property
    def up(self) -> float:
        """The value of `device_plugin_check_up`."""
        return {Status.OK: 1.0, Status.FAILED: 0.0, Status.PENDING: 0.5}[self]

    @property
    def mark(self) -> str:
        """The sign in a verbose view's `[+]`, `[-]`, `[~]`."""
        return {Status.OK: "+", Status.FAILED: "-", Status.PENDING: "~"}[self]


@dataclass
class Check:
    """One check's verdict and what it rests on: the last raw outcome, whether it passed since its
    last reset (the grace runs from that reset), and whether its failure fails liveness."""

    key: CheckKey
    status: Status
    reason: str
    since: float  # wall clock of the last transition
    latency: float | None = None  # of the last probe, seconds
    last_ok: bool | None = None  # the last raw outcome; None before the first
    definitive: bool = False
    passed_since_reset: bool = False
    reset_at: float = 0.0  # monotonic
    restarts: bool = True  # a failure of this check fails liveness (restarting the plugin helps)
    judged_elsewhere: bool = False  # its status comes whole from `assign` (its own graces)
    quiet: str = ""  # why a failure of this check restarts nothing, when the default is not the truth

    @property
    def no_restart(self) -> str:
        """Why this failure does not fail liveness, as `[!]` lines say it."""
        return self.quiet or NO_RESTART

    @property
    def name(self) -> str:
        """The public spelling of its key."""
        return self.key.name

    @property
    def live_failed(self) -> bool:
        """Failed, and a plugin restart is its remedy: it fails liveness (/healthz)."""
        return self.status is Status.FAILED and self.restarts

    @property
    def mark(self) -> str:
        """`[-]` fails liveness, `[!]` a failure that restarts nothing, `[~]` pending, `[+]` ok."""
        return "!" if self.status is Status.FAILED and not self.restarts else self.status.mark


Transition = Callable[[Check, Status], None]
NO_RESTART = "a plugin restart would not mend it"


class HealthState:
    """Every check of the sidecar by name, settled against the grace: what /healthz (liveness) and
    /readyz (readiness) answer, and each transition, told to `on_transition`."""

    def __init__(
        self,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_transition: Transition | None = None,
    ) -> None:
        self.grace = grace
        self.clock = clock
        self.wall = wall
        self.on_transition = on_transition
        self.checks: dict[str, Check] = {}
        self._failed: set[str] = set()  # failing liveness
        self._not_ok: set[str] = set()  # failed or pending: not ready

    def add(self, key: CheckKey | str, restarts: bool = True) -> None:
        """A check, pending until its first report. `restarts`: whether its failure can fail liveness
        before any report (a check never reported fails when the grace runs out)."""
        key = key if isinstance(key, CheckKey) else _parse_key(key)
        self.checks[key.name] = Check(
            key, Status.PENDING, "not probed yet", self.wall(), reset_at=self.clock(), restarts=restarts
        )
        self._not_ok.add(key.name)

    def report(
        self,
        name: str,
        ok: bool,
        reason: str = "",
        latency: float | None = None,
        *,
        definitive: bool = False,
        restarts: bool = True,
        quiet: str = "",
    ) -> None:
        """A probe's outcome. `definitive`: a failure no waiting can mend (another service on the
        socket, a file where a socket should be) fails at once, grace or not. `restarts`: whether
        this failure fails liveness; `quiet`: why not, where "a plugin restart would not mend it"
        is not the truth (another check already asks for the restart, the restart budget is spent)."""
        check = self.checks[name]
        check.last_ok = ok
        check.definitive = definitive and not ok
        check.restarts = restarts
        check.quiet = "" if restarts else quiet
        if latency is not None:
            check.latency = latency
        if ok:
            check.passed_since_reset = True
        self._settle(check, reason)

    def reset(self, names: Iterable[str]) -> None:
        """An event that restarts registration (kubelet restart, new plugin socket): grace starts again,
        and what was known before it is no answer after it: pending until the next report."""
        now = self.clock()
        for name in names:
            check = self.checks[name]
            if check.judged_elsewhere:
                continue
            check.passed_since_reset = False
            check.reset_at = now
            if check.last_ok:
                check.last_ok = False
                check.definitive = False
                self._settle(check, f"re-checking after a restart (was: {check.reason})")
            else:
                self._settle(check, check.reason)

    def assign(
        self, name: str, status: Status, reason: str, *, restarts: bool = True, latency: float | None = None
    ) -> None:
        """A verdict judged elsewhere, with its own graces (sidecar.dra.verdicts): taken as it is, never
        failed by this state's grace."""
        check = self.checks[name]
        check.judged_elsewhere = True
        check.last_ok = status is Status.OK
        check.passed_since_reset = check.passed_since_reset or check.last_ok
        check.restarts = restarts
        if latency is not None:
            check.latency = latency
        self._set(check, status, reason)

    def refresh(self) -> float | None:
        """Fail the pending checks whose grace ran out; the next moment one will, if any (monotonic)."""
        deadlines = []
        for check in self.checks.values():
            if check.judged_elsewhere:
                continue
            if check.status is Status.PENDING:
                self._settle(check, check.reason)
            if check.status is Status.PENDING:
                deadlines.append(check.reset_at + self.grace)
        return min(deadlines, default=None)

    def grace_left(self, check: Check) -> float:
        """Seconds of grace left since the check's last reset (0 once it ran out)."""
        return max(0.0, check.reset_at + self.grace - self.clock())

    def healthy(self, exclude: Iterable[str] = ()) -> bool:
        """Liveness: no check (but the excluded ones) fails in a way a plugin restart mends."""
        if not self._failed:
            return True
        return not (self._failed - set(exclude))

    def all_ok(self, exclude: Iterable[str] = ()) -> bool:
        """Readiness: every check (but the excluded ones) passes; pending ones do not."""
        if not self._not_ok:
            return True
        return not (self._not_ok - set(exclude))

    @property
    def failed(self) -> set[str]:
        """The checks that fail liveness."""
        return set(self._failed)

    @property
    def not_ok(self) -> set[str]:
        """The checks that fail readiness: failed or pending."""
        return set(self._not_ok)

    def _settle(self, check: Check, reason: str) -> None:
        if check.last_ok:
            status = Status.OK
        elif (
            not check.definitive
            and not check.passed_since_reset
            and self.clock() - check.reset_at < self.grace
        ):
            status = Status.PENDING
        elif check.last_ok is None:
            status, reason = Status.FAILED, "no probe answered within the registration grace"
        else:
            status = Status.FAILED
        self._set(check, status, reason)

    def _set(self, check: Check, status: Status, reason: str) -> None:
        old, was_live = check.status, check.name in self._failed
        check.reason = reason
        check.status = status
        if check.live_failed:
            self._failed.add(check.name)
        else:
            self._failed.discard(check.name)
        if status is Status.OK:
            self._not_ok.discard(check.name)
        else:
            self._not_ok.add(check.name)
        if status is not old or check.live_failed != was_live:
            if status is not old:
                check.since = self.wall()
            if self.on_transition is not None:
                self.on_transition(check, old)


def _parse_key(name: str) -> CheckKey:
    kind, _, resource = name.partition(":")
    return CheckKey(Kind(kind), resource)
