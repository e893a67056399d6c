"""Whether the kubelet holds the plugin: rules 1, 2 and 3 of docs/design.md#registration.

1 the kubelet's connections to the listener that owns the plugin's socket file now: held while one
with a recorded device list stays (1.1 to 1.4, newer evidence against it, are `streams`'s); one with
no record since the socket was made is a Register under way or refused (under 1.37, while pod-resources
lists the resource's devices healthy, the stale-endpoint trap once `refusal_confirm` has passed); none
left of a pair seen held is a drop, confirmed once, `drop_confirm` later; an unknown count keeps the
last readable "not held" of the pair, never upgrades it. 2 where the connections cannot be seen:
pod-resources listing the devices is held, a resource the checkpoint recorded healthy that it no longer
lists was dropped. 3 the checkpoint dates an acceptance: with neither live reading, it is past evidence,
never registered (readiness only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.evidence import (
    UNCONFIRMED,
    Held,
    Listener,
    Pair,
    PluginEvidence,
    RoundEvidence,
    Rules,
    accepted_devices,
    endpoint_alive,
    iso,
    not_held_reason,
    unrecorded_connection,
)
from sidecar.deviceplugin.kubelet import KubeletRestarts
from sidecar.deviceplugin.naming import physical_devices
from sidecar.deviceplugin.streams import FORGOTTEN, PHANTOM, HeldStreams


@dataclass
class _Seen:
    """What the rounds saw of the kubelet's hold on one plugin."""

    connected_pair: Pair | None = None  # seen held
    connected_since: float | None = None  # wall
    # The first pair of sockets judged registered under the current kubelet, whatever the evidence: a
    # record of the resource's devices can be an earlier socket's where this kubelet held another one.
    first_held: Pair | None = None
    # A new pair's connection left unrecorded while the kubelet keeps an endpoint of the resource alive
    # (pod-resources lists it healthy): since when (monotonic), under rules that refuse a second Register.
    shadowed: tuple[Pair, float] | None = None
    trap: str = ""  # this round: why the kubelet no longer keeps this plugin's client ("": it does)
    records_held: Pair | None = None  # the pair pod-resources or the checkpoint last said is held
    # The last verdict of not held that the kubelet's connections gave (trustworthy), with its pair: an
    # unknown count keeps it, never upgrades it on the checkpoint alone.
    not_held: tuple[Pair, Held] | None = None
    lost_at: float | None = None  # monotonic: the connection was first seen lost


class ConnectionEvidence:
    """Each plugin's hold by the kubelet, from its connections where they can be seen, else from
    pod-resources and the checkpoint."""

    def __init__(
        self,
        rules: Rules,
        listener: Listener,
        clock: Callable[[], float],
        wall: Callable[[], float],
        *,
        kubelet: KubeletRestarts,
        streams: HeldStreams,
    ) -> None:
        self.rules = rules
        self.listener = listener
        self.clock = clock
        self.wall = wall
        self.kubelet = kubelet
        self.streams = streams
        self._plugins = {p.resource: _Seen() for p in rules.plugins}

    # -- what the other families ask ------------------------------------------------------------
    def connected_since(self, r: str) -> float | None:
        """Wall time the kubelet was last seen holding the plugin, None when never."""
        return self._plugins[r].connected_since

    def trap(self, r: str) -> str:
        """This round: why the kubelet no longer keeps this plugin's client ("": it does)."""
        return self._plugins[r].trap or self.streams.trap(r)

    def awaiting(self, r: str) -> bool:
        """A lost hold of the plugin awaits its confirmation."""
        return self._plugins[r].lost_at is not None or self.streams.contradicted(r)

    def due(self, now: float) -> list[float]:
        """When a lost connection or an unrecorded one beside live devices comes due for confirmation."""
        drop, refusal = self.rules.drop_confirm, self.rules.refusal_confirm
        due = [s.lost_at + drop for s in self._plugins.values() if s.lost_at is not None]
        due += [s.shadowed[1] + refusal for s in self._plugins.values() if s.shadowed]
        return [t for t in due if t > now]  # once confirmed, nothing is due: no round is asked for

    # -- the judge's fan-out ----------------------------------------------------------------------
    def new_socket(self, r: str) -> None:
        """A new plugin socket: no hold seen of it yet."""
        s = self._plugins[r]
        s.lost_at, s.connected_pair = None, None

    def kubelet_gone(self) -> None:
        """A kubelet restart: no plugin is held by the new kubelet yet."""
        for s in self._plugins.values():
            s.lost_at, s.connected_pair = None, None

    def begin_round(self, r: str) -> None:
        """A round's registration verdict begins: no trap said yet."""
        self._plugins[r].trap = ""
        self.streams.begin_round(r)

    def kubelet_down(self, r: str) -> None:
        """The kubelet is restarting: no lost connection to confirm."""
        self._plugins[r].lost_at = None

    def note_held(self, r: str, pair: Pair) -> None:
        """A registered verdict on `pair`: the first pair this kubelet held, if it is."""
        s = self._plugins[r]
        if s.first_held is None or s.first_held.kubelet != pair.kubelet:
            s.first_held = pair

    def names_socket(self, r: str, pair: Pair, obs: PluginEvidence, seen: RoundEvidence) -> bool:
        """Whether a registered verdict on `pair` rests on evidence of its plugin socket: its
        connections seen held, or the resource's devices listed by pod-resources or a checkpoint fresh
        for the pair, where this kubelet held no other socket of the resource (a kubelet lists only
        what a plugin registered with it sent; an earlier socket's devices can linger, in the 1.37
        trap for good). A fresh checkpoint listing none says nothing of who registered."""
        s = self._plugins[r]
        if s.connected_pair == pair:
            return True
        if s.first_held is not None and s.first_held.kubelet == pair.kubelet and s.first_held != pair:
            return False
        live = seen.pod_resources.value
        return bool(live and live.get(r)) or bool(self.accepted(r, seen, obs))

    def accepted(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> int | None:
        """Healthy devices the checkpoint lists for `r`, if rewritten since both sockets were made."""
        return accepted_devices(seen.checkpoint.value, r, obs.identity_after, self.kubelet.identity)

    # -- the verdict --------------------------------------------------------------------------------
    def held(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> Held:
        """Does the kubelet hold the plugin now? Its connections where they can be seen (rule 1), else
        pod-resources and the checkpoint (2, 3)."""
        r = plugin.resource
        s = self._plugins[r]
        conns = obs.connections.value
        self.listener.connected(r, conns)
        pair = Pair(obs.identity_after, self.kubelet.identity)
        if conns is not None:
            accepted = self.accepted(r, seen, obs)
            verdict = self._by_connections(plugin, s, obs, seen, conns, recorded=accepted)
            self._remember(s, pair, verdict, seen_held=s.connected_pair == pair, accepted=accepted)
            return verdict
        # No view of the kubelet's connections: pod-resources is live, the checkpoint is history.
        s.lost_at = None
        kept = self._unknown_keeps(r, s, obs, seen, pair)
        verdict = kept if kept is not None else self._by_records(r, obs, seen)
        # A reader that trusts only a count of 0 (a positive one could be a look-alike's): held by the
        # records, the pair's connections falling to 0 is still a lost connection to confirm.
        s.records_held = pair if verdict.held else None
        return verdict

    @staticmethod
    def _remember(s: _Seen, pair: Pair, verdict: Held, seen_held: bool, accepted: int | None) -> None:
        """Keep what a trustworthy count said against a registration the checkpoint records: not held
        (after this pair was seen held, or with the checkpoint already recording it); a held one, or a
        count that may yet be a Register under way, forgets it."""
        if verdict.held is None:
            return  # awaiting its confirmation: the last verdict stands
        if verdict.held or not (seen_held or accepted is not None):
            s.not_held = None
        else:
            s.not_held = (pair, verdict)

    def _unknown_keeps(
        self, r: str, s: _Seen, obs: PluginEvidence, seen: RoundEvidence, pair: Pair
    ) -> Held | None:
        """An unknown count (a reader that cannot see, or a line a neighbour may have made up) never
        turns the last trustworthy "not held" of this pair into registered on the checkpoint alone: the
        kubelet does not rewrite its checkpoint when it drops a plugin. pod-resources, live, still
        decides where it can be read. None: nothing kept, the records decide."""
        if s.not_held is None or s.not_held[0] != pair:
            s.not_held = None
            return None
        if seen.pod_resources.value is not None:
            return None
        last = s.not_held[1]
        cp = seen.checkpoint.value
        recorded = (
            f"the checkpoint recorded it at {iso(cp.mtime_ns / 1e9)}"
            if cp is not None and cp.devices(r) is not None
            else "the checkpoint does not record it"
        )
        return Held(
            False,
            f"not registered: {recorded}; the live connection cannot be read: {obs.connections.error}; "
            f"the last reading of it: {last.why}",
            definitive=last.definitive,
            mends=last.mends,
        )

    def _by_connections(
        self,
        plugin: PluginSpec,
        s: _Seen,
        obs: PluginEvidence,
        seen: RoundEvidence,
        conns: int,
        *,
        recorded: int | None,
    ) -> Held:
        """Rule 1: the kubelet's connections to the listener that owns the plugin's socket file now.
        `recorded`: the healthy devices a checkpoint fresh for this pair of sockets lists (`accepted`)."""
        r, sock = plugin.resource, plugin.socket
        pair = Pair(obs.identity_after, self.kubelet.identity)
        held_before = s.connected_pair == pair
        # Once held, this pair of sockets stays accepted while connected: freshness compares file
        # times, which a clock step or a `touch` can reorder.
        accepted = 0 if held_before else recorded
        if unrecorded_connection(conns, seen.checkpoint.value, accepted):
            # A connection with no device list recorded since this socket was made is no
            # registration: a Register under way, or a dial the kubelet kept after refusing the
            # Register (seen with the real kubelet in the state of kubernetes PR 139338).
            s.lost_at = None
            shadowed = self._shadowed(plugin, s, seen, pair)
            if shadowed is not None:
                return shadowed
            return Held(
                False,
                f"the kubelet is connected to {sock} but has recorded no device list from it since "
                "the socket was created (a Register under way, or refused)",
            )
        s.shadowed = None
        if conns > 0 and held_before:
            against = self.streams.newer_evidence(plugin, obs, seen, pair)  # rules 1.1 to 1.4
            if against is not None:
                if against.held is not None:
                    s.lost_at = None
                return against
        if conns > 0:
            if not held_before:
                s.connected_pair, s.connected_since = pair, self.wall()
                self.streams.track(r, pair, obs.connection_ids, seen.checkpoint.value)
            s.lost_at = None
            return Held(True, f"the kubelet holds a connection to {sock}{self._device_note(r, seen)}")
        if held_before and obs.probe.ok:
            return self._dropped(r, sock, s, pair, endpoint_alive(r, seen))
        if conns == 0 and s.records_held == pair and obs.probe.ok:
            # Held by pod-resources or the checkpoint while only a count of 0 is trusted: confirmed once
            # `drop_confirm` later like any lost connection (a stopping kubelet closes its connections a
            # moment before its socket goes), then the drop.
            verdict = self._dropped(r, sock, s, pair, endpoint_alive(r, seen))
            if verdict.held is not None:
                s.records_held = None
            return verdict
        s.lost_at = None
        return Held(False, f"the kubelet holds no connection to {sock}: {self._not_held(r, seen, obs)}")

    def _shadowed(self, plugin: PluginSpec, s: _Seen, seen: RoundEvidence, pair: Pair) -> Held | None:
        """A new socket's connection stays unrecorded for `refusal_confirm` while pod-resources lists the
        resource's devices healthy: the kubelet keeps the endpoint of an earlier plugin on this path,
        with no stream of this socket behind it, and refused this Register (1.37, the stale-endpoint
        trap: the earlier plugin's stream ended after the kubelet had dropped its client). Only a
        kubelet restart mends it. Up to 1.36 the same evidence is a Register under way (the new client
        replaces the old, whose devices stay listed until the new list comes): None, as when
        pod-resources cannot be read."""
        live = seen.pod_resources.value
        healthy = (
            physical_devices(live.get(plugin.resource, ()), plugin.resource) if live is not None else set()
        )
        if not seen.kubelet_rules.refuses_second_register or not healthy:
            s.shadowed = None
            return None
        now = self.clock()
        if s.shadowed is None or s.shadowed[0] != pair:
            s.shadowed = (pair, now)
        if now - s.shadowed[1] < self.rules.refusal_confirm:
            # Under way or refused: not yet told, and a restart would be refused if it was. No liveness.
            return Held(
                False,
                f"the kubelet is connected to {plugin.socket} but has recorded no device list from it since "
                f"the socket was created, while pod-resources lists {len(healthy)} healthy device(s) of "
                f"{plugin.resource} (a Register under way, or refused for an earlier plugin's endpoint)",
                mends=False,
            )
        s.trap = (
            f"the kubelet refused the Register of {plugin.socket}: it keeps the endpoint of an earlier "
            "plugin on that path and has forgotten its client (Kubernetes 1.37: device plugin already "
            "connected); the next plugin restart will not register until the kubelet restarts"
        )
        return Held(
            False,
            f"the kubelet is connected to {plugin.socket} and recorded no device list from it in "
            f"{self.rules.refusal_confirm:g}s, while pod-resources lists {len(healthy)} healthy device(s) of "
            f"{plugin.resource} with no stream of this socket behind them (phantom capacity: Pods admitted "
            f"to them fail in Allocate): {s.trap}",
            definitive=True,
            mends=False,
        )

    def _dropped(self, r: str, sock: str, s: _Seen, pair: Pair, endpoint: bool | None) -> Held:
        """Rule 1, no connection left to a pair of sockets seen held: a drop, once confirmed.

        It held this plugin and let go while both sockets stayed: a drop, which no waiting mends
        (kubernetes issues 121994, 131013). Confirmed once, `drop_confirm` later, so that a kubelet
        on its way out (it disconnects before its socket goes) is not taken for one.
        """
        now = self.clock()
        if s.lost_at is None:
            s.lost_at = now
        if now - s.lost_at < self.rules.drop_confirm:
            return UNCONFIRMED
        # When it first held them, where a round saw it connect (not a sidecar started under the connection).
        held = f" (held it from {iso(s.connected_since)})" if s.connected_since else ""
        if self.streams.refused(r) and self.streams.pair(r) == pair and endpoint is not False:
            # The connections a refusal left open closed (grpc-go's idle timeout) while the kubelet keeps
            # the plugin's endpoint (pod-resources lists its healthy devices, or cannot be read): the
            # 1.37 trap, not a drop. The path is still refused: a plugin restart would not mend it.
            # Where pod-resources shows the devices unhealthy the kubelet dropped the plugin, whatever a
            # look-alike connection (a neighbour's, at the plugin's path in namespaces of its own) made
            # of it before: that is a drop, and it fails liveness below.
            phantom = PHANTOM if endpoint else ""
            s.trap = FORGOTTEN
            return Held(
                False,
                f"the kubelet is no longer connected to {sock}{held} and refused "
                f"its later Register: the path is refused until the kubelet restarts{phantom}",
                definitive=True,
                mends=False,
            )
        return Held(
            False,
            f"the kubelet is no longer connected to {sock}{held}: it dropped the "
            "plugin, which keeps serving; a plugin restart registers it again",
            definitive=True,
        )

    def _by_records(self, r: str, obs: PluginEvidence, seen: RoundEvidence) -> Held:
        """Rules 2 and 3, where the kubelet's connections cannot be seen: pod-resources (live) listing
        the resource's devices, else the checkpoint (history) dating an acceptance."""
        live = seen.pod_resources.value
        if live is not None and live.get(r):
            return Held(True, f"pod-resources lists {len(live[r])} device(s) of {r}")
        accepted = self.accepted(r, seen, obs)
        if accepted is None:
            return Held(False, f"{self._not_held(r, seen, obs)} ({obs.connections.error})")
        if live is None:
            # Rule 3 alone: the checkpoint is history, and the kubelet does not rewrite it when it drops a
            # plugin. Where the connection cannot be read either (a neighbour's look-alike pair at the
            # plugin's path makes it unknown), nothing live says the plugin is held: never registered on
            # that record, and no restart either (it would not tell more). Readiness only.
            cp = seen.checkpoint.value
            when = iso(cp.mtime_ns / 1e9) if cp is not None else "?"
            return Held(
                False,
                f"the kubelet's checkpoint recorded the plugin at {when} ({accepted} healthy device(s)); "
                f"no live evidence in this layout: the connection cannot be read ({obs.connections.error}) "
                f"and pod-resources cannot be read ({seen.pod_resources.error}); mount pod-resources",
                mends=False,
            )
        if accepted:
            return Held(
                False,
                f"pod-resources lists no device of {r} although the kubelet recorded {accepted} healthy: "
                "it dropped the plugin",
            )
        # `[]` in a fresh checkpoint: registered with no healthy device, or dropped; a restart would not
        # make a registered plugin more registered, so this passes, saying what cannot be told.
        return Held(True, f"the kubelet accepted the plugin ({accepted} healthy device(s) recorded)")

    def _not_held(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> str:
        return not_held_reason(seen.checkpoint, r, obs.identity_after, self._plugins[r].connected_since)

    @staticmethod
    def _device_note(r: str, seen: RoundEvidence) -> str:
        live = seen.pod_resources.value
        if live is None:
            return ""
        n = len(physical_devices(live.get(r, ()), r))
        return f"; pod-resources lists {n} healthy device(s)" if n else "; no healthy device listed"
