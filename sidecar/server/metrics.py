"""Prometheus metrics: names that make the runbook's SLIs work verbatim (docs/design.md#metrics).

`Metrics` holds one sidecar's series; `MetricsPublisher` sets them from the judges' verdicts (the
device plugins' and the DRA drivers'), and logs each check's transitions, within a budget per plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sidecar.health import Check, Status
from sidecar.reasons import HAMI_CODES

logger = logging.getLogger(__name__)

# `*_created` series double the exposition and no rule here uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# From a local re-registration (tens of ms) to a kubelet that takes its 10 s dial timeout.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
DEVICE_SOURCES = ("pod_resources", "checkpoint", "host")

# Transition lines per plugin (its resource; "" the node's own checks): a burst of LOG_BURST, then
# LOG_RATE a second. A kubelet restart moves a plugin's few checks twice (about ten lines); a plugin
# socket swapped every 2 ms moved them 2,000 times a minute, 818 KB of log. Past the budget, lines are
# counted, and the next one the budget allows (within 1 / LOG_RATE seconds) says how many were not
# logged and where every check of that plugin stands.
LOG_BURST = 20
LOG_RATE = 10 / 60
REASON_SHOWN = 160  # characters of a reason in that line


class _LogBudget:
    """One plugin's budget of transition lines (a token bucket), and what went unlogged."""

    def __init__(self, now: float) -> None:
        self.tokens = float(LOG_BURST)
        self.at = now
        self.dropped = 0
        self.since = 0.0  # wall clock of the first line not logged
        self.checks: dict[str, Check] = {}  # the plugin's checks seen moving (live objects)
        self.timer: asyncio.TimerHandle | None = None

    def take(self, now: float) -> bool:
        self.tokens = min(float(LOG_BURST), self.tokens + (now - self.at) * LOG_RATE)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def wait(self) -> float:
        """Seconds until the budget allows a line."""
        return max(0.0, (1.0 - self.tokens) / LOG_RATE)


class Metrics:
    """One registry per sidecar, so that several can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.attempts = Counter(
            "device_plugin_registration_attempt",
            "Registration cycles: opened by a new plugin socket or a kubelet restart",
            ["plugin", "resource"],
            registry=r,
        )
        self.successes = Counter(
            "device_plugin_registration_success",
            "Registration cycles confirmed by the kubelet's records within the grace",
            ["plugin", "resource"],
            registry=r,
        )
        self.listandwatch_latency = Histogram(
            "device_plugin_listandwatch_latency_seconds",
            "From the registration cycle's start to the kubelet recording the plugin's devices",
            ["plugin", "resource"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.probe_duration = Histogram(
            "device_plugin_probe_duration_seconds",
            "Duration of one live gRPC probe",
            ["socket"],
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.check_up = Gauge(
            "device_plugin_check_up",
            "1 pass, 0 fail, 0.5 pending",
            ["check", "resource", "plugin"],
            registry=r,
        )
        self.check_restarts = Gauge(
            "device_plugin_check_fails_liveness",
            "1 while the check's failure fails /healthz (a plugin restart is its remedy)",
            ["check", "resource", "plugin"],
            registry=r,
        )
        self.devices = Gauge(
            "device_plugin_devices",
            "Healthy physical devices per resource and source (pod_resources, checkpoint, host)",
            ["plugin", "resource", "source"],
            registry=r,
        )
        self.kubelet_connected = Gauge(
            "device_plugin_kubelet_connected",
            "1 while the kubelet holds a connection to the plugin socket; absent when it cannot be seen",
            ["plugin", "resource"],
            registry=r,
        )
        self.restart_requests = Counter(
            "device_plugin_liveness_restart_requests",
            "Liveness failure episodes for a plugin the kubelet does not hold (each asks for a restart)",
            ["plugin", "resource"],
            registry=r,
        )
        self.budget_spent = Gauge(
            "device_plugin_restart_budget_spent",
            "1 when plugin restarts did not bring registration back and liveness stopped asking for more",
            ["plugin", "resource"],
            registry=r,
        )
        # Devices HAMi can never mark healthy again, re-read by a plugin restart (--recover-unhealthy-after).
        self.recovery_restarts = Counter(
            "device_plugin_unhealthy_recovery_restarts",
            "Plugin restarts liveness asked for to re-read devices HAMi marked unhealthy (it never marks "
            "them healthy again)",
            ["plugin", "resource"],
            registry=r,
        )
        self.recovered_devices = Counter(
            "device_plugin_unhealthy_devices_recovered",
            "Devices listed healthy again after the plugin restart asked for them",
            ["plugin", "resource"],
            registry=r,
        )
        self.unrecoverable_devices = Gauge(
            "device_plugin_unhealthy_devices_unrecoverable",
            "Devices unhealthy again after the plugin restart that re-read them, not listed healthy: "
            "really unhealthy, no more restarts for them",
            ["plugin", "resource"],
            registry=r,
        )
        # HAMi's own registration (sidecar.hami): the `hami` check's reason, and what HAMi's scheduler sees.
        self.hami_reason = Gauge(
            "device_plugin_hami_registration",
            f"1 for the hami check's current reason code ({', '.join(HAMI_CODES)}), 0 for the others",
            ["plugin", "resource", "reason"],
            registry=r,
        )
        self.hami_gpus = Gauge(
            "device_plugin_hami_gpus",
            "Healthy GPUs HAMi's register annotation lists for the scheduler (0 when absent or undecodable); "
            "absent when the Node cannot be read",
            ["plugin", "resource"],
            registry=r,
        )
        self.kubelet_restarts = Counter("device_plugin_kubelet_restarts", "Kubelet restarts seen", registry=r)
        self.config_error = Gauge(
            "device_plugin_sidecar_config_error",
            "1 while hami-sidecar's flags or variables are invalid: it serves the error and judges nothing",
            registry=r,
        )

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, for /metrics."""
        return generate_latest(self.registry)


class MetricsPublisher:
    """The judges' listener: metrics, and one log line per transition."""

    def __init__(self, metrics: Metrics, label: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.m = metrics
        self.label = label
        self.clock = clock
        self._budgets: dict[str, _LogBudget] = {}

    def series(self, resource: str, *, registrations: bool = True, recovery: bool = False) -> None:
        """Every series of `resource` from the start: a series first seen at 1 hides that increase from
        increase(). `registrations` False: no registration cycles (a DRA driver's); `recovery`: the
        recovery of unhealthy devices is on."""
        if recovery:
            self.m.recovery_restarts.labels(self.label, resource)
            self.m.recovered_devices.labels(self.label, resource)
            self.m.unrecoverable_devices.labels(self.label, resource).set(0)
        if registrations:
            self.m.attempts.labels(self.label, resource)
            self.m.successes.labels(self.label, resource)
            self.m.listandwatch_latency.labels(self.label, resource)
        self.m.restart_requests.labels(self.label, resource)
        self.m.budget_spent.labels(self.label, resource).set(0)

    def probed(self, socket: str, latency: float) -> None:
        """A live probe of `socket` took `latency` seconds (0: no call was made)."""
        if latency:
            self.m.probe_duration.labels(socket).observe(latency)

    def attempt_opened(self, resource: str) -> None:
        """A registration cycle began."""
        self.m.attempts.labels(self.label, resource).inc()

    def attempt_closed(self, resource: str, latency: float | None) -> None:
        """A registration cycle ended: confirmed after `latency` seconds, or (None) not."""
        if latency is not None:
            self.m.successes.labels(self.label, resource).inc()
            self.m.listandwatch_latency.labels(self.label, resource).observe(latency)

    def kubelet_restarted(self) -> None:
        """The kubelet restarted."""
        self.m.kubelet_restarts.inc()

    def restart_requested(self, resource: str) -> None:
        """A liveness failure episode began: a restart of `resource`'s plugin or driver is asked for."""
        self.m.restart_requests.labels(self.label, resource).inc()

    def budget(self, resource: str, spent: bool) -> None:
        """Whether restarts stopped being asked for, having not brought registration back."""
        self.m.budget_spent.labels(self.label, resource).set(1 if spent else 0)

    def devices(self, resource: str, counts: Mapping[str, int]) -> None:
        """Healthy devices by source; a source missing from `counts` loses its series."""
        for source in DEVICE_SOURCES:
            if source in counts:
                self.m.devices.labels(self.label, resource, source).set(counts[source])
            else:  # a count that is not current (a stale checkpoint) is no count
                with contextlib.suppress(KeyError):
                    self.m.devices.remove(self.label, resource, source)

    def recovery(self, resource: str, event: str, count: int) -> None:
        """The recovery of unhealthy devices: a restart asked for, devices recovered, or unrecoverable."""
        if event == "restart":
            self.m.recovery_restarts.labels(self.label, resource).inc()
        elif event == "recovered":
            self.m.recovered_devices.labels(self.label, resource).inc(count)
        elif event == "unrecoverable":
            self.m.unrecoverable_devices.labels(self.label, resource).set(count)

    def connected(self, resource: str, count: int | None) -> None:
        """The kubelet's connections to `resource`'s socket; None (cannot be seen) removes the series."""
        gauge = self.m.kubelet_connected
        if count is None:
            with contextlib.suppress(KeyError):
                gauge.remove(self.label, resource)
        else:
            gauge.labels(self.label, resource).set(1 if count else 0)

    def hami(self, resource: str, code: str, gpus: int | None) -> None:
        """The hami check's reason code (every code's series exists: 1 for this one), and the healthy GPUs
        HAMi's annotation lists; None (no reading) removes that series."""
        for c in HAMI_CODES:
            self.m.hami_reason.labels(self.label, resource, c).set(1 if c == code else 0)
        if gpus is None:
            with contextlib.suppress(KeyError):
                self.m.hami_gpus.remove(self.label, resource)
        else:
            self.m.hami_gpus.labels(self.label, resource).set(gpus)

    def check(self, check: Check) -> None:
        """A check's state, as its gauges."""
        labels = (check.key.kind.value, check.key.resource, self.label)
        self.m.check_up.labels(*labels).set(check.status.up)
        self.m.check_restarts.labels(*labels).set(1 if check.live_failed else 0)

    def transition(self, check: Check, old: Status) -> None:
        """A check changed state: its gauges, and one log line within its plugin's budget."""
        self.check(check)
        resource = check.key.resource
        budget = self._budgets.get(resource)
        if budget is None:
            budget = self._budgets[resource] = _LogBudget(self.clock())
        budget.checks[check.name] = check
        if not budget.take(self.clock()):
            if not budget.dropped:
                budget.since = self.clock()
            budget.dropped += 1
            self._flush_later(resource, budget)
            return
        if budget.dropped:  # the line this budget allows says what was not logged, and where all stand
            self._log_unlogged(resource, budget)
            return
        log = logger.warning if check.status is Status.FAILED else logger.info
        effect = ""
        if check.status is Status.FAILED:
            effect = " (fails liveness)" if check.restarts else " (no restart: readiness only)"
        log(
            "check %s: %s -> %s%s: %s",
            check.name,
            old.value,
            check.status.value,
            effect,
            check.reason,
            extra={"check": check.name, "status": check.status.value, "previous": old.value},
        )

    def flush_transitions(self, resource: str) -> None:
        """The line for `resource`'s transitions not logged, once its budget allows one (else later)."""
        budget = self._budgets.get(resource)
        if budget is None:
            return
        budget.timer = None
        if not budget.dropped:
            return
        if budget.take(self.clock()):
            self._log_unlogged(resource, budget)
        else:
            self._flush_later(resource, budget)

    def _flush_later(self, resource: str, budget: _LogBudget) -> None:
        """Say what was not logged when the budget allows, even if nothing moves again (on the running
        loop; without one, with the next transition)."""
        if budget.timer is not None:
            return
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            budget.timer = loop.call_later(budget.wait() + 0.001, self.flush_transitions, resource)

    def _log_unlogged(self, resource: str, budget: _LogBudget) -> None:
        dropped, budget.dropped = budget.dropped, 0
        if budget.timer is not None:
            budget.timer.cancel()
            budget.timer = None
        states = []
        for c in budget.checks.values():
            state = f"{c.name} {c.status.value}" + (" (fails liveness)" if c.live_failed else "")
            if c.status is not Status.OK:
                state += f": {c.reason[:REASON_SHOWN]}"
            states.append(state)
        failed = any(c.status is Status.FAILED for c in budget.checks.values())
        (logger.warning if failed else logger.info)(
            "check transitions of %s: %d not logged in the last %.0f s (past %d, %g a minute); now %s",
            resource or "the node",
            dropped,
            self.clock() - budget.since,
            LOG_BURST,
            LOG_RATE * 60,
            "; ".join(states),
            extra={"resource": resource, "not_logged": dropped},
        )
