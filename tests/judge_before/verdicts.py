"""Registration truth, and what a plugin restart would mend: every verdict of the sidecar, pure.

Inputs are observations (folder events, probe results, the kubelet's connections, pod-resources,
the checkpoint); outputs are the checks of a `HealthState` and the registration cycles. No I/O and
no sleeping here: `sidecar.deviceplugin.watch` gathers the observations and calls in; the clock is injected.
The kubelet behaviour each rule rests on is in docs/kubelet.md (#registration, #kubelet-restart,
#stream-end, #checkpoint, #live-connection, #known-bugs); the rules in docs/design.md.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from hami_guard.flags import ANY_DEVICES, DeviceExpectation, Expect, PluginSpec
from hami_guard.node.release import Release
from hami_guard.node.unixdiag import Owner
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.hamiconfig import Expectation
from sidecar.deviceplugin.probes import ProbeResult, Reading, SocketId
from sidecar.deviceplugin.recovery import NOT_READ, DeviceRecovery, RecoveryEvidence
from sidecar.health import Check, CheckKey, HealthState, Kind, Status

logger = logging.getLogger(__name__)

# Liveness failure episodes whose plugin restarts did not help, before giving up: "not registered", and a
# plugin socket that never came back (a plugin serving under another name).
RESTART_BUDGET = 3
# How long a socket a round saw before its creation event waits for that event (the observer holds
# every event behind a move up to 0.5 s). Past it the event is taken as lost (an inotify overflow,
# the polling observer): events are read as they come again.
EVENT_LAG = 2.0
# HAMi's socket for resource `nvidia.com/<name>` is `nvidia-<name>.sock` (getPluginSocketPath,
# pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go in Project-HAMi/HAMi).
_HAMI_SOCKET = re.compile(r"^nvidia-([A-Za-z0-9][A-Za-z0-9._-]{0,62})\.sock$")
# HAMi advertises each GPU as `<GPU-UUID>-<n>`; NVIDIA's time-slicing as `<id>::<n>`.
_HAMI_SPLIT = re.compile(r"^(GPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})-\d+$")
_REPLICA = re.compile(r"^(.+)::\d+$")


def physical_devices(ids: Iterable[str]) -> set[str]:
    """Devices as a user counts them: HAMi's split IDs and time-slicing replicas once per GPU.

    Only those two forms are folded: other vendors' IDs may end in `-<n>` for distinct devices.
    """
    return {physical_device(device) for device in ids}


def physical_device(device: str) -> str:
    """The physical device of one ID: a HAMi split ID's GPU, a time-slicing replica's device."""
    m = _HAMI_SPLIT.match(device) or _REPLICA.match(device)
    return m.group(1) if m else device


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
    return len(physical_devices(devices))


def unrecorded_connection(connections: int, checkpoint: Checkpoint | None, accepted: int | None) -> bool:
    """Connected, and no device list recorded since the plugin socket was made: no registration.

    A Register under way, or a dial the kubelet kept after refusing the Register (seen with the real
    kubelet in the state of kubernetes PR 139338). An unreadable checkpoint (None) cannot tell.
    `accepted` is `accepted_devices()`.
    """
    return connections > 0 and checkpoint is not None and accepted is None


def hami_resource(socket: str) -> str | None:
    """The resource HAMi registers when it serves `socket` (`nvidia-vgpu.sock`: nvidia.com/vgpu)."""
    m = _HAMI_SOCKET.match(socket)
    return f"nvidia.com/{m.group(1)}" if m else None


def matching_plugins(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> tuple[PluginSpec, ...]:
    """The plugins setting with `plugin` replaced by the one serving `found` (a socket in the folder)."""
    resource = hami_resource(found) if plugin.resource.startswith("nvidia.com/") else None
    new = PluginSpec(resource or plugin.resource, found)
    return tuple(new if p == plugin else p for p in plugins)


def socket_found_instead(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> str:
    """What to say of a plugin whose socket is missing while `found` is served in the folder."""
    specs = matching_plugins(plugins, plugin, found)
    new = next(p for p in specs if p.socket == found)
    flags = " ".join(f"--plugin {p.resource}={p.socket}" for p in specs)
    env = ",".join(f"{p.resource}={p.socket}" for p in specs)
    hami = (
        f" (HAMi serves nvidia-<name>.sock for resourceName nvidia.com/<name>: {new.resource})"
        if new.resource != plugin.resource
        else ""
    )
    return (
        f"a device plugin serves {found} in the folder instead{hami}: the settings that match it are "
        f"{flags}, or HAMI_GUARD_PLUGIN={env}"
    )


def seen_others(p: _PluginState) -> list[tuple[str, SocketId]]:
    """The other sockets served in the folder last round, as (file name, identity), by name."""
    return sorted((p.others or {}).items())


def pick_found(plugin: PluginSpec, others: Iterable[str]) -> str | None:
    """Of the other sockets served in the folder, the one most likely this plugin's under another name."""
    names = sorted(others)
    domain = plugin.resource.partition("/")[0]
    same = [n for n in names if (hami_resource(n) or "").startswith(domain + "/")]
    return (same or names)[0] if names else None


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
    identity_after: SocketId | None  # the socket file right after the probe (replaced while probed?)
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


@dataclass
class _Conn:
    """One of the kubelet's connections to a held plugin's listener, as the rounds saw it come."""

    first_seen: float  # monotonic
    # The checkpoint's mtime_ns read before the last connection table that did not hold it (None: unknown)
    checkpoint_before: int | None
    recorded: bool  # the kubelet wrote a device list after it came: a Register it accepted
    refused: bool = False  # stayed unrecorded past its confirmation: a later write is another stream's
    # The connection that carried the registration when it came, while every table since has held it
    # too (None: none known, or it closed): 1.37 accepts a second Register only once that one is closed.
    alongside: int | None = None


class _Pair(NamedTuple):
    """The plugin's socket file and kubelet.sock as one round saw them: a registration holds for a pair."""

    plugin: SocketId | None
    kubelet: SocketId | None


@dataclass(frozen=True)
class _Held:
    """Whether the kubelet holds the plugin now: the `registered:` verdict of one round."""

    held: bool | None  # None: a lost connection, or newer evidence against a held one, awaits confirmation
    why: str = ""
    definitive: bool = False  # no waiting mends it: it fails at once, grace or not
    mends: bool = True  # a plugin restart can register it again


# After a refusal, once the stream the kubelet kept is gone: what pod-resources then shows, and the trap.
_PHANTOM = (
    ": pod-resources still lists its devices healthy with no stream behind them (Pods admitted to them "
    "fail in Allocate)"
)
_FORGOTTEN = (
    "the kubelet refused a second Register and dropped this plugin's client: the next plugin restart will "
    "not register until the kubelet restarts"
)

_UNCONFIRMED = _Held(None)  # judged again once the confirmation is due (`wake_at`)


class _Wanted(NamedTuple):
    """The minimum of healthy devices the devices check wants, and where it comes from."""

    minimum: int
    why: str


@dataclass(frozen=True)
class _Vanished:
    """The verdict on a plugin socket that vanished, kept while the socket stays missing."""

    verdict: str
    gone: bool  # the plugin stopped serving (not a kubelet restart's cleanup): it fails at once


@dataclass
class _PluginState:
    """What the verdicts remember of one plugin."""

    identity: SocketId | None = None  # its socket as last seen answering (or created)
    kubelet_then: SocketId | None = None  # kubelet.sock as last seen answering when `identity` was set
    known: bool = False  # seen at all since start
    judging: bool = False  # a deleted socket awaits its verdict
    # Since `identity` was set, its deletion's event (or a kubelet restart, which deletes every plugin
    # socket) was seen: a creation event handled once its file is gone is then a new socket's.
    unlinked: bool = False
    vanished: _Vanished | None = None  # a vanished socket's verdict
    connected_pair: _Pair | None = None  # seen held
    # Its socket judged held by this kubelet since its cycle opened, on evidence that names the socket
    # (`_names_socket`): a failed start's socket never was.
    held_this_cycle: bool = False
    # The first pair of sockets judged registered under the current kubelet, whatever the evidence: a
    # record of the resource's devices can be an earlier socket's where this kubelet held another one.
    first_held: _Pair | None = None
    connected_since: float | None = None  # wall
    # The connections of the held pair by inode, and which one carries the kubelet's registration.
    conns: dict[int, _Conn] = field(default_factory=dict)
    conns_pair: _Pair | None = None
    registered_conn: int | None = None
    refused: bool = False  # the kubelet refused a later Register of the held pair (1.37): until a new pair
    # A new pair's connection left unrecorded while the kubelet keeps an endpoint of the resource alive
    # (pod-resources lists it healthy): since when (monotonic), under rules that refuse a second Register.
    shadowed: tuple[_Pair, float] | None = None
    trap: str = ""  # this round: why the kubelet no longer keeps this plugin's client ("": it does)
    records_held: _Pair | None = None  # the pair pod-resources or the checkpoint last said is held
    # The last verdict of not held that the kubelet's connections gave (trustworthy), with its pair: an
    # unknown count keeps it, never upgrades it on the checkpoint alone.
    not_held: tuple[_Pair, _Held] | None = None
    contradicted_at: float | None = None  # monotonic: newer evidence first said the held pair is gone
    lost_at: float | None = None  # monotonic: the connection was first seen lost
    failed_at: float | None = None  # monotonic: a probe of the answering plugin first failed
    attempt: Attempt | None = None
    episode: bool = False  # failing liveness for "not registered" since the last plugin restart
    restarts_in_vain: int = 0
    budget_announced: bool = False  # logged and published once the spent budget took effect
    devices: dict[str, int] = field(default_factory=dict)
    # Its own socket answered, or was seen created, since start: a missing one is then a crash. A creation
    # is enough: a plugin that bound its own name serves under it, whether or not a probe caught it alive.
    served: bool = False
    # It created a socket since the last kubelet restart began: it heard the restart (HAMi's answer).
    since_restart: bool = False
    # Monotonic: a round saw the socket before its creation event, which is due until then. Events
    # come in order, so a deletion event before it is an older socket's.
    event_due: float | None = None
    others: dict[str, SocketId] | None = None  # other sockets served in the folder, last round
    found: str | None = None  # the socket it seems to serve instead of its own

    @property
    def budget_spent(self) -> bool:
        return self.restarts_in_vain >= RESTART_BUDGET


KUBELET = CheckKey(Kind.KUBELET)
CHECKPOINT = CheckKey(Kind.CHECKPOINT)


class DevicePluginJudge:
    """Whether the kubelet holds each configured device plugin, from the folder's events and each
    probe round: the checks `kubelet`, `checkpoint`, `plugin:`, `registered:` and `devices:`, the
    kubelet restarts, the registration cycles and each plugin's restart budget (docs/design.md)."""

    def __init__(
        self,
        rules: Rules,
        listener: Listener,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        self.listener = listener
        self.clock = clock
        self.wall = wall
        self.state = HealthState(rules.grace, clock, wall, self._on_transition)
        # Only the plugin's own checks can ever fail liveness (a plugin restart is their remedy).
        self.state.add(KUBELET, restarts=False)
        self.state.add(CHECKPOINT, restarts=False)
        self._plugins: dict[str, _PluginState] = {}
        for p in rules.plugins:
            for key in self._keys(p.resource):
                self.state.add(key, restarts=key.kind in (Kind.PLUGIN, Kind.REGISTERED))
            self._plugins[p.resource] = _PluginState()
        self._by_socket = {p.socket: p for p in rules.plugins}
        self.kubelet_restarts = 0
        self.history: deque[Attempt] = deque(maxlen=50)
        self.generation = 0  # kubelet restarts seen: a round begun before one is stale
        self._kubelet_down = False  # a kubelet restart is under way
        self._kubelet_back_at: float | None = None  # monotonic: a new kubelet answered after a restart
        self._starved = False  # this round's kubelet probe timed out too: the node (or we) are starved
        self._kubelet_id: SocketId | None = None  # kubelet.sock as last seen answering
        self._kubelet_recreated = False
        # The checkpoint's mtime_ns as the last round read it before its connections: a connection first
        # seen this round came after it.
        self._checkpoint_mtime: int | None = None
        self.kubelet_rules = NEWEST  # the rules of the kubelet's release, as the last round read it
        # Per resource, where --recover-unhealthy-after is on: its devices' recovery (recovery.py).
        self._recovery = {
            p.resource: DeviceRecovery(p.resource, rules.recover_unhealthy_after, RESTART_BUDGET, iso)
            for p in rules.plugins
            if rules.recover_unhealthy_after > 0
        }

    # -- what the views read ------------------------------------------------------------
    def plugin(self, socket: str) -> PluginSpec | None:
        """The configured plugin serving on `socket` (a file name in the folder), if any."""
        return self._by_socket.get(socket)

    def plugin_for(self, resource: str) -> PluginSpec:
        """The configured plugin of `resource`."""
        return next(p for p in self.rules.plugins if p.resource == resource)

    def devices(self) -> dict[str, dict[str, int]]:
        """Per resource: the healthy physical devices last counted, by source."""
        return {r: dict(p.devices) for r, p in self._plugins.items()}

    def registration(self) -> dict[str, dict[str, Any]]:
        """Per resource: connection, budget and the open cycle, for /status."""
        out = {}
        for r, p in self._plugins.items():
            out[r] = {
                "kubelet_connected_since": iso(p.connected_since) if p.connected_since else None,
                "restarts_without_registration": p.restarts_in_vain,
                "restart_budget_spent": p.budget_announced,
                "socket_found_instead": p.found,
                "open_attempt": p.attempt.as_dict() if p.attempt else None,
            }
        return out

    def recovery(self) -> dict[str, dict[str, Any]]:
        """Per resource: the devices not listed healthy, the restarts asked for them, their outcome."""
        return {r: rec.as_dict() for r, rec in self._recovery.items()}

    def wake_at(self) -> float | None:
        """When a round must run to confirm a lost connection, a failed probe, newer evidence against a
        held plugin or a refusal (monotonic), if one must."""
        drop, refusal, now = self.rules.drop_confirm, self.rules.refusal_confirm, self.clock()
        due = [t + drop for p in self._plugins.values() for t in (p.lost_at, p.failed_at) if t is not None]
        back, missed = self._kubelet_back_at, self.rules.missed_restart_after
        if back is not None and missed and any(not p.since_restart for p in self._plugins.values()):
            due += [back + missed] if back + missed > now else []
        for p in self._plugins.values():
            pending = [(p.contradicted_at, drop)]
            pending += [(c.first_seen, refusal) for c in p.conns.values() if not c.recorded and not c.refused]
            pending += [(p.shadowed[1], refusal)] if p.shadowed else []
            due += [t + wait for t, wait in pending if t is not None and t + wait > now]
        return min(due) if due else None

    def _keys(self, resource: str) -> list[CheckKey]:
        kinds = [Kind.PLUGIN, Kind.REGISTERED, Kind.KUBELET_CLIENT]
        if self.rules.expect_devices.kind is not Expect.OFF:  # an explicit 0 opts out
            kinds.append(Kind.DEVICES)
        if self.rules.recover_unhealthy_after > 0:
            kinds.append(Kind.RECOVER)
        return [CheckKey(k, resource) for k in kinds]

    def _names(self, resource: str) -> list[str]:
        return [k.name for k in self._keys(resource)]

    # -- folder events ------------------------------------------------------------------
    def folder_gone(self) -> None:
        """The device-plugins folder was removed: a kubelet restart (or stop) is under way."""
        self._kubelet_gone("the device-plugins folder was removed")

    def kubelet_socket_event(self, kind: str, current: SocketId | None) -> None:
        """kubelet.sock was deleted or created; `current` is the file there now.

        Events trail the files by a few ms: when kubelet.sock is the one last seen answering, the
        event is about an older file, and a probe has already judged the change.
        """
        if self._kubelet_id is not None and current == self._kubelet_id:
            return
        if kind == "deleted":
            self._kubelet_gone(f"{self.rules.kubelet_socket} was deleted")
        elif kind == "created":
            self._kubelet_recreated = True

    def _event_due(self, p: _PluginState) -> bool:
        """Whether the creation event of the socket a round saw first is still to come."""
        if p.event_due is not None and self.clock() >= p.event_due:
            p.event_due = None
        return p.event_due is not None

    def plugin_socket_created(self, resource: str, identity: SocketId | None) -> None:
        """The creation event of a plugin socket; `identity` is the file there now. An event that
        trails what a round saw opens no new cycle."""
        p = self._plugins[resource]
        if self._event_due(p):
            p.event_due = None
            if identity is None or identity == p.identity:
                # The event of the socket a round saw first (or of one before it that came and went):
                # that socket's cycle is open already, and its hold, if seen, stands.
                return
        if identity is not None and identity == p.identity and not p.judging:
            # Already accounted for: the event trails a probe that saw this socket first. (A socket
            # re-created within one timestamp tick can reuse the inode and the mtime: after a deletion,
            # `judging` tells it apart.)
            return
        if identity is None and p.identity is not None and not p.unlinked:
            # The creation event of the socket a probe saw first, handled once the file is gone again
            # (the observer holds events up to 0.5 s): no other socket came in between, as a new one is
            # bound only once the old file is unlinked, whose event comes first. Its deletion's event,
            # next, judges the socket's end.
            return
        self._new_socket(resource, identity)

    def _new_socket(self, resource: str, identity: SocketId | None) -> None:
        """A new plugin socket: a new registration cycle, whichever saw it first, event or probe."""
        p = self._plugins[resource]
        p.identity, p.kubelet_then, p.known, p.unlinked = identity, self._kubelet_id, True, False
        p.judging, p.vanished, p.lost_at, p.connected_pair = False, None, None, None
        p.held_this_cycle = False
        # HAMi's own answer to a kubelet restart, not a restart liveness asked for.
        p.since_restart = self.kubelet_restarts > 0 and not p.episode and not p.restarts_in_vain
        # Its own socket came: whatever serves elsewhere in the folder is no restart of this plugin, even
        # where it stopped before a round probed it, or before its event was handled (identity None: the
        # cycle above is opened on the event alone too).
        p.served, p.found = True, None
        if p.episode:  # the plugin restarted after liveness failed for "not registered"
            p.episode = False
            p.restarts_in_vain += 1
        if resource in self._recovery:  # it re-reads every device: a restart asked for them, or not
            self._recovery[resource].restarted(self.wall())
            # The restart asked for is under way: no longer asked, whatever the round before said.
            why = "the plugin serves a new socket: its devices are judged against its new list"
            self.state.report(CheckKey(Kind.RECOVER, resource).name, True, why, restarts=False)
        self.state.reset(self._names(resource))
        self._open_attempt(resource, "new plugin socket")

    def plugin_socket_deleted(self, resource: str) -> bool:
        """The deletion event of a plugin socket. True: the plugin's verdict is under way, and the
        caller observes, then calls `judge_vanished`. False: an older socket's event, handled after a
        round saw the next socket (whose creation event is still to come): nothing to judge."""
        p = self._plugins[resource]
        if self._event_due(p):
            return False
        p.judging = p.unlinked = True
        return True

    def end_judgement(self, resource: str) -> None:
        """The observation of a deleted socket ended (or failed): its verdict, if any, is in."""
        self._plugins[resource].judging = False

    def judge_vanished(self, resource: str, seen: AfterDeletion, restart_window_over: bool) -> bool:
        """A deleted plugin socket: a kubelet restart (pending) or the plugin gone (failed)?

        kubelet.sock tells: a kubelet restart leaves it gone, dead, or a new file; the plugin's own
        stop leaves the same kubelet.sock answering. A plugin that removed its socket to serve a new
        one (HAMi does on every kubelet.sock creation) gets until the restart window is over.
        Returns True when the verdict must wait for the window.
        """
        p = self._plugins[resource]
        if not p.judging:
            return False  # the socket is back already
        if seen.plugin is not None:
            self._new_socket(resource, seen.plugin)
            return False
        plugin = self.plugin_for(resource)
        restart = self._restart_removed(p, seen)
        if not restart and seen.listening and not restart_window_over:
            return True  # looked at again after the window: a stopping server unlinks before it closes
        if not restart and seen.listening:
            # The plugin did not stop: its listener is there, unlinked. Something else removed the file:
            # a kubelet restart's cleanup (kubelet.sock may still be the old one on a loaded node), or
            # a person. A plugin restart mends the latter only: pending for the grace, waiting for the
            # kubelet's word, never a crash.
            p.judging = False
            name = CheckKey(Kind.PLUGIN, resource).name
            verdict = (
                f"{plugin.socket} was removed while the plugin still listens on it (a kubelet restart "
                "removes every plugin socket before the new kubelet listens): waiting for kubelet.sock "
                "to tell; a plugin restart serves it again if no kubelet restart follows"
            )
            p.vanished = _Vanished(verdict, gone=False)
            self.state.reset([name])
            self.state.report(name, False, verdict, definitive=False, restarts=not self._kubelet_down)
            return False
        if not restart and not restart_window_over:
            return True
        p.judging = False
        name = CheckKey(Kind.PLUGIN, resource).name
        if not restart and self.rules.missed_restart_after and p.since_restart and not p.held_this_cycle:
            # The socket it served for the new kubelet went before the kubelet held it: HAMi's failed
            # start (its Register refused or failed), which it retries 30 s later by itself. Pending
            # for the grace, which covers that retry. Held, by its connections or by the records where
            # they cannot be read, it is a crash like any other.
            verdict = (
                f"{plugin.socket} came and went after the kubelet's restart before the kubelet held it: "
                "a failed start, which HAMi retries 30 s later by itself"
            )
            p.vanished = _Vanished(verdict, gone=False)
            self.state.reset([name])
            self.state.report(name, False, verdict, definitive=False, restarts=True)
            return False
        if restart:
            # A new kubelet.sock a probe has already seen answering is a restart already counted
            # (and its cycles opened): the removal is that restart's cleanup, not another one.
            if seen.kubelet_refuses or seen.kubelet is None or seen.kubelet != self._kubelet_id:
                self._kubelet_gone(f"{plugin.socket} was removed and {restart}")
            # The restart removed the socket: the plugin's checks wait for it again, even where a probe
            # saw the plugin answer between the restart's first sign and this removal.
            self.state.reset(self._names(resource))
            verdict = f"{plugin.socket} was removed by a kubelet restart; waiting for the plugin"
        else:
            verdict = (
                f"{plugin.socket} was removed while the kubelet kept running: the plugin stopped serving"
            )
        # A plugin gone is not a registration under way: it fails at once, grace or not.
        p.vanished = _Vanished(verdict, gone=not restart)
        self.state.report(name, False, verdict, definitive=not restart, restarts=not self._kubelet_down)
        return False

    def _restart_removed(self, p: _PluginState, seen: AfterDeletion) -> str:
        """Why a kubelet restart explains the plugin socket's removal, or "" (it does not).

        A new kubelet deletes the sockets before it listens: while it does, kubelet.sock is gone or a
        dead file. A plugin socket created after the kubelet.sock that answers now was not removed by
        that kubelet's cleanup, whatever else is under way.
        """
        name = self.rules.kubelet_socket
        if seen.kubelet is None:
            return f"{name} is gone"
        if seen.kubelet_refuses:
            return f"{name} refuses connections"
        if p.identity is not None and p.identity.mtime_ns >= seen.kubelet.mtime_ns:
            return ""
        if self._kubelet_down:
            return "a kubelet restart is under way"
        # The kubelet.sock of the plugin socket's time, not the last one probed: a probe may have
        # seen the new kubelet answer before this deletion's event was handled.
        then = p.kubelet_then or self._kubelet_id
        if then is not None and seen.kubelet != then:
            return f"{name} is a new file"
        return ""

    # -- kubelet restarts, registration cycles --------------------------------------------
    def _kubelet_gone(self, why: str) -> None:
        """A kubelet restart (or stop) is under way: every plugin must register again."""
        if self._kubelet_down:
            return
        self._kubelet_down = True
        self._kubelet_back_at = None
        self.generation += 1
        for p in self._plugins.values():
            p.since_restart = False
            # A kubelet restart ends a failure episode: the new socket HAMi then serves is not a
            # restart the livenessProbe asked for.
            p.lost_at, p.connected_pair, p.episode, p.unlinked = None, None, False, True
            p.held_this_cycle = False
        if self._kubelet_id is None:
            return  # never seen answering: nothing to restart from
        self.kubelet_restarts += 1
        self.listener.kubelet_restarted()
        logger.info("kubelet restart detected: %s", why)
        for r, p in self._plugins.items():
            # The restart budget `registered:` spent bounds plugin restarts against one kubelet: the
            # new one is a new chance, and a plugin that does not register with it (HAMi's own
            # failure) is mended by a restart again. Not the budget `plugin:` spent on a socket never
            # served (a renamed resourceName): no kubelet restart mends a setting.
            if p.served:
                self._restore_budget(r, "after a kubelet restart")
        self.state.reset(list(self.state.checks))
        for r in self._plugins:
            self._open_attempt(r, "kubelet restart")

    def _restore_budget(self, resource: str, why: str) -> None:
        p = self._plugins[resource]
        if not p.restarts_in_vain:
            return
        if p.budget_announced:
            logger.info("%s %s: the restart budget is restored", resource, why)
            self.listener.budget(resource, False)
        p.restarts_in_vain, p.budget_announced = 0, False

    def _open_attempt(self, resource: str, cause: str) -> None:
        p = self._plugins[resource]
        if p.attempt is not None:
            return  # an open cycle absorbs what follows: restart + new socket is one attempt
        p.attempt = Attempt(resource, cause, self.wall(), self.clock())
        self.history.append(p.attempt)
        self.listener.attempt_opened(resource)

    def _close_attempt(self, resource: str, registered: bool) -> None:
        p = self._plugins[resource]
        attempt, p.attempt = p.attempt, None
        if attempt is None:
            return
        if registered:
            attempt.outcome = "registered"
            attempt.latency = max(0.0, self.clock() - attempt.opened)
            self.listener.attempt_closed(resource, attempt.latency)
        else:
            attempt.outcome = "not registered within the grace"
            self.listener.attempt_closed(resource, None)

    # -- probe rounds -------------------------------------------------------------------------
    def round(self, seen: RoundEvidence) -> list[str]:
        """Judge one probe round; returns the resources whose socket vanished unannounced (the caller
        observes the folder and calls `judge_vanished` for each).

        A round begun before a kubelet restart was seen (an event's verdict landed while it probed) is
        dropped: its kubelet answered before the restart, and the event has asked for a new round.
        """
        if seen.generation not in (None, self.generation):
            return []
        self.kubelet_rules = seen.kubelet_rules
        self._starved = seen.kubelet.state == "timeout"
        self._judge_kubelet(seen.kubelet)
        self._judge_checkpoint(seen.checkpoint)
        vanished = []
        for plugin in self.rules.plugins:
            obs = seen.plugins[plugin.resource]
            self._watch_others(plugin, seen)
            if self._judge_plugin(plugin, obs):
                vanished.append(plugin.resource)
            self._judge_registration(plugin, obs, seen)
            self._judge_recovery(plugin, obs, seen)
            self._count_devices(plugin, seen)
        cp = seen.checkpoint.value
        self._checkpoint_mtime = (
            seen.checkpoint_before if seen.checkpoint_before is not None else cp.mtime_ns if cp else None
        )
        return vanished

    def _judge_kubelet(self, k: ProbeResult) -> None:
        # Another kubelet.sock than the one last seen answering is a restart, whatever the probe got
        # from it (a new kubelet may be between bind and listen, or still starting its server).
        if self._kubelet_id is not None and k.identity is not None and k.identity != self._kubelet_id:
            self._kubelet_gone(f"{self.rules.kubelet_socket} is a new file")
        if k.ok:
            if self._kubelet_recreated:
                self._kubelet_gone(f"a new {self.rules.kubelet_socket} answers")
            if self._kubelet_down and self.kubelet_restarts:
                self._kubelet_back_at = self.clock()
            self._kubelet_down = False
            self._kubelet_recreated = False
            self._kubelet_id = k.identity
        elif k.state in ("absent", "refused"):
            self._kubelet_gone(k.reason)
        # A kubelet fault is never mended by restarting the plugin: HAMi registers again by itself
        # when kubelet.sock is created, and a restart would only add CrashLoopBackOff's delay.
        self.state.report(KUBELET.name, k.ok, k.reason, k.latency, definitive=k.definitive, restarts=False)

    def _judge_checkpoint(self, checkpoint: Reading[Checkpoint]) -> None:
        """Lost evidence, never a liveness verdict: the live signals decide."""
        cp = checkpoint.value
        if cp is not None:
            self.state.report(
                CHECKPOINT.name, True, f"read: {len(cp.registered)} resource(s)", restarts=False
            )
        elif checkpoint.error.startswith("no checkpoint"):
            self.state.report(CHECKPOINT.name, True, checkpoint.error, restarts=False)
        else:
            self.state.report(CHECKPOINT.name, False, checkpoint.error, definitive=True, restarts=False)

    def _judge_plugin(self, plugin: PluginSpec, obs: PluginEvidence) -> bool:
        """The plugin check; True when its socket vanished unannounced and awaits `judge_vanished`."""
        p, result = self._plugins[plugin.resource], obs.probe
        name = CheckKey(Kind.PLUGIN, plugin.resource).name
        if p.judging:
            return False  # the deleted socket's verdict is being reached
        if result.ok and obs.identity_after != result.identity:
            return False  # removed or replaced while probed: its events decide
        if result.state == "absent" and self.state.checks[name].status is Status.OK:
            # Gone since the last round, and its deletion event is not here yet: the same verdict.
            p.judging = True
            return True
        if result.state == "absent" and p.vanished is not None:
            v = p.vanished  # keep the verdict and its why
            missed = self._missed_restart(p)
            if missed:
                self.state.report(name, False, missed, definitive=True, restarts=True)
                return False
            self.state.report(name, False, v.verdict, definitive=v.gone, restarts=not self._kubelet_down)
            return False
        if result.ok and result.identity != p.identity:
            if p.known:
                self._new_socket(plugin.resource, result.identity)  # seen before its event
                p.event_due = self.clock() + EVENT_LAG
            else:
                p.identity, p.kubelet_then, p.known = result.identity, self._kubelet_id, True  # at start
        if result.ok and obs.owner == "elsewhere":
            # Another device plugin re-bound the socket (up to 1.36 the kubelet keeps whichever
            # registered last; 1.37 refuses the second on one path): a restart would only fight it.
            why = f"{obs.owner_reason}; run one device plugin per resource (remove the other DaemonSet)"
            self.state.report(
                name,
                False,
                why,
                result.latency,
                definitive=True,
                restarts=False,
                quiet="another device plugin owns the socket: a restart of this one would only fight it",
            )
            return False
        if not self._verdict_due(name, p, result):
            return False
        self._report_plugin(plugin, p, result)
        return False

    def _missed_restart(self, p: _PluginState) -> str:
        """Why the plugin missed the kubelet's restart, or "": a HAMi plugin answers a new kubelet.sock by
        serving a new socket at once (a failed start retries 30 s later, its socket having come and
        gone), so one that served none `missed_restart_after` after the new kubelet answered will not
        register on its own: waiting out the grace buys nothing."""
        wait = self.rules.missed_restart_after
        back = self._kubelet_back_at
        if not wait or back is None or self._kubelet_down or p.since_restart:
            return ""
        if self.clock() - back < wait:
            return ""
        return (
            f"the plugin served no new socket within {wait:g}s of the new kubelet.sock: it missed the "
            "kubelet's restart (HAMi serves a new socket at once when kubelet.sock is created) and will "
            "not register on its own; a plugin restart registers it"
        )

    def _verdict_due(self, name: str, p: _PluginState, result: ProbeResult) -> bool:
        """Whether the probe's outcome is reported now. A plugin that answered fails liveness on a
        second failed probe, `drop_confirm` after the first, not the first: one stalled call would
        otherwise hold /healthz at 503 for a whole interval."""
        if result.ok or result.definitive:
            p.failed_at = None
        elif result.state == "timeout" and self._starved:
            # kubelet.sock timed out in the same round: a starved node, or a starved sidecar, times out
            # every probe; a hung plugin alone does not make the kubelet slow. No verdict this round.
            return False
        elif self.state.checks[name].status is Status.OK:
            now = self.clock()
            if p.failed_at is None:
                p.failed_at = now
            if now - p.failed_at < self.rules.drop_confirm:
                return False
        return True

    def _report_plugin(self, plugin: PluginSpec, p: _PluginState, result: ProbeResult) -> None:
        """Report the probe's outcome, with whether a plugin restart mends it and, if not, why not."""
        # While the kubelet is away its cleanup explains a missing socket: a restart would not help.
        restarts = not (self._kubelet_down and result.state == "absent")
        reason, quiet = result.reason, ""
        if result.ok:
            p.served, p.found = True, None
        elif not restarts:
            quiet = "the kubelet is restarting: its cleanup removed the socket, and HAMi serves a new one"
        elif result.state == "absent" and not p.served:
            # Never served since start: a plugin serving under another name, if the folder shows one;
            # restarts that do not bring the socket back are counted against the budget.
            found = pick_found(plugin, (n for n, _ in seen_others(p)))
            p.found = found
            if found is not None:
                reason = f"{reason}; {socket_found_instead(self.rules.plugins, plugin, found)}"
            if p.budget_spent:
                restarts = False
                quiet = (
                    f"restart budget spent: {p.restarts_in_vain} plugin restarts did not bring "
                    f"{plugin.socket} back"
                )
        self.state.report(
            CheckKey(Kind.PLUGIN, plugin.resource).name,
            result.ok,
            reason,
            result.latency,
            definitive=result.definitive,
            restarts=restarts,
            quiet=quiet,
        )

    def _watch_others(self, plugin: PluginSpec, seen: RoundEvidence) -> None:
        """A restart in vain: the plugin failed liveness for a socket it never served, and a socket came
        back in the folder under another name (a new file where the last round saw none, or another)."""
        r = plugin.resource
        p = self._plugins[r]
        now = dict(seen.others)
        check = self.state.checks[CheckKey(Kind.PLUGIN, r).name]
        if p.others is not None and check.live_failed and not p.served:
            back = sorted(n for n, ident in now.items() if p.others.get(n) != ident)
            if back and not p.budget_spent:
                p.restarts_in_vain += 1
                if not p.budget_spent:
                    self.listener.restart_requested(r)  # still failing: the next restart is asked for
                logger.info(
                    "%s: the plugin restarted and serves %s, not %s (%d of %d restarts in vain)",
                    r,
                    ", ".join(back),
                    plugin.socket,
                    p.restarts_in_vain,
                    RESTART_BUDGET,
                )
        p.others = now

    def _judge_registration(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> None:
        r = plugin.resource
        p, name = self._plugins[r], CheckKey(Kind.REGISTERED, r).name
        p.trap = ""
        if self._kubelet_down:
            p.lost_at = None
            self.listener.connected(r, None)
            why = "the kubelet is restarting; the plugin must register again"
            self.state.report(
                name, False, why, restarts=False, quiet="a kubelet restart: HAMi registers again by itself"
            )
            self._report_client(r, "the kubelet is restarting: a new kubelet holds no refusal")
            return
        verdict = self._held(plugin, p, obs, seen)
        self._report_client(r, "no refused Register seen: the kubelet keeps the plugin's client")
        if verdict.held is None:
            return  # a lost connection, or newer evidence against a held one, waits for its confirmation
        held, why = verdict.held, verdict.why
        if held:
            p.episode = False
            # The socket of this cycle, not one that replaced it while the round looked.
            pair = _Pair(obs.identity_after, self._kubelet_id)
            if pair.plugin is not None and pair.plugin == p.identity:
                p.held_this_cycle = p.held_this_cycle or self._names_socket(r, p, pair, obs, seen)
            if p.first_held is None or p.first_held.kubelet != pair.kubelet:
                p.first_held = pair
            self._restore_budget(r, "registered again")
            if self._recorded(r, seen, obs):
                self._close_attempt(r, registered=True)
        # Restarting the plugin registers it again, unless the kubelet cannot take it or the plugin is
        # not serving (its own check says so) or restarts have already failed to help.
        restarts = (
            verdict.mends
            and seen.kubelet.verified
            and obs.probe.ok
            and obs.owner != "elsewhere"
            and not p.budget_spent
        )
        if not held and p.budget_spent:
            why = f"{why}; restart budget spent: {RESTART_BUDGET} plugin restarts did not register it"
        self.state.report(
            name,
            held,
            why,
            definitive=verdict.definitive,
            restarts=restarts,
            quiet=self._quiet(plugin, obs, seen),
        )

    def _names_socket(
        self, r: str, p: _PluginState, pair: _Pair, obs: PluginEvidence, seen: RoundEvidence
    ) -> bool:
        """Whether a registered verdict on `pair` rests on evidence of its plugin socket: its
        connections seen held, or the resource's devices listed by pod-resources or a checkpoint fresh
        for the pair, where this kubelet held no other socket of the resource (a kubelet lists only
        what a plugin registered with it sent; an earlier socket's devices can linger, in the 1.37
        trap for good). A fresh checkpoint listing none says nothing of who registered."""
        if p.connected_pair == pair:
            return True
        if p.first_held is not None and p.first_held.kubelet == pair.kubelet and p.first_held != pair:
            return False
        live = seen.pod_resources.value
        return bool(live and live.get(r)) or bool(self._accepted(r, seen, obs))

    def _report_client(self, r: str, ok: str) -> None:
        """`kubelet-client:`: does the kubelet still keep a client for the plugin's path, or did it refuse a
        second Register and drop it (1.37)? Readiness only: only a kubelet restart mends it."""
        p = self._plugins[r]
        self.state.report(
            CheckKey(Kind.KUBELET_CLIENT, r).name,
            not p.trap,
            p.trap or ok,
            definitive=True,
            restarts=False,
            quiet="only a kubelet restart mends it: the kubelet refuses this plugin's path until then",
        )

    def _quiet(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> str:
        """Why `registered:` restarts nothing, true for the state at hand."""
        p = self._plugins[plugin.resource]
        sock = self.state.checks[CheckKey(Kind.PLUGIN, plugin.resource).name]
        if not seen.kubelet.verified:
            return "the kubelet's socket is not the real registration service: a plugin restart won't mend it"
        if obs.owner == "elsewhere":
            return "another device plugin owns the socket: a restart of this one would only fight it"
        if not obs.probe.ok and not (p.budget_spent and not sock.live_failed):
            # Said alike while that check is pending and once it fails: the text outlives the round.
            return (
                f"the plugin does not answer: {sock.name} judges that, and the plugin restart it asks for "
                "mends this too"
            )
        if p.budget_spent:
            return f"restart budget spent: {p.restarts_in_vain} plugin restarts did not register it"
        return ""

    def _held(self, plugin: PluginSpec, p: _PluginState, obs: PluginEvidence, seen: RoundEvidence) -> _Held:
        """Does the kubelet hold the plugin now? The precedence is docs/design.md#registration's: its
        connections where they can be seen (rule 1), else pod-resources and the checkpoint (2, 3)."""
        conns = obs.connections.value
        self.listener.connected(plugin.resource, conns)
        pair = _Pair(obs.identity_after, self._kubelet_id)
        if conns is not None:
            accepted = self._accepted(plugin.resource, seen, obs)
            verdict = self._held_by_connections(plugin, p, obs, seen, conns, recorded=accepted)
            self._remember(p, pair, verdict, seen_held=p.connected_pair == pair, accepted=accepted)
            return verdict
        # No view of the kubelet's connections: pod-resources is live, the checkpoint is history.
        p.lost_at = None
        kept = self._unknown_keeps(plugin.resource, p, obs, seen, pair)
        verdict = kept if kept is not None else self._held_by_records(plugin.resource, obs, seen)
        # A reader that trusts only a count of 0 (a positive one could be a look-alike's): held by the
        # records, the pair's connections falling to 0 is still a lost connection to confirm.
        p.records_held = pair if verdict.held else None
        return verdict

    @staticmethod
    def _remember(
        p: _PluginState, pair: _Pair, verdict: _Held, seen_held: bool, accepted: int | None
    ) -> None:
        """Keep what a trustworthy count said against a registration the checkpoint records: not held
        (after this pair was seen held, or with the checkpoint already recording it); a held one, or a
        count that may yet be a Register under way, forgets it."""
        if verdict.held is None:
            return  # awaiting its confirmation: the last verdict stands
        if verdict.held or not (seen_held or accepted is not None):
            p.not_held = None
        else:
            p.not_held = (pair, verdict)

    def _unknown_keeps(
        self, r: str, p: _PluginState, obs: PluginEvidence, seen: RoundEvidence, pair: _Pair
    ) -> _Held | None:
        """An unknown count (a reader that cannot see, or a line a neighbour may have made up) never
        turns the last trustworthy "not held" of this pair into registered on the checkpoint alone: the
        kubelet does not rewrite its checkpoint when it drops a plugin. pod-resources, live, still
        decides where it can be read. None: nothing kept, the records decide."""
        if p.not_held is None or p.not_held[0] != pair:
            p.not_held = None
            return None
        if seen.pod_resources.value is not None:
            return None
        last = p.not_held[1]
        cp = seen.checkpoint.value
        recorded = (
            f"the checkpoint recorded it at {iso(cp.mtime_ns / 1e9)}"
            if cp is not None and cp.devices(r) is not None
            else "the checkpoint does not record it"
        )
        return _Held(
            False,
            f"not registered: {recorded}; the live connection cannot be read: {obs.connections.error}; "
            f"the last reading of it: {last.why}",
            definitive=last.definitive,
            mends=last.mends,
        )

    def _held_by_connections(
        self,
        plugin: PluginSpec,
        p: _PluginState,
        obs: PluginEvidence,
        seen: RoundEvidence,
        conns: int,
        *,
        recorded: int | None,
    ) -> _Held:
        """Rule 1: the kubelet's connections to the listener that owns the plugin's socket file now.
        `recorded`: the healthy devices a checkpoint fresh for this pair of sockets lists (`_accepted`)."""
        r, sock = plugin.resource, plugin.socket
        pair = _Pair(obs.identity_after, self._kubelet_id)
        held_before = p.connected_pair == pair
        # Once held, this pair of sockets stays accepted while connected: freshness compares file
        # times, which a clock step or a `touch` can reorder.
        accepted = 0 if held_before else recorded
        if unrecorded_connection(conns, seen.checkpoint.value, accepted):
            # A connection with no device list recorded since this socket was made is no
            # registration: a Register under way, or a dial the kubelet kept after refusing the
            # Register (seen with the real kubelet in the state of kubernetes PR 139338).
            p.lost_at = None
            shadowed = self._shadowed(plugin, p, seen, pair)
            if shadowed is not None:
                return shadowed
            return _Held(
                False,
                f"the kubelet is connected to {sock} but has recorded no device list from it since "
                "the socket was created (a Register under way, or refused)",
            )
        p.shadowed = None
        if conns > 0 and held_before:
            against = self._newer_evidence(plugin, p, obs, seen, pair)  # rules 1.1 to 1.4
            if against is not None:
                if against.held is not None:
                    p.lost_at = None
                return against
        if conns > 0:
            if not held_before:
                p.connected_pair, p.connected_since = pair, self.wall()
                self._track(p, pair, obs.connection_ids, seen.checkpoint.value, r)
            p.lost_at = None
            return _Held(True, f"the kubelet holds a connection to {sock}{self._device_note(r, seen)}")
        if held_before and obs.probe.ok:
            return self._dropped(sock, p, pair, self._endpoint_alive(r, seen))
        if conns == 0 and p.records_held == pair and obs.probe.ok:
            # Held by pod-resources or the checkpoint while only a count of 0 is trusted: confirmed once
            # `drop_confirm` later like any lost connection (a stopping kubelet closes its connections a
            # moment before its socket goes), then the drop.
            verdict = self._dropped(sock, p, pair, self._endpoint_alive(r, seen))
            if verdict.held is not None:
                p.records_held = None
            return verdict
        p.lost_at = None
        return _Held(False, f"the kubelet holds no connection to {sock}: {self._not_held(r, seen, obs)}")

    def _shadowed(
        self, plugin: PluginSpec, p: _PluginState, seen: RoundEvidence, pair: _Pair
    ) -> _Held | None:
        """A new socket's connection stays unrecorded for `refusal_confirm` while pod-resources lists the
        resource's devices healthy: the kubelet keeps the endpoint of an earlier plugin on this path,
        with no stream of this socket behind it, and refused this Register (1.37, the stale-endpoint
        trap: the earlier plugin's stream ended after the kubelet had dropped its client). Only a
        kubelet restart mends it. Up to 1.36 the same evidence is a Register under way (the new client
        replaces the old, whose devices stay listed until the new list comes): None, as when
        pod-resources cannot be read."""
        live = seen.pod_resources.value
        healthy = physical_devices(live.get(plugin.resource, ())) if live is not None else set()
        if not seen.kubelet_rules.refuses_second_register or not healthy:
            p.shadowed = None
            return None
        now = self.clock()
        if p.shadowed is None or p.shadowed[0] != pair:
            p.shadowed = (pair, now)
        if now - p.shadowed[1] < self.rules.refusal_confirm:
            # Under way or refused: not yet told, and a restart would be refused if it was. No liveness.
            return _Held(
                False,
                f"the kubelet is connected to {plugin.socket} but has recorded no device list from it since "
                f"the socket was created, while pod-resources lists {len(healthy)} healthy device(s) of "
                f"{plugin.resource} (a Register under way, or refused for an earlier plugin's endpoint)",
                mends=False,
            )
        p.trap = (
            f"the kubelet refused the Register of {plugin.socket}: it keeps the endpoint of an earlier "
            "plugin on that path and has forgotten its client (Kubernetes 1.37: device plugin already "
            "connected); the next plugin restart will not register until the kubelet restarts"
        )
        return _Held(
            False,
            f"the kubelet is connected to {plugin.socket} and recorded no device list from it in "
            f"{self.rules.refusal_confirm:g}s, while pod-resources lists {len(healthy)} healthy device(s) of "
            f"{plugin.resource} with no stream of this socket behind them (phantom capacity: Pods admitted "
            f"to them fail in Allocate): {p.trap}",
            definitive=True,
            mends=False,
        )

    def _endpoint_alive(self, r: str, seen: RoundEvidence) -> bool | None:
        """Does the kubelet keep the resource's endpoint? Yes where pod-resources lists healthy devices
        of it; no where it lists none that the checkpoint records healthy (a kubelet that drops a plugin
        marks its devices unhealthy itself and does not rewrite the checkpoint, rule 1.3); None where
        it cannot be told: pod-resources unread, or no device recorded healthy (the plugin may have
        reported them all unhealthy itself)."""
        live = seen.pod_resources.value
        if live is None:
            return None
        if physical_devices(live.get(r, ())):
            return True
        cp = seen.checkpoint.value
        return False if cp is not None and cp.devices(r) else None

    def _dropped(self, sock: str, p: _PluginState, pair: _Pair, endpoint: bool | None) -> _Held:
        """Rule 1, no connection left to a pair of sockets seen held: a drop, once confirmed.

        It held this plugin and let go while both sockets stayed: a drop, which no waiting mends
        (kubernetes issues 121994, 131013). Confirmed once, `drop_confirm` later, so that a kubelet
        on its way out (it disconnects before its socket goes) is not taken for one.
        """
        now = self.clock()
        if p.lost_at is None:
            p.lost_at = now
        if now - p.lost_at < self.rules.drop_confirm:
            return _UNCONFIRMED
        since = iso(p.connected_since) if p.connected_since else "?"
        if p.refused and p.conns_pair == pair and endpoint is not False:
            # The connections a refusal left open closed (grpc-go's idle timeout) while the kubelet keeps
            # the plugin's endpoint (pod-resources lists its healthy devices, or cannot be read): the
            # 1.37 trap, not a drop. The path is still refused: a plugin restart would not mend it.
            # Where pod-resources shows the devices unhealthy the kubelet dropped the plugin, whatever a
            # look-alike connection (a neighbour's, at the plugin's path in namespaces of its own) made
            # of it before: that is a drop, and it fails liveness below.
            phantom = _PHANTOM if endpoint else ""
            p.trap = _FORGOTTEN
            return _Held(
                False,
                f"the kubelet is no longer connected to {sock} (held it from {since}) and refused "
                f"its later Register: the path is refused until the kubelet restarts{phantom}",
                definitive=True,
                mends=False,
            )
        return _Held(
            False,
            f"the kubelet is no longer connected to {sock} (held it from {since}): it dropped the "
            "plugin, which keeps serving; a plugin restart registers it again",
            definitive=True,
        )

    def _held_by_records(self, r: str, obs: PluginEvidence, seen: RoundEvidence) -> _Held:
        """Rules 2 and 3, where the kubelet's connections cannot be seen: pod-resources (live) listing
        the resource's devices, else the checkpoint (history) dating an acceptance."""
        live = seen.pod_resources.value
        if live is not None and live.get(r):
            return _Held(True, f"pod-resources lists {len(live[r])} device(s) of {r}")
        accepted = self._accepted(r, seen, obs)
        if accepted is None:
            return _Held(False, f"{self._not_held(r, seen, obs)} ({obs.connections.error})")
        if live is not None and accepted:
            return _Held(
                False,
                f"pod-resources lists no device of {r} although the kubelet recorded {accepted} healthy: "
                "it dropped the plugin",
            )
        # `[]` in a fresh checkpoint: registered with no healthy device, or dropped; a restart would not
        # make a registered plugin more registered, so this passes, saying what cannot be told.
        return _Held(True, f"the kubelet accepted the plugin ({accepted} healthy device(s) recorded)")

    def _track(
        self,
        p: _PluginState,
        pair: _Pair,
        ids: frozenset[int] | None,
        cp: Checkpoint | None,
        r: str,
    ) -> None:
        """Follow the held pair's connections one by one: which came when, which the kubelet recorded.

        The connections there when the pair is first held are its registration (the unrecorded rule
        has vouched for them); one alone is the registered one. A later one is a second Register:
        recorded once the checkpoint is rewritten listing the resource after it came (the kubelet
        writes it on the first ListAndWatch answer of an accepted Register), and then the registered
        one, since the kubelet keeps the newest.
        """
        if ids is None:
            p.conns, p.conns_pair, p.registered_conn = {}, None, None
            return
        now = self.clock()
        if p.conns_pair != pair:
            p.conns = {i: _Conn(now, None, True) for i in ids}
            p.conns_pair = pair
            p.registered_conn = next(iter(ids)) if len(ids) == 1 else None
            p.contradicted_at, p.refused = None, False
            return
        for i in ids - p.conns.keys():
            p.conns[i] = _Conn(now, self._checkpoint_mtime, False, alongside=p.registered_conn)
        for i in p.conns.keys() - ids:
            del p.conns[i]
        for c in p.conns.values():
            if c.alongside is not None and c.alongside not in ids:
                c.alongside = None
        self._mark_recorded(p, cp, r)

    @staticmethod
    def _mark_recorded(p: _PluginState, cp: Checkpoint | None, r: str) -> None:
        """The later connections the kubelet recorded a device list from since they came: the newest of
        them carries the registration. One that came before any checkpoint was read cannot be told."""
        fresh = [
            (c.first_seen, i)
            for i, c in p.conns.items()
            if not c.recorded
            and not c.refused
            and cp is not None
            and c.checkpoint_before is not None
            and cp.mtime_ns > c.checkpoint_before
            and cp.devices(r) is not None
        ]
        for _, i in fresh:
            p.conns[i].recorded = True
        if fresh:
            p.registered_conn = max(fresh)[1]
        for c in p.conns.values():
            if not c.recorded and c.checkpoint_before is None:
                # No checkpoint was read before it came: whether it was recorded cannot be told.
                c.recorded = True
                p.registered_conn = None

    def _newer_evidence(
        self,
        plugin: PluginSpec,
        p: _PluginState,
        obs: PluginEvidence,
        seen: RoundEvidence,
        pair: _Pair,
    ) -> _Held | None:
        """What, newer than the connection that made this pair held, says the kubelet no longer holds
        the plugin (docs/design.md#registration, 1.1 to 1.4, the first that applies): a verdict that
        fails at once, `_UNCONFIRMED` while it awaits its confirmation, None when nothing does.

        1.1 (`_refused_register`) no plugin restart mends: the kubelet refuses the path until it
        restarts. 1.2 to 1.4 (`_drop_evidence`) are drops, confirmed once, `drop_confirm` later, as a
        lost connection is: the kubelet changes its live view a moment before it rewrites the
        checkpoint, and a stopping kubelet closes its clients before its socket goes.
        """
        now = self.clock()
        self._track(p, pair, obs.connection_ids, seen.checkpoint.value, plugin.resource)
        if seen.kubelet_rules.refuses_second_register:
            self._refused_register(plugin.socket, p, now)
        if p.refused:
            phantom = self._kept_stream_closed(plugin, p, obs, seen)
            if phantom is not None:
                return phantom
        why = self._drop_evidence(plugin, p, obs, seen, pair)
        if not why:
            p.contradicted_at = None
            return None
        p.trap = ""  # the kubelet dropped the plugin: no endpoint keeps the path, whatever connects to it
        if p.contradicted_at is None:
            p.contradicted_at = now
        if now - p.contradicted_at < self.rules.drop_confirm:
            return _UNCONFIRMED
        return _Held(False, why, definitive=True)

    def _refused_register(self, sock: str, p: _PluginState, now: float) -> None:
        """Rule 1.1: a later connection the kubelet recorded no device list from within `refusal_confirm`.

        It refused a second Register (1.37, `device plugin already connected`): it keeps the stream it
        holds but forgets its client, so that stream's end will go unnoticed and the path is refused
        until the kubelet restarts. The plugin is registered still (`registered:` holds);
        `kubelet-client:` fails while the refused connection stays open. Up to 1.36 the kubelet accepts
        a second Register: the caller asks only under 1.37's rules. An accepted Register records its
        list within milliseconds, seconds on a loaded node: the bound is long, and only readiness waits.
        """
        for i, c in p.conns.items():
            if c.refused or now - c.first_seen < self.rules.refusal_confirm:
                continue
            if not c.recorded or c.alongside is not None:
                # Refused for as long as it stays open: the stream the kubelet kept rewrites the
                # checkpoint too, and would pass for it. (A connection that closes ends the verdict.)
                # One that came, and stayed, beside the connection that carried the registration is
                # refused whatever was written: 1.37 disconnects that one before it accepts another.
                c.refused = p.refused = True
                if p.registered_conn == i:
                    p.registered_conn = c.alongside
        refused = sum(1 for c in p.conns.values() if c.refused)
        if refused:
            p.trap = (
                f"the kubelet opened {refused} more connection(s) to {sock} (a second Register) and recorded "
                f"no device list from it in {self.rules.refusal_confirm:g}s: it refused that Register "
                "(Kubernetes 1.37: device plugin already connected) and dropped this plugin's client; the "
                "stream it keeps still feeds the devices, but their end will go unnoticed (phantom "
                "capacity) and the next plugin restart will not register until the kubelet restarts"
            )

    def _kept_stream_closed(
        self, plugin: PluginSpec, p: _PluginState, obs: PluginEvidence, seen: RoundEvidence
    ) -> _Held | None:
        """After a refusal, the connection that carried the stream the kubelet kept closed: the kubelet
        no longer keeps the plugin's client, so it never learns (no PluginDisconnected) and keeps the
        endpoint with no stream behind it. Not registered, readiness only: a plugin restart is refused
        the same way. Where pod-resources shows the devices gone unhealthy the kubelet did drop it
        (rule 1.3 says so, a drop): None, as when nothing closed."""
        ids = obs.connection_ids
        if p.registered_conn is None or ids is None or p.registered_conn in ids:
            return None
        endpoint = self._endpoint_alive(plugin.resource, seen)
        if endpoint is False:
            return None
        phantom = _PHANTOM if endpoint else ""
        p.trap = _FORGOTTEN
        return _Held(
            False,
            f"the connection to {plugin.socket} that carried the stream the kubelet kept closed, and the "
            f"kubelet, which refused a later Register, no longer knows this plugin{phantom}: the path is "
            "refused until the kubelet restarts",
            definitive=True,
            mends=False,
        )

    def _drop_evidence(
        self, plugin: PluginSpec, p: _PluginState, obs: PluginEvidence, seen: RoundEvidence, pair: _Pair
    ) -> str:
        """Rules 1.2 to 1.4: why the kubelet dropped the held plugin, by the first that applies; "" when
        none does."""
        r, sock = plugin.resource, plugin.socket
        ids = obs.connection_ids
        closed = p.registered_conn is not None and ids is not None and p.registered_conn not in ids
        # Only newer connections left, each awaiting its record: a Register under way after the old
        # stream's end (1.37 frees the path then), not 1.2's pattern; the refusal rule decides them.
        awaiting = all(not c.recorded and not c.refused for c in p.conns.values())
        if closed and not p.refused and not awaiting:
            # 1.2: the connection that carried the registration closed while older ones stay (up to
            # 1.36, the end of an older stream disconnects the newest client: the older connections
            # carry no stream).
            return (
                f"the kubelet closed the connection to {sock} that carried its registration and keeps "
                f"{len(ids or ())} older one(s) with no stream (an earlier stream's end disconnected the "
                "newest Register): it dropped the plugin, which keeps serving; a plugin restart registers it "
                "again"
            )
        live = seen.pod_resources.value
        accepted = self._accepted(r, seen, obs)
        if live is not None and not live.get(r) and accepted:
            # 1.3: pod-resources lists none of the resource that a checkpoint written since the
            # plugin's socket was created records healthy (the kubelet marked the devices unhealthy
            # itself, which it does only when it drops the plugin).
            return (
                f"pod-resources lists no device of {r} although the kubelet's checkpoint, written since "
                f"{sock} was created, records {accepted} healthy: the kubelet dropped the plugin (its "
                "connection carries no stream); a plugin restart registers it again"
            )
        cp = seen.checkpoint.value
        if (
            cp is not None
            and cp.devices(r) is None
            and pair.plugin is not None
            and cp.mtime_ns >= max(pair.plugin.mtime_ns, pair.kubelet.mtime_ns if pair.kubelet else 0)
        ):
            # 1.4: a checkpoint rewritten since both sockets were created without the resource.
            return (
                f"the kubelet's checkpoint, rewritten since {sock} was created, no longer lists {r}: it "
                "dropped the plugin; a plugin restart registers it again"
            )
        return ""

    def _recorded(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> bool:
        """The kubelet has the plugin's first ListAndWatch answer: the end of the latency SLI."""
        live = seen.pod_resources.value
        return bool(live and live.get(r)) or self._accepted(r, seen, obs) is not None

    def _accepted(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> int | None:
        """Healthy devices the checkpoint lists for `r`, if rewritten since both sockets were made."""
        return accepted_devices(seen.checkpoint.value, r, obs.identity_after, self._kubelet_id)

    def _not_held(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> str:
        return not_held_reason(seen.checkpoint, r, obs.identity_after, self._plugins[r].connected_since)

    def _device_note(self, r: str, seen: RoundEvidence) -> str:
        live = seen.pod_resources.value
        if live is None:
            return ""
        n = len(physical_devices(live.get(r, ())))
        return f"; pod-resources lists {n} healthy device(s)" if n else "; no healthy device listed"

    def _count_devices(self, plugin: PluginSpec, seen: RoundEvidence) -> None:
        """Healthy physical devices the kubelet lists now; a stale checkpoint's count is never one."""
        r = plugin.resource
        p = self._plugins[r]
        counts = self._device_counts(r, seen)
        self.listener.devices(r, counts)
        p.devices = counts
        expect = self.rules.expect_devices
        if expect.kind is Expect.OFF:
            return  # opted out: a node where no healthy device is normal
        self._judge_devices(r, counts, self._wanted(expect, seen))

    def _device_counts(self, r: str, seen: RoundEvidence) -> dict[str, int]:
        """The counts by source: pod-resources (live), a checkpoint written since the answering
        kubelet.sock was created (none while the kubelet restarts), and the host's device nodes."""
        counts: dict[str, int] = {}
        live = seen.pod_resources.value
        if live is not None:
            counts["pod_resources"] = len(physical_devices(live.get(r, ())))
        cp = seen.checkpoint.value
        devices = cp.devices(r) if cp is not None else None
        fresh = (
            cp is not None
            and not self._kubelet_down
            and self._kubelet_id is not None
            and cp.mtime_ns >= self._kubelet_id.mtime_ns
        )
        if devices is not None and fresh:
            counts["checkpoint"] = len(physical_devices(devices))
        if seen.host_devices is not None:
            counts["host"] = seen.host_devices
        return counts

    def _judge_devices(self, r: str, counts: Mapping[str, int], wanted: _Wanted) -> None:
        """The devices check: the kubelet lists at least the healthy devices wanted, by pod-resources,
        else by the checkpoint."""
        name = CheckKey(Kind.DEVICES, r).name
        want = wanted.minimum
        source = "pod-resources" if "pod_resources" in counts else "checkpoint"
        have = counts.get("pod_resources", counts.get("checkpoint"))
        # Devices are a readiness question: a GPU lost or broken is the node's. HAMi never marks a device
        # healthy again, which a plugin restart does after a transient fault: that restart is `recover:`'s.
        quiet = self._devices_quiet(r)
        if have is None:
            why = "the kubelet is restarting" if self._kubelet_down else "no current count"
            self.state.report(
                name, False, f"{why}: the checkpoint predates kubelet.sock", restarts=False, quiet=quiet
            )
        elif have >= want:
            self.state.report(
                name, True, f"the kubelet lists {have} (want {want}: {wanted.why})", restarts=False
            )
        else:
            self.state.report(
                name,
                False,
                f"the kubelet lists {have} healthy device(s) by {source}, {want} expected ({wanted.why})",
                restarts=False,
                quiet=quiet,
            )

    def _devices_quiet(self, r: str) -> str:
        """Why `devices:` restarts nothing, true for the state at hand."""
        if r not in self._recovery:
            return (
                "readiness only: a lost or broken GPU is the node's; a device HAMi marked unhealthy on a "
                "transient fault comes back with a plugin restart: --recover-unhealthy-after"
            )
        recover = self.state.checks[CheckKey(Kind.RECOVER, r).name]
        if recover.live_failed:
            return f"readiness only: {recover.name} asks for the plugin restart that re-reads the devices"
        return f"readiness only: {recover.name} says whether a plugin restart would bring the devices back"

    def _judge_recovery(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> None:
        """`recover:`: devices HAMi can never mark healthy again, re-read by one plugin restart while
        the host still shows them and no running pod holds one (recovery.py)."""
        r = plugin.resource
        rec = self._recovery.get(r)
        if rec is None:
            return
        live = seen.pod_resources.value
        why = ""
        if self._kubelet_down:
            why = "the kubelet is restarting"
        elif not obs.probe.ok:
            why = "the plugin does not answer"
        elif self.state.checks[CheckKey(Kind.REGISTERED, r).name].status is not Status.OK:
            why = "the kubelet does not hold the plugin"
        elif self._plugins[r].lost_at is not None or self._plugins[r].contradicted_at is not None:
            why = "a lost hold of the plugin awaits its confirmation"
        elif live is None:
            why = f"pod-resources cannot be read ({seen.pod_resources.error})"
        listed = frozenset(physical_devices(live.get(r, ()))) if live is not None else None
        pods = seen.recovery.pod_devices.value
        held: dict[str, str] | None = None
        if pods is not None:
            held = {}
            for device, pod in sorted(pods.get(r, {}).items()):
                held.setdefault(physical_device(device), pod)
        verdict = rec.judge(listed, why, seen.recovery, held, now=self.clock(), wall=self.wall())
        for event, count in verdict.events:
            self.listener.recovery(r, event, count)
        self.state.report(
            CheckKey(Kind.RECOVER, r).name,
            verdict.ok,
            verdict.reason,
            definitive=True,
            restarts=verdict.restarts,
            quiet=verdict.quiet,
        )

    def _wanted(self, expect: DeviceExpectation, seen: RoundEvidence) -> _Wanted:
        """The minimum of healthy devices, and where it comes from."""
        if expect.kind is Expect.ANY:
            return _Wanted(
                1,
                "a registered plugin with no healthy device is not ready; --expect-devices 0 opts out",
            )
        if expect.kind is not Expect.AUTO:
            return _Wanted(expect.count, "--expect-devices")
        if seen.expectation is not None:
            e = seen.expectation
            # Every GPU filtered: HAMi registers none, and none is right; no device node: at least one.
            return _Wanted((e.want if e.host else 1), f"--expect-devices auto: {e.summary()}")
        if seen.host_devices:
            return _Wanted(seen.host_devices, f"--expect-devices auto: {self.rules.device_glob} on the host")
        return _Wanted(1, f"--expect-devices auto: no {self.rules.device_glob} on the host; at least one")

    # -- transitions -------------------------------------------------------------------------------
    def refresh(self) -> float | None:
        """Fail pending checks whose grace ran out; when the next one will (monotonic)."""
        return self.state.refresh()

    def _on_transition(self, check: Check, old: Status) -> None:
        r = check.key.resource
        if check.status is Status.FAILED and check.key.kind is Kind.REGISTERED:
            self._registration_failed(check)
        elif check.status is Status.FAILED and check.key.kind is Kind.PLUGIN and not self._plugins[r].served:
            self._never_served_failed(check)
        self.listener.transition(check, old)

    def _registration_failed(self, check: Check) -> None:
        """`registered:` failed: the cycle closes unregistered, and a liveness failure opens an episode
        (the plugin restart it asks for is then one in vain, until registration is seen)."""
        r = check.key.resource
        p = self._plugins[r]
        self._close_attempt(r, registered=False)
        if p.budget_spent and not p.budget_announced:
            # Said when it takes effect: the failure after the last restart, not that restart.
            p.budget_announced = True
            logger.warning(
                "restart budget spent for %s: %d plugin restarts did not bring registration back; "
                "liveness no longer fails for it until it registers or the kubelet restarts (this node "
                "needs a person)",
                r,
                RESTART_BUDGET,
            )
            self.listener.budget(r, True)
        if check.live_failed and not p.episode:
            p.episode = True
            self.listener.restart_requested(r)

    def _never_served_failed(self, check: Check) -> None:
        """`plugin:` failed for a socket the plugin never served since start: a restart is asked for,
        until the budget is spent."""
        r = check.key.resource
        p = self._plugins[r]
        if check.live_failed:
            self.listener.restart_requested(r)  # for a socket it never served
        elif p.budget_spent and not p.budget_announced:
            p.budget_announced = True
            logger.warning(
                "restart budget spent for %s: %d plugin restarts did not bring %s back%s; liveness no "
                "longer fails for it until it registers (this node needs a person)",
                r,
                p.restarts_in_vain,
                self.plugin_for(r).socket,
                f" (it serves {p.found})" if p.found else "",
            )
            self.listener.budget(r, True)


def iso(ts: float) -> str:
    """A wall-clock time as UTC ISO 8601, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
