"""The kubelet's restarts: rules K1 to K4 of docs/design.md#rule-families.

K1 a kubelet.sock gone, refusing, or a new file is a restart (or stop) under way; K2 a new kubelet
that answers ends it, and every plugin must register again; K3 a plugin that served no new socket
`missed_restart_after` after the new kubelet answered missed the restart; K4 the `kubelet` and
`checkpoint` checks never restart the plugin. What the rest of the judge does when a restart begins
is the judge's (`on_gone`): this module keeps the kubelet's side of it.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.evidence import NEWEST, Listener, Rules, logger
from sidecar.deviceplugin.probes import ProbeResult, Reading, SocketId
from sidecar.health import CheckKey, HealthState, Kind

KUBELET = CheckKey(Kind.KUBELET)
CHECKPOINT = CheckKey(Kind.CHECKPOINT)


class KubeletRestarts:
    """The kubelet as the rounds and events see it: which kubelet.sock answers, whether a restart is
    under way, how many were seen, and the `kubelet` and `checkpoint` checks."""

    def __init__(
        self,
        rules: Rules,
        state: HealthState,
        listener: Listener,
        clock: Callable[[], float],
        on_gone: Callable[[str], None],
    ) -> None:
        self.rules = rules
        self.state = state
        self.listener = listener
        self.clock = clock
        self.on_gone = on_gone  # a restart began: the judge tells every rule family
        # Only the plugin's own checks can ever fail liveness (a plugin restart is their remedy).
        state.add(KUBELET, restarts=False)
        state.add(CHECKPOINT, restarts=False)
        self.restarts = 0
        self.generation = 0  # kubelet restarts seen: a round begun before one is stale
        self.down = False  # a kubelet restart is under way
        self.back_at: float | None = None  # monotonic: a new kubelet answered after a restart
        self.starved = False  # this round's kubelet probe timed out too: the node (or we) are starved
        self.identity: SocketId | None = None  # kubelet.sock as last seen answering
        self.recreated = False
        # The checkpoint's mtime_ns as the last round read it before its connections: a connection first
        # seen this round came after it.
        self.checkpoint_mtime: int | None = None
        self.release = NEWEST  # the rules of the kubelet's release, as the last round read it

    def begin_restart(self) -> bool:
        """K1: a restart (or stop) begins; False when one is under way already."""
        if self.down:
            return False
        self.down = True
        self.back_at = None
        self.generation += 1
        return True

    def count_restart(self, why: str) -> bool:
        """A kubelet seen answering before went away: counted and published. False: none was ever seen
        answering, and there is nothing to restart from."""
        if self.identity is None:
            return False
        self.restarts += 1
        self.listener.kubelet_restarted()
        logger.info("kubelet restart detected: %s", why)
        return True

    def socket_event(self, kind: str, current: SocketId | None) -> None:
        """kubelet.sock was deleted or created; `current` is the file there now.

        Events trail the files by a few ms: when kubelet.sock is the one last seen answering, the
        event is about an older file, and a probe has already judged the change.
        """
        if self.identity is not None and current == self.identity:
            return
        if kind == "deleted":
            self.on_gone(f"{self.rules.kubelet_socket} was deleted")
        elif kind == "created":
            self.recreated = True

    def judge(self, k: ProbeResult) -> None:
        """K1, K2, K4: this round's probe of kubelet.sock."""
        # Another kubelet.sock than the one last seen answering is a restart, whatever the probe got
        # from it (a new kubelet may be between bind and listen, or still starting its server).
        if self.identity is not None and k.identity is not None and k.identity != self.identity:
            self.on_gone(f"{self.rules.kubelet_socket} is a new file")
        if k.ok:
            if self.recreated:
                self.on_gone(f"a new {self.rules.kubelet_socket} answers")
            if self.down and self.restarts:
                self.back_at = self.clock()
            self.down = False
            self.recreated = False
            self.identity = k.identity
        elif k.state in ("absent", "refused"):
            self.on_gone(k.reason)
        # A kubelet fault is never mended by restarting the plugin: HAMi registers again by itself
        # when kubelet.sock is created, and a restart would only add CrashLoopBackOff's delay.
        self.state.report(KUBELET.name, k.ok, k.reason, k.latency, definitive=k.definitive, restarts=False)

    def judge_checkpoint(self, checkpoint: Reading[Checkpoint]) -> None:
        """K4: lost evidence, never a liveness verdict: the live signals decide."""
        cp = checkpoint.value
        if cp is not None:
            self.state.report(
                CHECKPOINT.name, True, f"read: {len(cp.registered)} resource(s)", restarts=False
            )
        elif checkpoint.error.startswith("no checkpoint"):
            self.state.report(CHECKPOINT.name, True, checkpoint.error, restarts=False)
        else:
            self.state.report(CHECKPOINT.name, False, checkpoint.error, definitive=True, restarts=False)

    def missed(self, since_restart: bool) -> str:
        """K3: why the plugin missed the kubelet's restart, or "": a HAMi plugin answers a new
        kubelet.sock by serving a new socket at once (a failed start retries 30 s later, its socket having
        come and gone), so one that served none `missed_restart_after` after the new kubelet answered
        will not register on its own: waiting out the grace buys nothing."""
        wait = self.rules.missed_restart_after
        back = self.back_at
        if not wait or back is None or self.down or since_restart:
            return ""
        if self.clock() - back < wait:
            return ""
        return (
            f"the plugin served no new socket within {wait:g}s of the new kubelet.sock: it missed the "
            "kubelet's restart (HAMi serves a new socket at once when kubelet.sock is created) and will "
            "not register on its own; a plugin restart registers it"
        )

    def due(self, any_missing: bool, now: float) -> list[float]:
        """When K3 comes due, while a plugin has served no socket since the restart."""
        back, missed = self.back_at, self.rules.missed_restart_after
        if back is not None and missed and any_missing and back + missed > now:
            return [back + missed]
        return []

    def fresh(self, checkpoint: Checkpoint | None) -> bool:
        """A checkpoint written since the answering kubelet.sock was created (none while it restarts)."""
        return (
            checkpoint is not None
            and not self.down
            and self.identity is not None
            and checkpoint.mtime_ns >= self.identity.mtime_ns
        )
