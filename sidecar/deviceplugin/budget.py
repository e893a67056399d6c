"""The restart budget: rules B1 to B4 of docs/design.md#rule-families.

B1 a liveness failure episode for "not registered" followed by a new plugin socket that does not
register either is one restart in vain; B2 so is a failing `plugin:` for a socket never served, when
another socket comes back in the folder; B3 after `RESTART_BUDGET` in vain the failing check stops
failing liveness until registration is seen, said once; B4 a kubelet restart restores the budget
`registered:` spent, not the one `plugin:` spent on a socket never served.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hami_guard.flags import PluginSpec
from sidecar.deviceplugin.evidence import Listener, logger
from sidecar.health import Check

# Liveness failure episodes whose plugin restarts did not help, before giving up: "not registered", and a
# plugin socket that never came back (a plugin serving under another name).
RESTART_BUDGET = 3


@dataclass
class _Budget:
    """One plugin's restarts in vain."""

    episode: bool = False  # failing liveness for "not registered" since the last plugin restart
    in_vain: int = 0
    announced: bool = False  # logged and published once the spent budget took effect


class RestartBudget:
    """Each plugin's plugin restarts that did not help, and whether liveness may ask for another."""

    def __init__(self, plugins: Iterable[PluginSpec], listener: Listener) -> None:
        self.listener = listener
        self._plugins = {p.resource: _Budget() for p in plugins}

    def spent(self, r: str) -> bool:
        """B3: restarts no longer help; liveness stops failing for it."""
        return self._plugins[r].in_vain >= RESTART_BUDGET

    def in_vain(self, r: str) -> int:
        """The plugin restarts in vain so far."""
        return self._plugins[r].in_vain

    def announced(self, r: str) -> bool:
        """The spent budget took effect (logged and published)."""
        return self._plugins[r].announced

    def fresh(self, r: str) -> bool:
        """No liveness episode and no restart in vain: a new socket now is HAMi's own, not asked for."""
        b = self._plugins[r]
        return not b.episode and not b.in_vain

    def new_socket(self, r: str) -> None:
        """B1: the plugin restarted after liveness failed for "not registered": one in vain, until it
        registers."""
        b = self._plugins[r]
        if b.episode:
            b.episode = False
            b.in_vain += 1

    def kubelet_gone(self) -> None:
        """A kubelet restart ends every failure episode: the socket HAMi then serves is not a restart
        the livenessProbe asked for."""
        for b in self._plugins.values():
            b.episode = False

    def registered(self, r: str) -> None:
        """The kubelet holds the plugin: no episode, and the budget is whole again."""
        self._plugins[r].episode = False
        self.restore(r, "registered again")

    def restore(self, r: str, why: str) -> None:
        """B4 (and a registration): the budget is whole again, said where it had taken effect."""
        b = self._plugins[r]
        if not b.in_vain:
            return
        if b.announced:
            logger.info("%s %s: the restart budget is restored", r, why)
            self.listener.budget(r, False)
        b.in_vain, b.announced = 0, False

    def served_elsewhere(self, plugin: PluginSpec, back: list[str], live_failed: bool, served: bool) -> None:
        """B2: the plugin failed liveness for a socket it never served, and sockets (`back`) came back
        in the folder under other names: a restart in vain."""
        r = plugin.resource
        b = self._plugins[r]
        if not (live_failed and not served and back) or self.spent(r):
            return
        b.in_vain += 1
        if not self.spent(r):
            self.listener.restart_requested(r)  # still failing: the next restart is asked for
        logger.info(
            "%s: the plugin restarted and serves %s, not %s (%d of %d restarts in vain)",
            r,
            ", ".join(back),
            plugin.socket,
            b.in_vain,
            RESTART_BUDGET,
        )

    def registration_failed(self, check: Check) -> None:
        """B1, B3: `registered:` failed: a liveness failure opens an episode (the plugin restart it asks
        for is then one in vain, until registration is seen); a spent budget is said once."""
        r = check.key.resource
        b = self._plugins[r]
        if self.spent(r) and not b.announced:
            # Said when it takes effect: the failure after the last restart, not that restart.
            b.announced = True
            logger.warning(
                "restart budget spent for %s: %d plugin restarts did not bring registration back; "
                "liveness no longer fails for it until it registers or the kubelet restarts (this node "
                "needs a person)",
                r,
                RESTART_BUDGET,
            )
            self.listener.budget(r, True)
        if check.live_failed and not b.episode:
            b.episode = True
            self.listener.restart_requested(r)

    def never_served_failed(self, check: Check, socket: str, found: str | None) -> None:
        """B2, B3: `plugin:` failed for a socket the plugin never served since start: a restart is asked
        for, until the budget is spent."""
        r = check.key.resource
        b = self._plugins[r]
        if check.live_failed:
            self.listener.restart_requested(r)  # for a socket it never served
        elif self.spent(r) and not b.announced:
            b.announced = True
            logger.warning(
                "restart budget spent for %s: %d plugin restarts did not bring %s back%s; liveness no "
                "longer fails for it until it registers (this node needs a person)",
                r,
                b.in_vain,
                socket,
                f" (it serves {found})" if found else "",
            )
            self.listener.budget(r, True)
