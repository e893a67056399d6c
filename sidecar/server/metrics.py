"""Prometheus metrics: names that make the runbook's SLIs work verbatim (docs/design.md#metrics)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# `*_created` series double the exposition and no rule here uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# From a local re-registration (tens of ms) to a kubelet that takes its 10 s dial timeout.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


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
        self.kubelet_restarts = Counter("device_plugin_kubelet_restarts", "Kubelet restarts seen", registry=r)
        self.config_error = Gauge(
            "device_plugin_sidecar_config_error",
            "1 while hami-sidecar's flags or variables are invalid: it serves the error and judges nothing",
            registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
