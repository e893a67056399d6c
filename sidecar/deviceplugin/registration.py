"""The `registered:` and `kubelet-client:` checks: rules L1 to L3 of docs/design.md#rule-families.

L1 `registered:` says whether the kubelet holds the plugin (`connections`), and fails liveness only
while kubelet.sock answers as the real registration service, the plugin serves and owns its socket,
a plugin restart can register it and the budget is not spent; L2 `kubelet-client:` fails, readiness
only, while the kubelet refuses the plugin's path (the 1.37 trap: only a kubelet restart mends it);
L3 every `[!]` line says why it restarts nothing, true for the state at hand.
"""

from __future__ import annotations

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.attempts import Attempts
from sidecar.deviceplugin.budget import RESTART_BUDGET, RestartBudget
from sidecar.deviceplugin.connections import ConnectionEvidence
from sidecar.deviceplugin.evidence import Listener, Pair, PluginEvidence, RoundEvidence
from sidecar.deviceplugin.kubelet import KubeletRestarts
from sidecar.deviceplugin.sockets import SocketLife
from sidecar.health import CheckKey, HealthState, Kind


class RegistrationCheck:
    """Each round's `registered:` and `kubelet-client:` verdicts, and what a registration closes."""

    def __init__(
        self,
        state: HealthState,
        listener: Listener,
        *,
        kubelet: KubeletRestarts,
        sockets: SocketLife,
        connections: ConnectionEvidence,
        budget: RestartBudget,
        attempts: Attempts,
    ) -> None:
        self.state = state
        self.listener = listener
        self.kubelet = kubelet
        self.sockets = sockets
        self.connections = connections
        self.budget = budget
        self.attempts = attempts

    def judge(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> None:
        """L1, L2: this round's verdicts for one plugin."""
        r = plugin.resource
        name = CheckKey(Kind.REGISTERED, r).name
        self.connections.begin_round(r)
        if self.kubelet.down:
            self.connections.kubelet_down(r)
            self.listener.connected(r, None)
            why = "the kubelet is restarting; the plugin must register again"
            self.state.report(
                name, False, why, restarts=False, quiet="a kubelet restart: HAMi registers again by itself"
            )
            self._report_client(r, "the kubelet is restarting: a new kubelet holds no refusal")
            return
        verdict = self.connections.held(plugin, obs, seen)
        self._report_client(r, "no refused Register seen: the kubelet keeps the plugin's client")
        if verdict.held is None:
            return  # a lost connection, or newer evidence against a held one, waits for its confirmation
        held, why = verdict.held, verdict.why
        if held:
            self._held(r, obs, seen)
        # Restarting the plugin registers it again, unless the kubelet cannot take it or the plugin is
        # not serving (its own check says so) or restarts have already failed to help.
        restarts = (
            verdict.mends
            and seen.kubelet.verified
            and obs.probe.ok
            and obs.owner != "elsewhere"
            and not self.budget.spent(r)
        )
        if not held and self.budget.spent(r):
            why = f"{why}; restart budget spent: {RESTART_BUDGET} plugin restarts did not register it"
        self.state.report(
            name,
            held,
            why,
            definitive=verdict.definitive,
            restarts=restarts,
            quiet=self._quiet(plugin, obs, seen),
        )

    def _held(self, r: str, obs: PluginEvidence, seen: RoundEvidence) -> None:
        """The kubelet holds the plugin: what that ends (an episode, a spent budget, an open cycle)."""
        self.budget.registered(r)
        # The socket of this cycle, not one that replaced it while the round looked.
        pair = Pair(obs.identity_after, self.kubelet.identity)
        this_cycle = pair.plugin is not None and pair.plugin == self.sockets.identity(r)
        if (
            this_cycle
            and not self.sockets.held_this_cycle(r)
            and self.connections.names_socket(r, pair, obs, seen)
        ):
            self.sockets.mark_held(r)
        self.connections.note_held(r, pair)
        if self._recorded(r, seen, obs):
            self.attempts.close(r, registered=True)

    def _recorded(self, r: str, seen: RoundEvidence, obs: PluginEvidence) -> bool:
        """The kubelet has the plugin's first ListAndWatch answer: the end of the latency SLI."""
        live = seen.pod_resources.value
        return bool(live and live.get(r)) or self.connections.accepted(r, seen, obs) is not None

    def _report_client(self, r: str, ok: str) -> None:
        """L2: does the kubelet still keep a client for the plugin's path, or did it refuse a second
        Register and drop it (1.37)? Readiness only: only a kubelet restart mends it."""
        trap = self.connections.trap(r)
        self.state.report(
            CheckKey(Kind.KUBELET_CLIENT, r).name,
            not trap,
            trap or ok,
            definitive=True,
            restarts=False,
            quiet="only a kubelet restart mends it: the kubelet refuses this plugin's path until then",
        )

    def _quiet(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> str:
        """L3: why `registered:` restarts nothing, true for the state at hand."""
        r = plugin.resource
        sock = self.state.checks[CheckKey(Kind.PLUGIN, r).name]
        spent = self.budget.spent(r)
        if not seen.kubelet.verified:
            return "the kubelet's socket is not the real registration service: a plugin restart won't mend it"
        if obs.owner == "elsewhere":
            return "another device plugin owns the socket: a restart of this one would only fight it"
        if not obs.probe.ok and not (spent and not sock.live_failed):
            # Said alike while that check is pending and once it fails: the text outlives the round.
            return (
                f"the plugin does not answer: {sock.name} judges that, and the plugin restart it asks for "
                "mends this too"
            )
        if spent:
            return f"restart budget spent: {self.budget.in_vain(r)} plugin restarts did not register it"
        return ""
