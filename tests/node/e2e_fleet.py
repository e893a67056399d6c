"""The runbook's cluster rule on a real node: kube-state-metrics (built from its Go module by `make
node-bins`, tests/node/kube-state-metrics/go.mod) watches the node's API server, Debian's Prometheus
scrapes it and evaluates manifests/monitoring/prometheusrule.yaml, and `HamiGPUNodeWithoutGPUCapacity`
must fire for the node while its plugin is unregistered and resolve once it registers again.

Both processes are started by this file's fixture, listen on the node's loopback only, keep their data in
a folder of the run, and are ended by it. Prometheus evaluates a copy of the rule file in which every
`for:` is FOR (seconds, not the shipped minutes), so that an alert fires within the test; every expression
is the file's own (test_the_rules_are_the_shipped_ones). Prometheus also scrapes hami-sidecar's /metrics in
the plugin's pod with the PodMonitor's job as the Prometheus Operator generates it (tests/test_monitoring.py's
scrape job), so the node's own alerts show beside the cluster's. Debian's Prometheus is built without
Kubernetes discovery: the target is the pod's IP in a file (file_sd), with the meta labels discovery gives.

The kubelet's device manager as this node runs it: a kubelet restarted restores each checkpointed resource
with no devices (capacity 0) until its plugin registers again; a plugin whose ListAndWatch stream ends has
its devices marked unhealthy (allocatable 0, capacity kept) until the endpoint's 5-minute stop grace ends,
when the resource is removed and its capacity set to 0. Both are measured here, with the alert's state.
Times (fault to firing, fix to resolved) are appended to $NODE_E2E_DIR/figures.txt: measured, not asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from testing import free_port
from tests.conftest import require_tool, stop_process
from tests.node.kit import (
    DEVICES,
    HERE,
    NODE,
    RUN,
    fault_applied,
    figure,
    healthy_plugin,
    node_ctl,
    node_resources,
    plugin_pod,
    restarts,
    set_fault,
    wait,
)
from tests.test_monitoring import scrape_config

if not RUN:
    pytest.skip("runs inside the node: make node-e2e", allow_module_level=True)

RULES = HERE.parent.parent / "manifests" / "monitoring" / "prometheusrule.yaml"
KUBE_STATE_METRICS = HERE / "bin" / "kube-state-metrics"
SIDECAR_PORT = 9395  # manifests/hami-patch's guard-http
ALERT = "HamiGPUNodeWithoutGPUCapacity"
# The test copy's `for:` for every alert (the shipped cluster rule waits 15m; the node's alerts 1m-10m).
FOR = "10s"
GRACE = 300.0  # the kubelet's endpointStopGracePeriod (pkg/kubelet/cm/devicemanager/types.go)


def rules_for_the_node() -> dict[str, Any]:
    """The PrometheusRule's groups with every `for:` set to FOR; nothing else changed."""
    spec: dict[str, Any] = yaml.safe_load(RULES.read_text())["spec"]
    for group in spec["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR
    return spec


def test_the_rules_are_the_shipped_ones() -> None:
    shipped = yaml.safe_load(RULES.read_text())["spec"]
    copied = rules_for_the_node()
    for mine, theirs in zip(
        [r for g in copied["groups"] for r in g["rules"]],
        [r for g in shipped["groups"] for r in g["rules"]],
        strict=True,
    ):
        assert {k: v for k, v in mine.items() if k != "for"} == {
            k: v for k, v in theirs.items() if k != "for"
        }
    assert any(r.get("alert") == ALERT for g in copied["groups"] for r in g["rules"])


# -- kube-state-metrics and Prometheus, on the node's loopback ------------------------------------
@dataclass
class Monitor:
    url: str
    folder: Path

    def point_at_the_plugin(self) -> None:
        """The sidecar's target: the plugin pod's IP, with the labels Kubernetes discovery would give it."""
        pod = plugin_pod()
        (group,) = scrape_config({NODE: (pod["metadata"]["name"], SIDECAR_PORT)})["static_configs"]
        group["targets"] = [f"{pod['status']['podIP']}:{SIDECAR_PORT}"]
        (self.folder / "sidecar.json.new").write_text(json.dumps([group]))
        (self.folder / "sidecar.json.new").rename(self.folder / "sidecar.json")

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def value(self, expr: str) -> str:
        """An instant query's single value ('' when it returns nothing)."""
        result = self.api("query", query=expr)["result"]
        assert len(result) <= 1, result
        return str(result[0]["value"][1]) if result else ""

    def alerts(self) -> list[dict[str, Any]]:
        """The pending and firing alerts for this node."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("node") == NODE]

    def logs(self) -> str:
        return "\n".join(
            f"{p.name}: {p.read_text(errors='replace')[-2000:]}" for p in self.folder.glob("*.log")
        )


def started(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def monitor() -> Iterator[Monitor]:
    """kube-state-metrics and Prometheus, started for this file and ended after it, their files removed."""
    prometheus = require_tool("prometheus")
    if not os.access(KUBE_STATE_METRICS, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("tests/node/bin/kube-state-metrics is required in CI (make node-bins)")
        pytest.skip("tests/node/bin/kube-state-metrics missing (make node-bins)")
    folder = Path(tempfile.mkdtemp(prefix="fleet-", dir=RUN))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ksm_port, prom_port = free_port(), free_port()
        procs.append(
            started(
                [
                    str(KUBE_STATE_METRICS),
                    f"--kubeconfig={RUN}/admin.kubeconfig",
                    "--host=127.0.0.1",
                    f"--port={ksm_port}",
                    "--telemetry-host=127.0.0.1",
                    f"--telemetry-port={free_port()}",
                    "--resources=nodes",
                    # kube_node_labels carries gpu only when allowed (the rule file says so).
                    "--metric-labels-allowlist=nodes=[gpu]",
                ],
                folder / "kube-state-metrics.log",
            )
        )
        mon = Monitor(f"http://127.0.0.1:{prom_port}", folder)
        # The PodMonitor's job (the operator's relabelings), its target in a file.
        sidecars = scrape_config({})
        del sidecars["static_configs"]
        sidecars["file_sd_configs"] = [{"files": [str(folder / "sidecar.json")], "refresh_interval": "1s"}]
        mon.point_at_the_plugin()
        (folder / "rules.yaml").write_text(yaml.safe_dump(rules_for_the_node()))
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(folder / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "kube-state-metrics",
                    "static_configs": [{"targets": [f"127.0.0.1:{ksm_port}"]}],
                },
                sidecars,
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        procs.append(
            started(
                [
                    prometheus,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--log.level=warn",
                ],
                folder / "prometheus.log",
            )
        )

        def up() -> bool:
            for p in procs:
                if p.poll() is not None:
                    pytest.fail(f"{p.args!r} exited {p.returncode}:\n{mon.logs()}")
            try:
                seen = {
                    "gpu=on": mon.value(f'kube_node_labels{{node="{NODE}", label_gpu="on"}}'),
                    "capacity": mon.value(capacity_query()),
                    "sidecar up": mon.value(f'max(up{{node="{NODE}"}})'),  # the PodMonitor's job
                }
            except OSError as e:  # Prometheus not listening yet
                seen = {"error": str(e)}
            assert seen == {"gpu=on": "1", "capacity": DEVICES, "sidecar up": "1"}, seen
            return True

        wait("Prometheus scraping kube-state-metrics and the node's sidecar", up, 120, 1)
        yield mon
    finally:
        for p in reversed(procs):
            stop_process(p)
        shutil.rmtree(folder, ignore_errors=True)


def capacity_query() -> str:
    """The Node's nvidia.com/gpu capacity as kube-state-metrics exports it (the rule's series)."""
    return f'kube_node_status_capacity{{node="{NODE}", resource="nvidia_com_gpu", unit="integer"}}'


# -- following a fault ------------------------------------------------------------------------------
@dataclass
class Watch:
    """What the tests follow after a fault, each change stamped in seconds since it: the Node's capacity and
    allocatable as the API server holds them, the capacity kube-state-metrics exports, and the alerts'
    states for the node (the cluster rule's, and the first time each of the node's own alerts fired)."""

    mon: Monitor
    t0: float = field(default_factory=time.monotonic)
    changes: list[tuple[float, str, str, str, str]] = field(default_factory=list)
    fired: dict[str, float] = field(default_factory=dict)
    already: set[str] = field(default_factory=set)  # the node's alerts firing before the fault

    def __post_init__(self) -> None:
        self.already = {self.key(a) for a in self.mon.alerts() if a["state"] == "firing"}

    @staticmethod
    def key(alert: dict[str, Any]) -> str:
        labels = alert["labels"]
        return (
            f"{labels['alertname']}{{{labels['check']}}}" if labels.get("check") else str(labels["alertname"])
        )

    def now(self) -> float:
        return time.monotonic() - self.t0

    def poll(self) -> tuple[str, str, str, str]:
        capacity, alloc = node_resources()
        exported = self.mon.value(capacity_query())
        state = ""
        for a in self.mon.alerts():
            name = a["labels"]["alertname"]
            if name == ALERT:
                state = a["state"]
            elif a["state"] == "firing" and self.key(a) not in self.already:
                self.fired.setdefault(self.key(a), self.now())
        now = (capacity, alloc, exported, state)
        if not self.changes or self.changes[-1][1:] != now:
            self.changes.append((self.now(), *now))
        return now

    def until(self, what: str, cond: Callable[[str, str, str, str], bool], timeout: float) -> float:
        wait(what, lambda: cond(*self.poll()), timeout, 0.5)
        return self.changes[-1][0] if self.changes else self.now()

    def story(self) -> str:
        return "; ".join(
            f"{t:.0f} s: capacity {c or '-'}/allocatable {a or '-'}/exported {e or '-'}/{s or 'inactive'}"
            for t, c, a, e, s in self.changes
        )

    def node_alerts(self) -> str:
        fired = ", ".join(f"{k} at {t:.0f} s" for k, t in sorted(self.fired.items(), key=lambda kv: kv[1]))
        before = f" (already firing: {', '.join(sorted(self.already))})" if self.already else ""
        return (fired or "none") + before


def firing_alert(mon: Monitor) -> dict[str, Any]:
    (alert,) = [a for a in mon.alerts() if a["labels"]["alertname"] == ALERT]
    return alert


def test_healthy_node_has_no_alert(monitor: Monitor) -> None:
    """A GPU node (gpu=on, Ready, schedulable) with its capacity: every part of the rule's expression has
    its series for the node, and the alert stays inactive past its `for:`."""
    healthy_plugin()
    monitor.point_at_the_plugin()
    assert (
        monitor.value(f'max(kube_node_status_condition{{node="{NODE}", condition="Ready", status="true"}})')
        == "1"
    )
    assert monitor.value(f'max(kube_node_spec_unschedulable{{node="{NODE}"}})') == "0"
    watch = Watch(monitor)
    deadline = time.monotonic() + 2 * float(FOR.rstrip("s")) + 5
    while time.monotonic() < deadline:
        assert watch.poll() == (DEVICES, DEVICES, DEVICES, ""), watch.story()
        time.sleep(1)


def test_fires_while_the_plugin_is_unregistered_and_resolves(monitor: Monitor) -> None:
    """The kubelet restarted and the plugin not registering again (the stand-in's `noregister`): the kubelet
    restores nvidia.com/gpu with capacity 0, kube-state-metrics exports it, the alert fires for the node.
    The fault removed, the kubelet's next restart of the plugin container (for the sidecar's 503) registers
    it again: capacity back, the alert resolved."""
    healthy_plugin()
    monitor.point_at_the_plugin()
    plugin_restarts = restarts("device-plugin")
    set_fault("noregister", True)
    try:
        fault_applied()
        watch = Watch(monitor)
        node_ctl("kubelet-restart")
        lost = watch.until("capacity 0 on the Node", lambda c, a, e, s: c == "0", 60)
        firing = watch.until("the alert firing", lambda c, a, e, s: s == "firing", 120)
        alert = firing_alert(monitor)
        assert alert["labels"]["severity"] == "critical", alert
        assert alert["labels"]["vendor"] == "nvidia", alert  # the rule of the NVIDIA profile's
        assert alert["annotations"]["summary"].startswith(f"NVIDIA node {NODE} "), alert
        # Capacity never came back while the plugin could not register.
        assert all(c in ("0", DEVICES) for _, c, *_ in watch.changes), watch.story()
        assert watch.poll()[:3] == ("0", "0", "0"), watch.story()
        set_fault("noregister", False)
        fixed = watch.now()
        back = watch.until(f"capacity {DEVICES} again", lambda c, a, e, s: c == DEVICES, 240)
        resolved = watch.until("the alert resolved", lambda c, a, e, s: s == "" and e == DEVICES, 60)
    finally:
        set_fault("noregister", False)
    # The restart that registered it again is the kubelet's, for the sidecar's 503 (no pod was replaced).
    assert restarts("device-plugin") > plugin_restarts
    # Capacity 0 from the kubelet's restart on, until the registration: never absent.
    first_after = next(c for _, c, *_ in watch.changes if c != DEVICES)
    assert first_after == "0", watch.story()
    figure_line = (
        f"fleet rule, kubelet restart without re-registration (for: {FOR}): Node capacity 0 at "
        f"{lost:.0f} s, {ALERT} firing at {firing:.0f} s; noregister removed at {fixed:.0f} s, capacity "
        f"back at {back:.0f} s (the kubelet's restart of the plugin container), alert resolved at "
        f"{resolved:.0f} s ({resolved - fixed:.0f} s after the fix); the node's own alerts firing: "
        f"{watch.node_alerts()}"
    )
    _figure(figure_line, watch)
    healthy_plugin(240)


def test_drop_keeps_capacity_until_the_stop_grace_ends(monitor: Monitor) -> None:
    """The plugin's stream ends while the kubelet keeps running, and the plugin never registers again: the
    kubelet keeps the capacity (its devices unhealthy, allocatable 0) for the endpoint's 5-minute stop
    grace, then sets the capacity to 0. The capacity-based rule stays inactive through the grace (the
    state an all-unhealthy GPU node has too: capacity kept, allocatable 0) and fires after it."""
    healthy_plugin()
    monitor.point_at_the_plugin()
    set_fault("noregister", True)
    log = Path(RUN, "log", "kubelet.log")
    seen = log.stat().st_size
    try:
        watch = Watch(monitor)
        set_fault("drop", True)
        lost = watch.until("allocatable 0, capacity kept", lambda c, a, e, s: a == "0" and c == DEVICES, 60)
        zero = watch.until("capacity 0 after the stop grace", lambda c, a, e, s: c == "0", GRACE + 90)
        firing = watch.until("the alert firing", lambda c, a, e, s: s == "firing", 120)
        assert zero >= GRACE - 5, watch.story()
        # Through the grace: capacity kept, allocatable 0 (after the first update), the alert inactive.
        during = [(c, s) for t, c, a, e, s in watch.changes if t < zero]
        assert all(c == DEVICES and s == "" for c, s in during), watch.story()
        # The kubelet's own account (pkg/kubelet/cm/devicemanager, pkg/kubelet/nodestatus).
        with log.open("rb") as f:
            f.seek(seen)
            said = f.read().decode(errors="replace")
        for line in (
            "Last device plugin for this resource disconnected",
            "Set capacity for removed resource to 0",
        ):
            assert line in said, line
        set_fault("noregister", False)
        fault_applied()
        node_ctl("kubelet-restart")  # the plugin registers again when kubelet.sock is created
        fixed = watch.now()
        resolved = watch.until("the alert resolved", lambda c, a, e, s: s == "" and e == DEVICES, 240)
    finally:
        set_fault("noregister", False)
        set_fault("drop", False)
    _figure(
        f"fleet rule, drop without re-registration (for: {FOR}): allocatable 0 with capacity {DEVICES} "
        f"kept at {lost:.0f} s, capacity 0 at {zero:.0f} s (the 5-minute stop grace), {ALERT} firing at "
        f"{firing:.0f} s; "
        f"after a kubelet restart with the fault removed at {fixed:.0f} s, resolved at {resolved:.0f} s; "
        f"the node's own alerts firing: {watch.node_alerts()}",
        watch,
    )
    healthy_plugin(240)


def _figure(line: str, watch: Watch) -> None:
    figure(line)
    figure(f"  timeline: {watch.story()}")
