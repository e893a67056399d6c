"""The plugin socket's life: rules S1 to S8 of docs/design.md#rule-families.

S1 the kubelet.sock of the plugin socket's time tells a kubelet restart's cleanup from the plugin's
own stop; S2 a plugin socket newer than the answering kubelet.sock was not removed by that kubelet;
S3 a socket back within the restart window is a new cycle, one still missing a crash; S4 a socket
removed while its listener is still there, or while that cannot be told, is pending, never a crash;
S5 a socket the plugin served for a new kubelet that went before the kubelet held it is HAMi's
failed start, pending for the grace;
S6 an event a round ran ahead of judges nothing; S7 the `plugin:` check fails on a second failed
probe, never in a round that starved the kubelet's probe too, and never for another plugin's socket;
S8 a socket never served names the one served in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.budget import RestartBudget
from sidecar.deviceplugin.evidence import AfterDeletion, PluginEvidence, RoundEvidence, Rules
from sidecar.deviceplugin.kubelet import KubeletRestarts
from sidecar.deviceplugin.naming import pick_found, socket_found_instead
from sidecar.deviceplugin.probes import ProbeResult, SocketId
from sidecar.health import CheckKey, HealthState, Kind, Status

# How long a socket a round saw before its creation event waits for that event (the observer holds
# every event behind a move up to 0.5 s). Past it the event is taken as lost (an inotify overflow,
# the polling observer): events are read as they come again.
EVENT_LAG = 2.0


@dataclass(frozen=True)
class _Vanished:
    """The verdict on a plugin socket that vanished, kept while the socket stays missing."""

    verdict: str
    gone: bool  # the plugin stopped serving (not a kubelet restart's cleanup): it fails at once


@dataclass
class _Socket:
    """What the rules remember of one plugin's socket."""

    identity: SocketId | None = None  # its socket as last seen answering (or created)
    kubelet_then: SocketId | None = None  # kubelet.sock as last seen answering when `identity` was set
    known: bool = False  # seen at all since start
    judging: bool = False  # a deleted socket awaits its verdict
    # Since `identity` was set, its deletion's event (or a kubelet restart, which deletes every plugin
    # socket) was seen: a creation event handled once its file is gone is then a new socket's.
    unlinked: bool = False
    vanished: _Vanished | None = None  # a vanished socket's verdict
    # Its socket judged held by this kubelet since its cycle opened, on evidence that names the socket:
    # a failed start's socket never was.
    held_this_cycle: bool = False
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
    failed_at: float | None = None  # monotonic: a probe of the answering plugin first failed


class SocketLife:
    """Each plugin's socket from creation to its end, and the `plugin:` check."""

    def __init__(
        self,
        rules: Rules,
        state: HealthState,
        clock: Callable[[], float],
        kubelet: KubeletRestarts,
        budget: RestartBudget,
        *,
        new_socket: Callable[[str, SocketId | None], None],
        kubelet_gone: Callable[[str], None],
        names: Callable[[str], list[str]],
    ) -> None:
        self.rules = rules
        self.state = state
        self.clock = clock
        self.kubelet = kubelet
        self.budget = budget
        # What the judge does across the rule families: a new socket's cycle, a kubelet restart, and
        # the names of a plugin's checks.
        self._new_socket, self._kubelet_gone, self._names = new_socket, kubelet_gone, names
        self._plugins = {p.resource: _Socket() for p in rules.plugins}

    # -- what the other families ask ------------------------------------------------------------
    def identity(self, r: str) -> SocketId | None:
        """The plugin's socket as last seen answering (or created)."""
        return self._plugins[r].identity

    def served(self, r: str) -> bool:
        """Its own socket answered, or was seen created, since start."""
        return self._plugins[r].served

    def found(self, r: str) -> str | None:
        """The socket it seems to serve instead of its own."""
        return self._plugins[r].found

    def since_restart(self, r: str) -> bool:
        """It created a socket since the last kubelet restart began."""
        return self._plugins[r].since_restart

    def held_this_cycle(self, r: str) -> bool:
        """Its socket was judged held, on evidence that names the socket, since its cycle opened."""
        return self._plugins[r].held_this_cycle

    def mark_held(self, r: str) -> None:
        """S5: the kubelet held this cycle's socket: its end is a crash, not a failed start."""
        self._plugins[r].held_this_cycle = True

    def due(self, now: float) -> list[float]:
        """When a failed probe of an answering plugin comes due for its confirmation (none once due)."""
        drop = self.rules.drop_confirm
        due = [p.failed_at + drop for p in self._plugins.values() if p.failed_at is not None]
        return [t for t in due if t > now]

    # -- the judge's fan-out ----------------------------------------------------------------------
    def new(self, r: str, identity: SocketId | None, since_restart: bool) -> None:
        """A new plugin socket, whichever saw it first, event or probe."""
        p = self._plugins[r]
        p.identity, p.kubelet_then, p.known, p.unlinked = identity, self.kubelet.identity, True, False
        p.judging, p.vanished, p.held_this_cycle = False, None, False
        p.since_restart = since_restart
        # Its own socket came: whatever serves elsewhere in the folder is no restart of this plugin, even
        # where it stopped before a round probed it, or before its event was handled (identity None: the
        # cycle is opened on the event alone too).
        p.served, p.found = True, None

    def kubelet_gone(self) -> None:
        """A kubelet restart deletes every plugin socket: each must serve a new one."""
        for p in self._plugins.values():
            p.since_restart = False
            p.unlinked = True
            p.held_this_cycle = False

    # -- folder events ----------------------------------------------------------------------------
    def _event_due(self, p: _Socket) -> bool:
        """S6: whether the creation event of the socket a round saw first is still to come."""
        if p.event_due is not None and self.clock() >= p.event_due:
            p.event_due = None
        return p.event_due is not None

    def created(self, resource: str, identity: SocketId | None) -> None:
        """The creation event of a plugin socket; `identity` is the file there now. S6: an event that
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

    def deleted(self, resource: str) -> bool:
        """The deletion event of a plugin socket. True: the plugin's verdict is under way. False (S6): an
        older socket's event, handled after a round saw the next socket: nothing to judge."""
        p = self._plugins[resource]
        if self._event_due(p):
            return False
        p.judging = p.unlinked = True
        return True

    def end_judgement(self, resource: str) -> None:
        """The observation of a deleted socket ended (or failed): its verdict, if any, is in."""
        self._plugins[resource].judging = False

    def _fail(self, r: str, verdict: str, *, gone: bool, definitive: bool, restarts: bool) -> None:
        """The `plugin:` verdict of a vanished socket, kept while the socket stays missing."""
        name = CheckKey(Kind.PLUGIN, r).name
        self._plugins[r].vanished = _Vanished(verdict, gone=gone)
        self.state.report(name, False, verdict, definitive=definitive, restarts=restarts)

    def judge_vanished(self, plugin: PluginSpec, seen: AfterDeletion, restart_window_over: bool) -> bool:
        """S1 to S5: a deleted plugin socket: a kubelet restart (pending) or the plugin gone (failed)?
        True when the verdict must wait for the restart window."""
        r = plugin.resource
        p = self._plugins[r]
        if not p.judging:
            return False  # the socket is back already
        if seen.plugin is not None:
            self._new_socket(r, seen.plugin)
            return False
        restart = self._restart_removed(p, seen)
        if not restart and seen.listening and not restart_window_over:
            return True  # looked at again after the window: a stopping server unlinks before it closes
        if not restart and not seen.listening and not restart_window_over:
            return True
        p.judging = False
        pending = "" if restart else self._no_crash(plugin, p, seen)
        if pending:
            self.state.reset([CheckKey(Kind.PLUGIN, r).name])
            # The failed start's retry is HAMi's own; the others wait for the kubelet's word.
            restarts = True if seen.listening is False else not self.kubelet.down
            self._fail(r, pending, gone=False, definitive=False, restarts=restarts)
            return False
        if restart:
            # A new kubelet.sock a probe has already seen answering is a restart already counted
            # (and its cycles opened): the removal is that restart's cleanup, not another one.
            if seen.kubelet_refuses or seen.kubelet is None or seen.kubelet != self.kubelet.identity:
                self._kubelet_gone(f"{plugin.socket} was removed and {restart}")
            # The restart removed the socket: the plugin's checks wait for it again, even where a probe
            # saw the plugin answer between the restart's first sign and this removal.
            self.state.reset(self._names(r))
            verdict = f"{plugin.socket} was removed by a kubelet restart; waiting for the plugin"
        else:
            verdict = (
                f"{plugin.socket} was removed while the kubelet kept running: the plugin stopped serving"
            )
        # S3: a plugin gone is not a registration under way: it fails at once, grace or not.
        self._fail(r, verdict, gone=not restart, definitive=not restart, restarts=not self.kubelet.down)
        return False

    def _no_crash(self, plugin: PluginSpec, p: _Socket, seen: AfterDeletion) -> str:
        """Why a socket removed while the kubelet kept running is no crash (pending for the grace), or ""."""
        if seen.listening:
            # S4: the plugin did not stop: its listener is there, unlinked. Something else removed the
            # file: a kubelet restart's cleanup (kubelet.sock may still be the old one on a loaded node),
            # or a person. A plugin restart mends the latter only: pending for the grace, waiting for the
            # kubelet's word, never a crash.
            return (
                f"{plugin.socket} was removed while the plugin still listens on it (a kubelet restart "
                "removes every plugin socket before the new kubelet listens): waiting for kubelet.sock "
                "to tell; a plugin restart serves it again if no kubelet restart follows"
            )
        if seen.listening is None:
            # S4: whether the plugin still listens cannot be told (no sock_diag, or its listener was never
            # found): a crash is never judged on that alone. Pending for the grace, which a plugin that
            # stopped fails at its end, late; a restart within it opens a new cycle.
            return (
                f"{plugin.socket} was removed while the kubelet kept running, and whether the plugin "
                "still listens on it cannot be told: waiting for the plugin to serve it again"
            )
        if self.rules.missed_restart_after and p.since_restart and not p.held_this_cycle:
            # S5: the socket it served for the new kubelet went before the kubelet held it: HAMi's failed
            # start (its Register refused or failed), which it retries 30 s later by itself. Pending for
            # the grace, which covers that retry. Held, by its connections or by the records where they
            # cannot be read, it is a crash like any other.
            return (
                f"{plugin.socket} came and went after the kubelet's restart before the kubelet held it: "
                "a failed start, which HAMi retries 30 s later by itself"
            )
        return ""

    def _restart_removed(self, p: _Socket, seen: AfterDeletion) -> str:
        """S1, S2: why a kubelet restart explains the plugin socket's removal, or "" (it does not).

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
        if self.kubelet.down:
            return "a kubelet restart is under way"
        # The kubelet.sock of the plugin socket's time, not the last one probed: a probe may have
        # seen the new kubelet answer before this deletion's event was handled.
        then = p.kubelet_then or self.kubelet.identity
        if then is not None and seen.kubelet != then:
            return f"{name} is a new file"
        return ""

    # -- probe rounds -----------------------------------------------------------------------------
    def others_back(self, plugin: PluginSpec, seen: RoundEvidence) -> list[str]:
        """The other sockets that came back in the folder since the last round (a new file where it saw
        none, or another), by name; the folder as this round saw it is remembered."""
        p = self._plugins[plugin.resource]
        now = dict(seen.others)
        before, p.others = p.others, now
        if before is None:
            return []
        return sorted(n for n, ident in now.items() if before.get(n) != ident)

    def judge(self, plugin: PluginSpec, obs: PluginEvidence) -> bool:
        """S7: the plugin check; True when its socket vanished unannounced and awaits `judge_vanished`."""
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
            missed = self.kubelet.missed(p.since_restart)
            if missed:
                self.state.report(name, False, missed, definitive=True, restarts=True)
                return False
            self.state.report(name, False, v.verdict, definitive=v.gone, restarts=not self.kubelet.down)
            return False
        if result.ok and result.identity != p.identity:
            if p.known:
                self._new_socket(plugin.resource, result.identity)  # seen before its event
                p.event_due = self.clock() + EVENT_LAG
            else:
                p.identity, p.kubelet_then, p.known = result.identity, self.kubelet.identity, True  # at start
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
        if self._verdict_due(name, p, result):
            self._report(plugin, p, result)
        return False

    def _verdict_due(self, name: str, p: _Socket, result: ProbeResult) -> bool:
        """S7: whether the probe's outcome is reported now. A plugin that answered fails liveness on a
        second failed probe, `drop_confirm` after the first, not the first: one stalled call would
        otherwise hold /healthz at 503 for a whole interval."""
        if result.ok or result.definitive:
            p.failed_at = None
        elif result.state == "timeout" and self.kubelet.starved:
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

    def _report(self, plugin: PluginSpec, p: _Socket, result: ProbeResult) -> None:
        """S7, S8: report the probe's outcome, with whether a plugin restart mends it and, if not, why."""
        # While the kubelet is away its cleanup explains a missing socket: a restart would not help.
        restarts = not (self.kubelet.down and result.state == "absent")
        reason, quiet, r = result.reason, "", plugin.resource
        if result.ok:
            p.served, p.found = True, None
        elif not restarts:
            quiet = "the kubelet is restarting: its cleanup removed the socket, and HAMi serves a new one"
        elif result.state == "absent" and not p.served:
            # S8: never served since start: a plugin serving under another name, if the folder shows one;
            # restarts that do not bring the socket back are counted against the budget.
            found = pick_found(plugin, sorted(p.others or {}))
            p.found = found
            if found is not None:
                reason = f"{reason}; {socket_found_instead(self.rules.plugins, plugin, found)}"
            if self.budget.spent(r):
                restarts = False
                quiet = (
                    f"restart budget spent: {self.budget.in_vain(r)} plugin restarts did not bring "
                    f"{plugin.socket} back"
                )
        self.state.report(
            CheckKey(Kind.PLUGIN, r).name,
            result.ok,
            reason,
            result.latency,
            definitive=result.definitive,
            restarts=restarts,
            quiet=quiet,
        )
