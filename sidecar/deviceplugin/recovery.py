"""Devices HAMi can never mark healthy again, brought back by one plugin restart (--recover-unhealthy-after).

HAMi's device plugin marks a device Unhealthy on an XID event and never marks it Healthy again
(Project-HAMi/HAMi, `ListAndWatch`: where upstream, the vendor profile's `sources`, unhealthy). A
restart of the plugin re-reads every device and lists it Healthy unless it fails again: after a
transient XID the GPU is back. This module decides, pure and clock-injected, when liveness asks for
that restart and when it stops asking (docs/design.md#liveness); `sidecar.deviceplugin.devices` feeds
it each round and reports its verdict as the `recover:<resource>` check.

- *Unhealthy*: a physical device the kubelet listed healthy for the resource since the plugin's socket
  was served (pod-resources `GetAllocatableResources`, which lists healthy devices only, as the
  checkpoint records them) and has not listed healthy for `after` seconds while it holds the plugin,
  and the host still shows: its driver lists its UUID (an ID that is no GPU UUID, or a driver
  that cannot be read: the host shows at least as many `--device-glob` nodes as the devices the kubelet
  listed). A device the host no longer shows was *removed*: no restart brings it back.
- A restart is asked for (the check fails liveness) only while no running pod holds a device not listed
  healthy (pod-resources `List`, read this round): a pod's GPU is never taken by a restart.
- One restart per device: a device not listed healthy again, `after` seconds long, after the plugin
  restart that re-read it is really unhealthy, and no restart is asked for it again. A restart after
  which a device stayed unhealthy is one in vain; after `budget` of them none is asked at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hami_guard import profiles
from sidecar.deviceplugin.probes import Reading

logger = logging.getLogger(__name__)

SHOWN = 4  # devices named in one reason


@dataclass(frozen=True)
class RecoveryEvidence:
    """What a round reads for the recovery, besides the kubelet's healthy devices."""

    # Per resource: each device ID a running pod's container holds, and that pod (`namespace/name`).
    pod_devices: Reading[dict[str, dict[str, str]]]
    driver_uuids: Reading[frozenset[str]]  # the GPUs' UUIDs their driver lists
    device_nodes: int | None = None  # `--device-glob` matches; None: not read


NOT_READ = RecoveryEvidence(Reading.failed("not read"), Reading.failed("not read"))


@dataclass(frozen=True)
class RecoveryVerdict:
    """The `recover:` check of one round, and what the wiring publishes (`Listener.recovery`)."""

    ok: bool
    reason: str
    restarts: bool = False  # the failure asks for a plugin restart (fails liveness)
    quiet: str = ""  # why a failure asks for none
    events: tuple[tuple[str, int], ...] = ()  # (restart | recovered | unrecoverable, count)


@dataclass
class _Due:
    """The devices not listed healthy for the duration, sorted by what the host and the past say."""

    devices: list[str]
    candidates: list[str] = field(default_factory=list)  # a restart may bring them back
    again: list[str] = field(default_factory=list)  # unhealthy again after the restart that re-read them
    unknown: list[str] = field(default_factory=list)  # the host's devices cannot be read
    removed: list[str] = field(default_factory=list)  # the host no longer shows them


def _names(devices: Iterable[str]) -> str:
    shown = sorted(devices)
    text = ", ".join(shown[:SHOWN])
    return text + (f" and {len(shown) - SHOWN} more" if len(shown) > SHOWN else "")


class DeviceRecovery:
    """One plugin's devices the kubelet stopped listing healthy, and the restarts asked for them."""

    def __init__(self, resource: str, after: float, budget: int, iso: Callable[[float], str]) -> None:
        self.resource = resource
        self.vendor = profiles.for_resource(resource) or profiles.DEFAULT  # its IDs, its driver
        self.after = after
        self.budget = budget
        self._iso = iso
        self._seen: set[str] = set()  # listed healthy since the plugin's socket was served
        self._missing: dict[str, tuple[float, float]] = {}  # not listed healthy since (monotonic, wall)
        self._asked: frozenset[str] = frozenset()  # the restart liveness asks for now is for these
        self._restarted: dict[str, int] = {}  # device -> the restart (its number) that re-read it
        self._awaiting: set[str] = set()  # of the last restart, not yet listed healthy since
        self.restarts = 0
        self.last_restart: float | None = None  # wall
        self.recovered: dict[str, float] = {}  # device -> wall, listed healthy after its restart
        self.given_up: dict[str, float] = {}  # device -> wall: unhealthy again after its restart
        self._vain: set[int] = set()  # restarts after which a device stayed unhealthy
        self._unrecoverable = 0  # given-up devices not listed healthy, as last published

    @property
    def budget_spent(self) -> bool:
        return len(self._vain) >= self.budget

    def restarted(self, wall: float) -> None:
        """A new plugin socket: the plugin (re)started and re-reads every device. The restart asked for,
        if any, happened; the devices not listed healthy are judged afresh against the new list."""
        if self._asked:
            self.restarts += 1
            self.last_restart = wall
            for d in self._asked:
                self._restarted[d] = self.restarts
            self._awaiting = set(self._asked)
        # What the new plugin lists is judged anew: only the devices it should bring back stay tracked
        # before it lists them (a device it never lists would otherwise go unseen), never one it no
        # longer lists for another reason before it was ever missed (a filter set since).
        self._seen = self._awaiting | set(self.given_up) | set(self._missing)
        self._missing.clear()
        self._asked = frozenset()

    def judge(
        self,
        listed: frozenset[str] | None,
        why_not: str,
        ev: RecoveryEvidence,
        held: Mapping[str, str] | None,
        *,
        now: float,
        wall: float,
    ) -> RecoveryVerdict:
        """One round: `listed`, the physical devices the kubelet lists healthy now (pod-resources);
        `why_not`, why the devices cannot be judged this round ("" when they can: the kubelet holds
        the plugin and pod-resources was read); `held`, the physical devices of the resource running
        pods hold, and which pod (None: pod-resources List could not be read, `ev.pod_devices` says
        why)."""
        events: list[tuple[str, int]] = []
        if why_not or listed is None:
            # Devices not listed while the plugin is not held say nothing of their health. A restart asked
            # for stays asked for: the plugin going down is that restart under way (its new socket ends it).
            self._missing.clear()
            return RecoveryVerdict(True, f"not judged: {why_not or 'no list of healthy devices'}")
        self._count_back(listed, wall, events)
        missing, due = self._due(listed, ev, now=now, wall=wall)
        candidates, again = due.candidates, due.again
        self._give_up(again, wall)
        unrecoverable = len(missing & set(self.given_up))
        if unrecoverable != self._unrecoverable:
            self._unrecoverable = unrecoverable
            events.append(("unrecoverable", unrecoverable))
        blocked = self._blocked(missing, ev, held) if candidates else ""
        if candidates and not blocked:
            if not self._asked:
                events.append(("restart", len(candidates)))
                logger.warning(
                    "%s: %s not listed healthy for %gs while the host still shows them and no pod holds "
                    "them: a plugin restart is asked for to re-read them",
                    self.resource,
                    _names(candidates),
                    self.after,
                )
            self._asked = frozenset(candidates)
            return RecoveryVerdict(
                False,
                f"{self._since(candidates)}, while the kubelet holds the plugin and "
                f"{self._host_says(candidates, ev)}: HAMi never marks a device healthy again, and a plugin "
                "restart re-reads it (one restart per device; no running pod holds a device not listed "
                "healthy)",
                restarts=True,
                events=tuple(events),
            )
        self._asked = frozenset()
        return self._quiet_verdict(missing, due, blocked, ev, now=now, events=tuple(events))

    def _count_back(self, listed: frozenset[str], wall: float, events: list[tuple[str, int]]) -> None:
        """Devices a restart was asked for that are listed healthy again: recovered."""
        back = self._awaiting & listed
        if back:
            for d in back:
                self.recovered[d] = wall
            self._awaiting -= back
            events.append(("recovered", len(back)))
            logger.info(
                "%s: the plugin restart brought %s back: listed healthy again", self.resource, _names(back)
            )

    def _due(
        self, listed: frozenset[str], ev: RecoveryEvidence, *, now: float, wall: float
    ) -> tuple[set[str], _Due]:
        """The devices seen before and not listed healthy now, and those of them missing for the duration,
        sorted by what the host says of each."""
        self._seen |= listed
        missing = self._seen - listed
        for d in set(self._missing) - missing:
            del self._missing[d]
        for d in missing:
            self._missing.setdefault(d, (now, wall))
        due = _Due(sorted(d for d in missing if now - self._missing[d][0] >= self.after))
        for d in due.devices:
            host = self._on_host(d, ev)
            if host is False:
                due.removed.append(d)
            elif host is None:
                due.unknown.append(d)
            elif d in self._restarted:
                due.again.append(d)
            else:
                due.candidates.append(d)
        return missing, due

    def _quiet_verdict(
        self,
        missing: set[str],
        due: _Due,
        blocked: str,
        ev: RecoveryEvidence,
        *,
        now: float,
        events: tuple[tuple[str, int], ...],
    ) -> RecoveryVerdict:
        """No restart asked: why, the first that applies failing readiness (a device that needs a person)."""
        candidates, again, unknown, removed = due.candidates, due.again, due.unknown, due.removed
        notes = []
        if removed:
            notes.append(
                f"{_names(removed)} not listed healthy and {self._host_says(removed, ev)}: removed, not "
                "unhealthy; no restart brings a device the host lost back"
            )
        waiting = sorted(missing - set(due.devices))
        if waiting:
            left = max(0.0, self.after - (now - min(self._missing[d][0] for d in waiting)))
            notes.append(
                f"{self._since(waiting)}: a plugin restart is asked for if they stay so {self.after:g}s "
                f"({left:.0f}s left)"
            )
        back = set(self.recovered) - set(self.given_up)  # a GPU brought back and lost again is not
        if back:
            notes.append(f"brought back by a plugin restart: {_names(back)}")
        if candidates:
            why = blocked
            host = self._host_says(candidates, ev)
            reason = f"{self._since(candidates)}, and {host}: no restart: {blocked}"
        elif again:
            why = (
                "the GPU is really unhealthy: it failed again after the plugin restart that re-read it; no "
                "more restarts for it"
            )
            reason = (
                f"{_names(again)} unhealthy again after the plugin restart that re-read "
                f"{'it' if len(again) == 1 else 'them'}: the GPU is really unhealthy "
                f"({self.vendor.devices.check}); no more restarts for it"
            )
        elif unknown:
            why = "the host's devices cannot be read: unhealthy cannot be told from removed"
            reason = (
                f"{self._since(unknown)}, and {self._host_says(unknown, ev)}: unhealthy cannot be told from "
                "removed, so no restart"
            )
        else:
            text = "; ".join(notes) or "every device the kubelet listed healthy is listed healthy"
            return RecoveryVerdict(True, text, events=events)
        return RecoveryVerdict(False, "; ".join([reason, *notes]), quiet=why, events=events)

    def _give_up(self, again: list[str], wall: float) -> None:
        """Devices unhealthy again after the restart that re-read them: really unhealthy."""
        for d in again:
            if d in self.given_up:
                continue
            self.given_up[d] = wall
            self._awaiting.discard(d)
            self._vain.add(self._restarted[d])
            logger.warning(
                "%s: %s unhealthy again after the plugin restart that re-read it: the GPU is really "
                "unhealthy; no more restarts for it",
                self.resource,
                d,
            )

    def _blocked(self, missing: set[str], ev: RecoveryEvidence, held: Mapping[str, str] | None) -> str:
        """Why no restart may be asked for now, or ""."""
        if self.budget_spent:
            return (
                f"restart budget spent: {len(self._vain)} plugin restarts were followed by a device "
                "unhealthy again"
            )
        if held is None:
            return (
                f"pod-resources List cannot be read ({ev.pod_devices.error}): no restart while it cannot "
                "be told that no running pod holds them"
            )
        taken = {d: pod for d, pod in held.items() if d in missing}
        if taken:
            who = "; ".join(f"{d} by {taken[d]}" for d in sorted(taken)[:SHOWN])
            return f"a running pod holds a device not listed healthy ({who}): a restart waits until none does"
        return ""

    def _on_host(self, device: str, ev: RecoveryEvidence) -> bool | None:
        """Does the host still show the device? None: it cannot be told."""
        uuids = ev.driver_uuids.value
        if self.vendor.is_device(device) and uuids:
            return device.lower() in {u.lower() for u in uuids}
        if ev.device_nodes is None:
            return None
        return ev.device_nodes >= len(self._seen)

    def _host_says(self, devices: list[str], ev: RecoveryEvidence) -> str:
        uuids = ev.driver_uuids.value
        if all(self.vendor.is_device(d) for d in devices) and uuids:
            shown = [d for d in devices if d.lower() in {u.lower() for u in uuids}]
            return (
                f"the {self.vendor.vendor} driver still lists them"
                if len(shown) == len(devices)
                else f"the {self.vendor.vendor} driver no longer lists them"
            )
        if ev.device_nodes is None:
            return f"the host's devices cannot be read (the driver: {ev.driver_uuids.error or 'no GPU'})"
        return f"the host shows {ev.device_nodes} device node(s) for the {len(self._seen)} device(s) listed"

    def _since(self, devices: list[str]) -> str:
        first = min(self._missing[d][1] for d in devices)
        return f"{_names(devices)} not listed healthy since {self._iso(first)}"

    def as_dict(self) -> dict[str, Any]:
        """For /status."""
        return {
            "after_seconds": self.after,
            "not_listed_healthy": {d: self._iso(w) for d, (_, w) in sorted(self._missing.items())},
            "restart_asked_for": sorted(self._asked),
            "restarts": self.restarts,
            "last_restart": self._iso(self.last_restart) if self.last_restart is not None else None,
            "awaiting": sorted(self._awaiting),
            "recovered": {d: self._iso(w) for d, w in sorted(self.recovered.items())},
            "really_unhealthy": {d: self._iso(w) for d, w in sorted(self.given_up.items())},
            "restarts_in_vain": len(self._vain),
            "restart_budget_spent": self.budget_spent,
        }
