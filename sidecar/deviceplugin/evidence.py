"""What the device-plugin verdicts are given and give back: the settings they depend on, one round's
evidence, what the folder shows after a deletion, the listener the wiring publishes through, the
registration cycles, the verdict of whether the kubelet holds a plugin, and the readings of the
kubelet's records (the checkpoint, pod-resources) the rule families share.

Pure data and pure functions: no I/O, no clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from hami_guard.flags import ANY_DEVICES, DeviceExpectation, PluginSpec
from hami_guard.node.release import Release
from hami_guard.node.unixdiag import Owner
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.hamiconfig import Expectation
from sidecar.deviceplugin.naming import physical_devices
from sidecar.deviceplugin.probes import ProbeResult, Reading, SocketId
from sidecar.deviceplugin.recovery import NOT_READ, RecoveryEvidence
from sidecar.health import Check, Status

# The judge's log, one name whichever rule family speaks (operators filter on it).
logger = logging.getLogger("sidecar.deviceplugin.verdicts")


def accepted_devices(
    checkpoint: Checkpoint | None, resource: str, plugin: SocketId | None, kubelet: SocketId | None
) -> int | None:
    """Healthy physical devices the checkpoint lists for `resource`, if it was rewritten since both
    sockets were made (`plugin`, `kubelet`: the plugin's socket and kubelet.sock); else None."""
    if checkpoint is None or plugin is None or kubelet is None:
        return None
    devices = checkpoint.devices(resource)
    if devices is None or checkpoint.mtime_ns < max(plugin.mtime_ns, kubelet.mtime_ns):
        return None
    return len(physical_devices(devices, resource))


def unrecorded_connection(connections: int, checkpoint: Checkpoint | None, accepted: int | None) -> bool:
    """Connected, and no device list recorded since the plugin socket was made: no registration.

    A Register under way, or a dial the kubelet kept after refusing the Register (seen with the real
    kubelet in the state of kubernetes PR 139338). An unreadable checkpoint (None) cannot tell.
    `accepted` is `accepted_devices()`.
    """
    return connections > 0 and checkpoint is not None and accepted is None


def not_held_reason(
    checkpoint: Reading[Checkpoint], resource: str, plugin: SocketId | None, connected_since: float | None
) -> str:
    """Why the plugin is not registered, as the checkpoint's history tells it (`connected_since`: wall
    time the kubelet was last seen holding it, None when never)."""
    cp = checkpoint.value
    if cp is None:
        return f"not registered ({checkpoint.error})"
    if cp.devices(resource) is None:
        if connected_since is not None:  # the kubelet dropped the resource (its stop grace ran out)
            return (
                f"not registered since {iso(connected_since)} (the kubelet's checkpoint no longer lists "
                f"{resource})"
            )
        return f"never registered (the kubelet's checkpoint does not list {resource})"
    if plugin is not None and cp.mtime_ns < plugin.mtime_ns:
        return "not registered since the plugin socket was created"
    return "not registered now (the kubelet's checkpoint shows an earlier acceptance)"


# The newest release whose rules the verdicts know: an unknown kubelet is judged by them.
NEWEST_RULES = (1, 37)


@dataclass(frozen=True)
class KubeletRules:
    """The kubelet behaviour that differs between releases where the evidence cannot tell which
    (docs/kubelet.md#second-register): the release read, or why none was, and the rules that follow."""

    version: str  # "v1.37.2" as read or set; "" when unknown
    source: str  # where it was read, or why it was not
    # 1.37 refuses a second Register on a path the kubelet holds (`device plugin already connected`);
    # up to 1.36 the new client replaces the old.
    refuses_second_register: bool = True

    @property
    def name(self) -> str:
        """The rules in force, as /status says them."""
        if not self.version:
            return f"{NEWEST_RULES[0]}.{NEWEST_RULES[1]} (the newest known: the release is unknown)"
        return f"{NEWEST_RULES[0]}.{NEWEST_RULES[1]}" if self.refuses_second_register else "1.30-1.36"

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version or None, "source": self.source, "rules": self.name}


def kubelet_rules(release: Release | str) -> KubeletRules:
    """The rules of a release as read (`hami_guard.node.release`), or of the newest known when it is
    not known (a string: why)."""
    if isinstance(release, str):
        return KubeletRules("", release)
    return KubeletRules(release.version, release.source, release.minor >= NEWEST_RULES)


NEWEST = KubeletRules("", "not read")


@dataclass(frozen=True)
class Rules:
    """The settings the verdicts depend on."""

    plugins: tuple[PluginSpec, ...]
    grace: float
    kubelet_socket: str = "kubelet.sock"
    # At least one healthy device (ANY), N, none (OFF), or the host's devices HAMi registers (AUTO)
    expect_devices: DeviceExpectation = ANY_DEVICES
    device_glob: str = ""
    drop_confirm: float = 0.2  # a lost connection must stay lost this long to be a drop
    # A later connection must stay unrecorded this long to be a refused Register (sidecar.config).
    refusal_confirm: float = 10.0
    # HAMi serves a new socket at once when kubelet.sock is created: a plugin that served none this long
    # after a new kubelet answered missed the restart. 0: not HAMi's behaviour, the grace alone decides.
    missed_restart_after: float = 5.0
    # Devices not listed healthy this long while held are re-read by one plugin restart (recovery.py);
    # 0: off, no `recover:` check.
    recover_unhealthy_after: float = 0.0


@dataclass(frozen=True)
class PluginEvidence:
    """One probe round's view of one plugin: the probe of its socket, the socket file after it, and the
    kubelet's connections to the listener serving that file."""

    probe: ProbeResult
    # The socket file right after the probe (replaced while probed?); where it is gone while its
    # listener still holds the kubelet's connections, the file that listener bound.
    identity_after: SocketId | None
    connections: Reading[int]  # the kubelet's open connections to the listener of that file
    # Whose listener serves the file: "elsewhere" is another device plugin (not this pod's).
    owner: Owner = "unknown"
    owner_reason: str = ""
    # Which connections those are (the kubelet's sockets' inodes), where the reader tells them apart.
    connection_ids: frozenset[int] | None = None


@dataclass(frozen=True)
class RoundEvidence:
    """One probe round's observations of the node: kubelet.sock, each plugin's socket, the kubelet's
    checkpoint and pod-resources, and the host's devices."""

    kubelet: ProbeResult
    plugins: Mapping[str, PluginEvidence]  # by resource
    checkpoint: Reading[Checkpoint]
    pod_resources: Reading[dict[str, frozenset[str]]]  # healthy device IDs by resource
    host_devices: int | None = None
    generation: int | None = None  # DevicePluginJudge.generation when the round began (None: current)
    # auto's expectation (the host's devices less HAMi's filtered ones); None: `host_devices` stands
    expectation: Expectation | None = None
    # Other sockets served in the folder (name, identity), read while a plugin's own socket is missing.
    others: tuple[tuple[str, SocketId], ...] = ()
    # The checkpoint's mtime_ns read just before the kubelet's connections were (None: not read): a
    # connection the next round sees first came after it, and so does any record of it.
    checkpoint_before: int | None = None
    kubelet_rules: KubeletRules = NEWEST
    # What the recovery of unhealthy devices reads besides (pod-resources List, the host's GPUs).
    recovery: RecoveryEvidence = NOT_READ


@dataclass(frozen=True)
class AfterDeletion:
    """What the folder shows a moment after a plugin socket was deleted."""

    plugin: SocketId | None  # the plugin socket now (back already?)
    kubelet: SocketId | None  # kubelet.sock now
    kubelet_refuses: bool  # kubelet.sock is a dead file
    # A listener bound to the deleted file still exists in the plugin's network namespace (sock_diag):
    # the plugin still serves and someone else removed its file. None: cannot be told.
    listening: bool | None = None


class Listener(Protocol):
    """What the wiring publishes (metrics, logs) as the verdicts change."""

    def attempt_opened(self, resource: str) -> None:
        """A registration cycle opened (a new plugin socket, a kubelet restart)."""

    def attempt_closed(self, resource: str, latency: float | None) -> None:
        """A registration cycle closed: registered after `latency` seconds, or (None) not within the
        grace."""

    def kubelet_restarted(self) -> None:
        """A restart (or stop) of a kubelet seen answering before."""

    def transition(self, check: Check, old: Status) -> None:
        """A check changed status, or whether it fails liveness."""

    def restart_requested(self, resource: str) -> None:
        """Liveness failed for the plugin: a restart of it is asked for (the livenessProbe's)."""

    def budget(self, resource: str, spent: bool) -> None:
        """The plugin's restart budget took effect as spent, or was restored."""

    def devices(self, resource: str, counts: Mapping[str, int]) -> None:
        """The healthy physical devices counted this round, by source (only current counts)."""

    def connected(self, resource: str, count: int | None) -> None:
        """The kubelet's open connections to the plugin's socket; None: not known."""

    def recovery(self, resource: str, event: str, count: int) -> None:
        """The recovery of unhealthy devices: `restart` (a plugin restart asked for `count` devices),
        `recovered` (`count` devices listed healthy again after it), `unrecoverable` (now `count`
        devices unhealthy again after their restart, not listed healthy)."""


@dataclass
class Attempt:
    """A registration cycle: from a new plugin socket or a kubelet restart until the kubelet holds the
    plugin and has recorded its device list (the checkpoint or pod-resources), or `registered:` fails."""

    resource: str
    cause: str
    opened_wall: float
    opened: float  # monotonic
    outcome: str = "open"  # open | registered | not registered within the grace
    latency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """As /status shows it."""
        return {
            "resource": self.resource,
            "cause": self.cause,
            "opened": iso(self.opened_wall),
            "outcome": self.outcome,
            "latency_seconds": self.latency,
        }


def iso(ts: float) -> str:
    """A wall-clock time as UTC ISO 8601, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class Pair(NamedTuple):
    """The plugin's socket file and kubelet.sock as one round saw them: a registration holds for a pair."""

    plugin: SocketId | None
    kubelet: SocketId | None


@dataclass(frozen=True)
class Held:
    """Whether the kubelet holds the plugin now: the `registered:` verdict of one round."""

    held: bool | None  # None: a lost connection, or newer evidence against a held one, awaits confirmation
    why: str = ""
    definitive: bool = False  # no waiting mends it: it fails at once, grace or not
    mends: bool = True  # a plugin restart can register it again


UNCONFIRMED = Held(None)  # judged again once the confirmation is due (`wake_at`)


def endpoint_alive(r: str, seen: RoundEvidence) -> bool | None:
    """Does the kubelet keep the resource's endpoint? Yes where pod-resources lists healthy devices
    of it; no where it lists none that the checkpoint records healthy (a kubelet that drops a plugin
    marks its devices unhealthy itself and does not rewrite the checkpoint, rule 1.3); None where
    it cannot be told: pod-resources unread, or no device recorded healthy (the plugin may have
    reported them all unhealthy itself)."""
    live = seen.pod_resources.value
    if live is None:
        return None
    if physical_devices(live.get(r, ()), r):
        return True
    cp = seen.checkpoint.value
    return False if cp is not None and cp.devices(r) else None
