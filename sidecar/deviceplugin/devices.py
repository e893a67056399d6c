"""The devices and their recovery: rules D1 to D4 of docs/design.md#rule-families.

D1 the healthy physical devices the kubelet lists are counted by pod-resources (live), a checkpoint
written since the answering kubelet.sock (never a stale one) and the host's device nodes; D2 `devices:`
wants at least the expectation (one, a count, the host's, or none), readiness only; D3 `recover:`
(opt-in) asks for one plugin restart for devices HAMi can never mark healthy again, only while the
kubelet holds the plugin, no lost hold awaits its confirmation, the host still shows them and no running
pod holds one (`recovery`); D4 a new plugin socket re-reads every device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hami_guard.flags import DeviceExpectation, Expect, PluginSpec
from sidecar.deviceplugin.budget import RESTART_BUDGET
from sidecar.deviceplugin.connections import ConnectionEvidence
from sidecar.deviceplugin.evidence import Listener, PluginEvidence, RoundEvidence, Rules, iso
from sidecar.deviceplugin.kubelet import KubeletRestarts
from sidecar.deviceplugin.naming import physical_device, physical_devices
from sidecar.deviceplugin.recovery import DeviceRecovery
from sidecar.health import CheckKey, HealthState, Kind, Status


class _Wanted(NamedTuple):
    """The minimum of healthy devices the devices check wants, and where it comes from."""

    minimum: int
    why: str


class DeviceChecks:
    """Each plugin's device counts, the `devices:` check and, where it is on, `recover:`."""

    def __init__(
        self,
        rules: Rules,
        state: HealthState,
        listener: Listener,
        clock: Callable[[], float],
        wall: Callable[[], float],
        *,
        kubelet: KubeletRestarts,
        connections: ConnectionEvidence,
    ) -> None:
        self.rules = rules
        self.state = state
        self.listener = listener
        self.clock = clock
        self.wall = wall
        self.kubelet = kubelet
        self.connections = connections
        self.counts: dict[str, dict[str, int]] = {p.resource: {} for p in rules.plugins}
        # Per resource, where --recover-unhealthy-after is on: its devices' recovery (recovery.py).
        self._recovery = {
            p.resource: DeviceRecovery(p.resource, rules.recover_unhealthy_after, RESTART_BUDGET, iso)
            for p in rules.plugins
            if rules.recover_unhealthy_after > 0
        }

    def recovery(self) -> dict[str, dict[str, Any]]:
        """Per resource: the devices not listed healthy, the restarts asked for them, their outcome."""
        return {r: rec.as_dict() for r, rec in self._recovery.items()}

    def new_socket(self, r: str) -> None:
        """D4: the plugin re-reads every device, whether a restart was asked for them or not."""
        if r not in self._recovery:
            return
        self._recovery[r].restarted(self.wall())
        # The restart asked for is under way: no longer asked, whatever the round before said.
        why = "the plugin serves a new socket: its devices are judged against its new list"
        self.state.report(CheckKey(Kind.RECOVER, r).name, True, why, restarts=False)

    # -- devices: -----------------------------------------------------------------------------------
    def count(self, plugin: PluginSpec, seen: RoundEvidence) -> None:
        """D1, D2: healthy physical devices the kubelet lists now; a stale checkpoint's count is never one."""
        r = plugin.resource
        counts = self._counts(r, seen)
        self.listener.devices(r, counts)
        self.counts[r] = counts
        expect = self.rules.expect_devices
        if expect.kind is Expect.OFF:
            return  # opted out: a node where no healthy device is normal
        self._judge(r, counts, self._wanted(expect, seen))

    def _counts(self, r: str, seen: RoundEvidence) -> dict[str, int]:
        """D1: the counts by source: pod-resources (live), a checkpoint written since the answering
        kubelet.sock was created (none while the kubelet restarts), and the host's device nodes."""
        counts: dict[str, int] = {}
        live = seen.pod_resources.value
        if live is not None:
            counts["pod_resources"] = len(physical_devices(live.get(r, ()), r))
        cp = seen.checkpoint.value
        devices = cp.devices(r) if cp is not None else None
        if devices is not None and self.kubelet.fresh(cp):
            counts["checkpoint"] = len(physical_devices(devices, r))
        if seen.host_devices is not None:
            counts["host"] = seen.host_devices
        return counts

    def _judge(self, r: str, counts: Mapping[str, int], wanted: _Wanted) -> None:
        """D2: the kubelet lists at least the healthy devices wanted, by pod-resources, else by the
        checkpoint."""
        name = CheckKey(Kind.DEVICES, r).name
        want = wanted.minimum
        source = "pod-resources" if "pod_resources" in counts else "checkpoint"
        have = counts.get("pod_resources", counts.get("checkpoint"))
        # Devices are a readiness question: a GPU lost or broken is the node's. HAMi never marks a device
        # healthy again, which a plugin restart does after a transient fault: that restart is `recover:`'s.
        quiet = self._quiet(r)
        if have is None:
            why = "the kubelet is restarting" if self.kubelet.down else "no current count"
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

    def _quiet(self, r: str) -> str:
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

    def _wanted(self, expect: DeviceExpectation, seen: RoundEvidence) -> _Wanted:
        """D2: the minimum of healthy devices, and where it comes from."""
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

    # -- recover: -----------------------------------------------------------------------------------
    def judge_recovery(self, plugin: PluginSpec, obs: PluginEvidence, seen: RoundEvidence) -> None:
        """D3: devices HAMi can never mark healthy again, re-read by one plugin restart while the host
        still shows them and no running pod holds one (recovery.py)."""
        r = plugin.resource
        rec = self._recovery.get(r)
        if rec is None:
            return
        live = seen.pod_resources.value
        why = ""
        if self.kubelet.down:
            why = "the kubelet is restarting"
        elif not obs.probe.ok:
            why = "the plugin does not answer"
        elif self.state.checks[CheckKey(Kind.REGISTERED, r).name].status is not Status.OK:
            why = "the kubelet does not hold the plugin"
        elif self.connections.awaiting(r):
            why = "a lost hold of the plugin awaits its confirmation"
        elif live is None:
            why = f"pod-resources cannot be read ({seen.pod_resources.error})"
        listed = frozenset(physical_devices(live.get(r, ()), r)) if live is not None else None
        pods = seen.recovery.pod_devices.value
        held: dict[str, str] | None = None
        if pods is not None:
            held = {}
            for device, pod in sorted(pods.get(r, {}).items()):
                held.setdefault(physical_device(device, r), pod)
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
