"""Newer evidence against a held connection: rules 1.1 to 1.4 of docs/design.md#registration.

A connection is not a stream: once the kubelet holds a pair of sockets, its connections are followed
one by one (by the inode of the kubelet's socket), and the first of these that applies says it no longer
holds the plugin. 1.1 a later connection the kubelet recorded no device list from within
`refusal_confirm` is a refused second Register (1.37), and the stream it kept closing after it is the
stale-endpoint trap; 1.2 the connection that carried the registration closed while older ones stay;
1.3 pod-resources lists none of the devices a fresh checkpoint records healthy; 1.4 a fresh checkpoint no
longer lists the resource. 1.2 to 1.4 are drops, confirmed once, `drop_confirm` later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.evidence import (
    UNCONFIRMED,
    Held,
    Pair,
    PluginEvidence,
    RoundEvidence,
    Rules,
    accepted_devices,
    endpoint_alive,
)
from sidecar.deviceplugin.kubelet import KubeletRestarts

# After a refusal, once the stream the kubelet kept is gone: what pod-resources then shows, and the trap.
PHANTOM = (
    ": pod-resources still lists its devices healthy with no stream behind them (Pods admitted to them "
    "fail in Allocate)"
)
FORGOTTEN = (
    "the kubelet refused a second Register and dropped this plugin's client: the next plugin restart will "
    "not register until the kubelet restarts"
)


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


@dataclass
class _Streams:
    """The connections of one plugin's held pair, by inode, and which one carries the registration."""

    conns: dict[int, _Conn] = field(default_factory=dict)
    pair: Pair | None = None
    registered: int | None = None
    refused: bool = False  # the kubelet refused a later Register of the held pair (1.37): until a new pair
    contradicted_at: float | None = None  # monotonic: newer evidence first said the held pair is gone
    trap: str = ""  # this round: why the kubelet no longer keeps this plugin's client ("": it does)


class HeldStreams:
    """Each held plugin's connections one by one, and what newer than its registration says it is gone."""

    def __init__(
        self, rules: Rules, clock: Callable[[], float], kubelet: KubeletRestarts, resources: list[str]
    ) -> None:
        self.rules = rules
        self.clock = clock
        self.kubelet = kubelet
        self._plugins = {r: _Streams() for r in resources}

    def trap(self, r: str) -> str:
        """This round: why the kubelet no longer keeps this plugin's client ("": it does)."""
        return self._plugins[r].trap

    def begin_round(self, r: str) -> None:
        """A round's registration verdict begins: no trap said yet."""
        self._plugins[r].trap = ""

    def refused(self, r: str) -> bool:
        """The kubelet refused a later Register of the held pair (1.37)."""
        return self._plugins[r].refused

    def pair(self, r: str) -> Pair | None:
        """The pair whose connections are followed."""
        return self._plugins[r].pair

    def contradicted(self, r: str) -> bool:
        """Newer evidence against the held pair awaits its confirmation."""
        return self._plugins[r].contradicted_at is not None

    def due(self, now: float) -> list[float]:
        """When a contradiction or an unrecorded connection comes due for its confirmation."""
        drop, refusal = self.rules.drop_confirm, self.rules.refusal_confirm
        due = []
        for s in self._plugins.values():
            pending = [(s.contradicted_at, drop)]
            pending += [(c.first_seen, refusal) for c in s.conns.values() if not c.recorded and not c.refused]
            due += [t + wait for t, wait in pending if t is not None and t + wait > now]
        return due

    def track(self, r: str, pair: Pair, ids: frozenset[int] | None, cp: Checkpoint | None) -> None:
        """Follow the held pair's connections one by one: which came when, which the kubelet recorded.

        The connections there when the pair is first held are its registration (the unrecorded rule
        has vouched for them); one alone is the registered one. A later one is a second Register:
        recorded once the checkpoint is rewritten listing the resource after it came (the kubelet
        writes it on the first ListAndWatch answer of an accepted Register), and then the registered
        one, since the kubelet keeps the newest.
        """
        s = self._plugins[r]
        if ids is None:
            s.conns, s.pair, s.registered = {}, None, None
            return
        now = self.clock()
        if s.pair != pair:
            s.conns = {i: _Conn(now, None, True) for i in ids}
            s.pair = pair
            s.registered = next(iter(ids)) if len(ids) == 1 else None
            s.contradicted_at, s.refused = None, False
            return
        for i in ids - s.conns.keys():
            s.conns[i] = _Conn(now, self.kubelet.checkpoint_mtime, False, alongside=s.registered)
        for i in s.conns.keys() - ids:
            del s.conns[i]
        for c in s.conns.values():
            if c.alongside is not None and c.alongside not in ids:
                c.alongside = None
        self._mark_recorded(s, cp, r)

    @staticmethod
    def _mark_recorded(s: _Streams, cp: Checkpoint | None, r: str) -> None:
        """The later connections the kubelet recorded a device list from since they came: the newest of
        them carries the registration. One that came before any checkpoint was read cannot be told."""
        fresh = [
            (c.first_seen, i)
            for i, c in s.conns.items()
            if not c.recorded
            and not c.refused
            and cp is not None
            and c.checkpoint_before is not None
            and cp.mtime_ns > c.checkpoint_before
            and cp.devices(r) is not None
        ]
        for _, i in fresh:
            s.conns[i].recorded = True
        if fresh:
            s.registered = max(fresh)[1]
        for c in s.conns.values():
            if not c.recorded and c.checkpoint_before is None:
                # No checkpoint was read before it came: whether it was recorded cannot be told.
                c.recorded = True
                s.registered = None

    def newer_evidence(
        self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence, pair: Pair
    ) -> Held | None:
        """What, newer than the connection that made this pair held, says the kubelet no longer holds
        the plugin (1.1 to 1.4, the first that applies): a verdict that fails at once, `UNCONFIRMED`
        while it awaits its confirmation, None when nothing does.

        1.1 (`_refused_register`) no plugin restart mends: the kubelet refuses the path until it
        restarts. 1.2 to 1.4 (`_drop_evidence`) are drops, confirmed once, `drop_confirm` later, as a
        lost connection is: the kubelet changes its live view a moment before it rewrites the
        checkpoint, and a stopping kubelet closes its clients before its socket goes.
        """
        r = plugin.resource
        s = self._plugins[r]
        now = self.clock()
        self.track(r, pair, obs.connection_ids, seen.checkpoint.value)
        if seen.kubelet_rules.refuses_second_register:
            self._refused_register(plugin.socket, s, now)
        if s.refused:
            phantom = self._kept_stream_closed(plugin, s, obs, seen)
            if phantom is not None:
                return phantom
        why = self._drop_evidence(plugin, s, obs, seen, pair)
        if not why:
            s.contradicted_at = None
            return None
        s.trap = ""  # the kubelet dropped the plugin: no endpoint keeps the path, whatever connects to it
        if s.contradicted_at is None:
            s.contradicted_at = now
        if now - s.contradicted_at < self.rules.drop_confirm:
            return UNCONFIRMED
        return Held(False, why, definitive=True)

    def _refused_register(self, sock: str, s: _Streams, now: float) -> None:
        """Rule 1.1: a later connection the kubelet recorded no device list from within `refusal_confirm`.

        It refused a second Register (1.37, `device plugin already connected`): it keeps the stream it
        holds but forgets its client, so that stream's end will go unnoticed and the path is refused
        until the kubelet restarts. The plugin is registered still (`registered:` holds);
        `kubelet-client:` fails while the refused connection stays open. Up to 1.36 the kubelet accepts
        a second Register: the caller asks only under 1.37's rules. An accepted Register records its
        list within milliseconds, seconds on a loaded node: the bound is long, and only readiness waits.
        """
        for i, c in s.conns.items():
            if c.refused or now - c.first_seen < self.rules.refusal_confirm:
                continue
            if not c.recorded or c.alongside is not None:
                # Refused for as long as it stays open: the stream the kubelet kept rewrites the
                # checkpoint too, and would pass for it. (A connection that closes ends the verdict.)
                # One that came, and stayed, beside the connection that carried the registration is
                # refused whatever was written: 1.37 disconnects that one before it accepts another.
                c.refused = s.refused = True
                if s.registered == i:
                    s.registered = c.alongside
        refused = sum(1 for c in s.conns.values() if c.refused)
        if refused:
            s.trap = (
                f"the kubelet opened {refused} more connection(s) to {sock} (a second Register) and recorded "
                f"no device list from it in {self.rules.refusal_confirm:g}s: it refused that Register "
                "(Kubernetes 1.37: device plugin already connected) and dropped this plugin's client; the "
                "stream it keeps still feeds the devices, but their end will go unnoticed (phantom "
                "capacity) and the next plugin restart will not register until the kubelet restarts"
            )

    def _kept_stream_closed(
        self, plugin: PluginSpec, s: _Streams, obs: PluginEvidence, seen: RoundEvidence
    ) -> Held | None:
        """1.1, after a refusal: the connection that carried the stream the kubelet kept closed: the
        kubelet no longer keeps the plugin's client, so it never learns (no PluginDisconnected) and keeps
        the endpoint with no stream behind it. Not registered, readiness only: a plugin restart is
        refused the same way. Where pod-resources shows the devices gone unhealthy the kubelet did drop
        it (rule 1.3 says so, a drop): None, as when nothing closed."""
        ids = obs.connection_ids
        if s.registered is None or ids is None or s.registered in ids:
            return None
        endpoint = endpoint_alive(plugin.resource, seen)
        if endpoint is False:
            return None
        phantom = PHANTOM if endpoint else ""
        s.trap = FORGOTTEN
        return Held(
            False,
            f"the connection to {plugin.socket} that carried the stream the kubelet kept closed, and the "
            f"kubelet, which refused a later Register, no longer knows this plugin{phantom}: the path is "
            "refused until the kubelet restarts",
            definitive=True,
            mends=False,
        )

    def _drop_evidence(
        self, plugin: PluginSpec, s: _Streams, obs: PluginEvidence, seen: RoundEvidence, pair: Pair
    ) -> str:
        """Rules 1.2 to 1.4: why the kubelet dropped the held plugin, by the first that applies; "" when
        none does."""
        r, sock = plugin.resource, plugin.socket
        ids = obs.connection_ids
        closed = s.registered is not None and ids is not None and s.registered not in ids
        # Only newer connections left, each awaiting its record: a Register under way after the old
        # stream's end (1.37 frees the path then), not 1.2's pattern; the refusal rule decides them.
        awaiting = all(not c.recorded and not c.refused for c in s.conns.values())
        if closed and not s.refused and not awaiting:
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
        accepted = accepted_devices(seen.checkpoint.value, r, obs.identity_after, self.kubelet.identity)
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
