"""The health vocabulary: checks, their status, transitions and the registration grace.

Pure and clock-injected: probes and events report outcomes here; the HTTP views
and the metrics only read. Grace (SPEC.md): a check that has not passed since the
last event that resets it is *pending*, not failed, until the grace has run out.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    PENDING = "pending"

    @property
    def up(self) -> float:
        """The value of `device_plugin_check_up`."""
        return {Status.OK: 1.0, Status.FAILED: 0.0, Status.PENDING: 0.5}[self]

    @property
    def mark(self) -> str:
        return {Status.OK: "+", Status.FAILED: "-", Status.PENDING: "~"}[self]


@dataclass
class Check:
    name: str
    status: Status
    reason: str
    since: float  # wall clock of the last transition
    latency: float | None = None  # of the last probe, seconds
    last_ok: bool | None = None  # the last raw outcome; None before the first
    definitive: bool = False
    passed_since_reset: bool = False
    reset_at: float = 0.0  # monotonic


Transition = Callable[[Check, Status], None]


class HealthState:
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
        self._failed: set[str] = set()

    def add(self, name: str) -> None:
        self.checks[name] = Check(name, Status.PENDING, "not probed yet", self.wall(), reset_at=self.clock())

    def report(
        self, name: str, ok: bool, reason: str = "", latency: float | None = None, definitive: bool = False
    ) -> None:
        """A probe's outcome. `definitive`: a failure no waiting can mend (another service on the
        socket, a file where a socket should be) fails at once, grace or not."""
        check = self.checks[name]
        check.last_ok = ok
        check.definitive = definitive and not ok
        if latency is not None:
            check.latency = latency
        if ok:
            check.passed_since_reset = True
        self._settle(check, reason)

    def reset(self, names: Iterable[str]) -> None:
        """An event that restarts registration (kubelet restart, new plugin socket): grace starts again."""
        now = self.clock()
        for name in names:
            check = self.checks[name]
            check.passed_since_reset = False
            check.reset_at = now
            self._settle(check, check.reason)

    def refresh(self) -> float | None:
        """Fail the pending checks whose grace ran out; the next moment one will, if any (monotonic)."""
        deadlines = []
        for check in self.checks.values():
            if check.status is Status.PENDING:
                self._settle(check, check.reason)
            if check.status is Status.PENDING:
                deadlines.append(check.reset_at + self.grace)
        return min(deadlines, default=None)

    def grace_left(self, check: Check) -> float:
        return max(0.0, check.reset_at + self.grace - self.clock())

    def healthy(self, exclude: Iterable[str] = ()) -> bool:
        """True when no check (but the excluded ones) has failed: pending ones pass."""
        if not self._failed:
            return True
        return not (self._failed - set(exclude))

    @property
    def failed(self) -> set[str]:
        return set(self._failed)

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
        old = check.status
        check.reason = reason
        if status is not old:
            check.status = status
            check.since = self.wall()
            if status is Status.FAILED:
                self._failed.add(check.name)
            else:
                self._failed.discard(check.name)
            if self.on_transition is not None:
                self.on_transition(check, old)
