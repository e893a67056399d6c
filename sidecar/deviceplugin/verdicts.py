"""Registration truth, and what a plugin restart would mend: the device plugins' judge, pure.

Inputs are observations (folder events, probe results, the kubelet's connections, pod-resources,
the checkpoint); outputs are the checks of a `HealthState` and the registration cycles. No I/O and
no sleeping here: `sidecar.deviceplugin.watch` gathers the observations and calls in; the clock is
injected. The judge holds no rule itself: each rule family is a collaborator of its own module
(docs/design.md#rule-families); the kubelet behaviour each rule rests on is in docs/kubelet.md
(#registration, #kubelet-restart, #stream-end, #checkpoint, #live-connection, #known-bugs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hami_guard.flags import Expect, PluginSpec
from sidecar.deviceplugin.attempts import Attempts
from sidecar.deviceplugin.budget import RestartBudget
from sidecar.deviceplugin.connections import ConnectionEvidence
from sidecar.deviceplugin.devices import DeviceChecks
from sidecar.deviceplugin.evidence import (
    AfterDeletion,
    Attempt,
    KubeletRules,
    Listener,
    RoundEvidence,
    Rules,
    iso,
)
from sidecar.deviceplugin.kubelet import KubeletRestarts
from sidecar.deviceplugin.probes import SocketId
from sidecar.deviceplugin.registration import RegistrationCheck
from sidecar.deviceplugin.sockets import SocketLife
from sidecar.deviceplugin.streams import HeldStreams
from sidecar.health import Check, CheckKey, HealthState, Kind, Status


class DevicePluginJudge:
    """Whether the kubelet holds each configured device plugin, from the folder's events and each
    probe round: the checks `kubelet`, `checkpoint`, `plugin:`, `registered:`, `kubelet-client:`,
    `devices:` and `recover:`, the kubelet restarts, the registration cycles and each plugin's restart
    budget. The one entry the watch calls; each rule family (docs/design.md#rule-families) is a
    collaborator that owns its own state, and what crosses families (a new socket, a kubelet restart,
    a check's transition) is fanned out here."""

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
        resources = [p.resource for p in rules.plugins]
        self.kubelet = KubeletRestarts(rules, self.state, listener, clock, self._kubelet_gone)
        for p in rules.plugins:
            for key in self._keys(p.resource):
                self.state.add(key, restarts=key.kind in (Kind.PLUGIN, Kind.REGISTERED))
        self._by_socket = {p.socket: p for p in rules.plugins}
        self.budget = RestartBudget(rules.plugins, listener)
        self.attempts = Attempts(resources, listener, clock, wall)
        self.sockets = SocketLife(
            rules,
            self.state,
            clock,
            self.kubelet,
            self.budget,
            new_socket=self._new_socket,
            kubelet_gone=self._kubelet_gone,
            names=self._names,
        )
        self.streams = HeldStreams(rules, clock, self.kubelet, resources)
        self.connections = ConnectionEvidence(
            rules, listener, clock, wall, kubelet=self.kubelet, streams=self.streams
        )
        self.registered = RegistrationCheck(
            self.state,
            listener,
            kubelet=self.kubelet,
            sockets=self.sockets,
            connections=self.connections,
            budget=self.budget,
            attempts=self.attempts,
        )
        self.device_checks = DeviceChecks(
            rules, self.state, listener, clock, wall, kubelet=self.kubelet, connections=self.connections
        )

    # -- what the views read ------------------------------------------------------------
    @property
    def history(self) -> Sequence[Attempt]:
        """The last 50 registration cycles, oldest first."""
        return self.attempts.history

    @property
    def kubelet_restarts(self) -> int:
        """Restarts (or stops) of a kubelet seen answering before."""
        return self.kubelet.restarts

    @property
    def generation(self) -> int:
        """Kubelet restarts seen: a round begun before one is stale."""
        return self.kubelet.generation

    @property
    def kubelet_rules(self) -> KubeletRules:
        """The rules of the kubelet's release, as the last round read it."""
        return self.kubelet.release

    def plugin(self, socket: str) -> PluginSpec | None:
        """The configured plugin serving on `socket` (a file name in the folder), if any."""
        return self._by_socket.get(socket)

    def plugin_for(self, resource: str) -> PluginSpec:
        """The configured plugin of `resource`."""
        return next(p for p in self.rules.plugins if p.resource == resource)

    def devices(self) -> dict[str, dict[str, int]]:
        """Per resource: the healthy physical devices last counted, by source."""
        return {r: dict(c) for r, c in self.device_checks.counts.items()}

    def registration(self) -> dict[str, dict[str, Any]]:
        """Per resource: connection, budget and the open cycle, for /status."""
        out = {}
        for p in self.rules.plugins:
            r = p.resource
            since = self.connections.connected_since(r)
            attempt = self.attempts.current(r)
            out[r] = {
                "kubelet_connected_since": iso(since) if since else None,
                "restarts_without_registration": self.budget.in_vain(r),
                "restart_budget_spent": self.budget.announced(r),
                "socket_found_instead": self.sockets.found(r),
                "open_attempt": attempt.as_dict() if attempt else None,
            }
        return out

    def recovery(self) -> dict[str, dict[str, Any]]:
        """Per resource: the devices not listed healthy, the restarts asked for them, their outcome."""
        return self.device_checks.recovery()

    def wake_at(self) -> float | None:
        """When a round must run to confirm a lost connection, a failed probe, newer evidence against a
        held plugin or a refusal, or a missed kubelet restart (monotonic), if one must."""
        now = self.clock()
        missing = any(not self.sockets.since_restart(p.resource) for p in self.rules.plugins)
        due = self.connections.due(now) + self.sockets.due(now) + self.kubelet.due(missing, now)
        due += self.streams.due(now)
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
        """kubelet.sock was deleted or created; `current` is the file there now."""
        self.kubelet.socket_event(kind, current)

    def plugin_socket_created(self, resource: str, identity: SocketId | None) -> None:
        """The creation event of a plugin socket; `identity` is the file there now. An event that
        trails what a round saw opens no new cycle."""
        self.sockets.created(resource, identity)

    def plugin_socket_deleted(self, resource: str) -> bool:
        """The deletion event of a plugin socket. True: the plugin's verdict is under way, and the
        caller observes, then calls `judge_vanished`. False: an older socket's event, handled after a
        round saw the next socket (whose creation event is still to come): nothing to judge."""
        return self.sockets.deleted(resource)

    def end_judgement(self, resource: str) -> None:
        """The observation of a deleted socket ended (or failed): its verdict, if any, is in."""
        self.sockets.end_judgement(resource)

    def judge_vanished(self, resource: str, seen: AfterDeletion, restart_window_over: bool) -> bool:
        """A deleted plugin socket: a kubelet restart (pending) or the plugin gone (failed)? Returns True
        when the verdict must wait for the restart window."""
        return self.sockets.judge_vanished(self.plugin_for(resource), seen, restart_window_over)

    # -- what crosses the rule families ------------------------------------------------------------
    def _new_socket(self, resource: str, identity: SocketId | None) -> None:
        """A new plugin socket: a new registration cycle, whichever saw it first, event or probe."""
        # HAMi's own answer to a kubelet restart, not a restart liveness asked for.
        since_restart = self.kubelet.restarts > 0 and self.budget.fresh(resource)
        self.sockets.new(resource, identity, since_restart)
        self.connections.new_socket(resource)
        self.budget.new_socket(resource)  # the plugin restarted after liveness failed: one in vain
        self.device_checks.new_socket(resource)
        self.state.reset(self._names(resource))
        self.attempts.open(resource, "new plugin socket")

    def _kubelet_gone(self, why: str) -> None:
        """A kubelet restart (or stop) is under way: every plugin must register again."""
        if not self.kubelet.begin_restart():
            return
        self.sockets.kubelet_gone()
        self.connections.kubelet_gone()
        self.budget.kubelet_gone()
        if not self.kubelet.count_restart(why):
            return  # never seen answering: nothing to restart from
        for p in self.rules.plugins:
            # The restart budget `registered:` spent bounds plugin restarts against one kubelet: the
            # new one is a new chance, and a plugin that does not register with it (HAMi's own
            # failure) is mended by a restart again. Not the budget `plugin:` spent on a socket never
            # served (a renamed resourceName): no kubelet restart mends a setting.
            if self.sockets.served(p.resource):
                self.budget.restore(p.resource, "after a kubelet restart")
        self.state.reset(list(self.state.checks))
        for p in self.rules.plugins:
            self.attempts.open(p.resource, "kubelet restart")

    # -- probe rounds -------------------------------------------------------------------------
    def round(self, seen: RoundEvidence) -> list[str]:
        """Judge one probe round; returns the resources whose socket vanished unannounced (the caller
        observes the folder and calls `judge_vanished` for each).

        A round begun before a kubelet restart was seen (an event's verdict landed while it probed) is
        dropped: its kubelet answered before the restart, and the event has asked for a new round.
        """
        if seen.generation not in (None, self.kubelet.generation):
            return []
        self.kubelet.release = seen.kubelet_rules
        self.kubelet.starved = seen.kubelet.state == "timeout"
        self.kubelet.judge(seen.kubelet)
        self.kubelet.judge_checkpoint(seen.checkpoint)
        vanished = []
        for plugin in self.rules.plugins:
            r = plugin.resource
            obs = seen.plugins[r]
            live_failed = self.state.checks[CheckKey(Kind.PLUGIN, r).name].live_failed
            back = self.sockets.others_back(plugin, seen)
            self.budget.served_elsewhere(plugin, back, live_failed, self.sockets.served(r))
            if self.sockets.judge(plugin, obs):
                vanished.append(r)
            self.registered.judge(plugin, obs, seen)
            self.device_checks.judge_recovery(plugin, obs, seen)
            self.device_checks.count(plugin, seen)
        cp = seen.checkpoint.value
        self.kubelet.checkpoint_mtime = (
            seen.checkpoint_before if seen.checkpoint_before is not None else cp.mtime_ns if cp else None
        )
        return vanished

    # -- transitions -------------------------------------------------------------------------------
    def refresh(self) -> float | None:
        """Fail pending checks whose grace ran out; when the next one will (monotonic)."""
        return self.state.refresh()

    def _on_transition(self, check: Check, old: Status) -> None:
        r = check.key.resource
        if check.status is Status.FAILED and check.key.kind is Kind.REGISTERED:
            # `registered:` failed: the cycle closes unregistered, and the budget hears of it.
            self.attempts.close(r, registered=False)
            self.budget.registration_failed(check)
        elif check.status is Status.FAILED and check.key.kind is Kind.PLUGIN and not self.sockets.served(r):
            found = self.sockets.found(r)
            self.budget.never_served_failed(check, self.plugin_for(r).socket, found)
        self.listener.transition(check, old)
