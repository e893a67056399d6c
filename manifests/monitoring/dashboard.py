"""The hami-guard Grafana dashboard, built with grafana-foundation-sdk: `make dashboard` writes
manifests/monitoring/dashboard.json (kustomize puts it in a ConfigMap labelled grafana_dashboard: "1").

tests/test_monitoring.py checks that the committed JSON is this module's output, and evaluates every
panel's queries against a live Prometheus scraping three sidecars.

A fleet of hundreds of nodes: the first row says how many nodes are fine and which are not, the table
below it shows each node's state per check. A check's reason is not a metric label (every distinct
message would be a new series): it is in the node's /readyz?verbose and /status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from hami_guard.profiles import PROFILES
from manifests.monitoring.vendors import resource_text, watched

OUT = Path(__file__).with_name("dashboard.json")
UID = "hami-guard-fleet"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
NODE = 'node=~"$node"'
# The vendor profiles' annotations, node labels, resources and commands (hami_guard/profiles): the texts
# name them, the default vendor's first (PROFILES is in that order).
ANNOTATIONS = "; ".join(
    f"{p.shown(p.resources.pattern)}: {p.shown(p.hami.register)}"
    + (f" and {p.shown(p.hami.handshake)}" if p.hami.handshake else " (no handshake)")
    for p in PROFILES
)
NODE_LABELS = "; ".join(f"{p.chart.node_label}: {resource_text(p)}" for p in watched())
INSPECT = "; ".join(f"{p.vendor}: {p.devices.inspect}" for p in PROFILES)
# The SLOs of the PrometheusRule's alerts (prometheusrule.yaml).
REGISTRATION_SLO = 0.9995
LISTANDWATCH_SLO = 2.0

STATE_MAPPINGS: list[dm.ValueMapping] = [
    dm.ValueMap(
        options={
            "1": dm.ValueMappingResult(text="ok", color="green", index=0),
            "0.5": dm.ValueMappingResult(text="pending", color="yellow", index=1),
            "0": dm.ValueMappingResult(text="failed", color="red", index=2),
        }
    )
]


def query(expr: str, ref: str = "A", legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant().format(PromQueryFormat.TABLE)
    return q


def steps(*pairs: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in pairs])
    )


def count_stat(panel_id: int, title: str, expr: str, description: str, bad: str | None) -> stat.Panel:
    """A count over the fleet; `bad` colours any value above 0."""
    colours = steps((None, "green"), (1, bad)) if bad else steps((None, "blue"))
    return (
        stat.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(query(expr, instant=True))
        .height(4)
        .span(4)
        .thresholds(colours)
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
    )


def fleet_stats() -> list[stat.Panel]:
    return [
        count_stat(
            1,
            "Nodes reporting",
            f"count(count by (node) (device_plugin_check_up{{{NODE}}}))",
            "Nodes whose hami-guard sidecar Prometheus scrapes.",
            None,
        ),
        count_stat(
            2,
            "Nodes with every check passing",
            f"count(min by (node) (device_plugin_check_up{{{NODE}}}) == 1) or vector(0)",
            "GPUs registered with the kubelet and every hami-guard check ok.",
            None,
        ),
        count_stat(
            3,
            "Nodes failing a check",
            f"count(min by (node) (device_plugin_check_up{{{NODE}}}) == 0) or vector(0)",
            "The table below says which check; the node's /readyz?verbose says why.",
            "red",
        ),
        count_stat(
            4,
            "Restart budgets spent",
            f"sum(device_plugin_restart_budget_spent{{{NODE}}}) or vector(0)",
            "Plugins that 3 restarts did not register: liveness stopped asking, a person is needed "
            "(alert HamiDevicePluginRestartBudgetSpent).",
            "red",
        ),
        count_stat(
            5,
            "hami-guard alerts firing",
            'count(ALERTS{alertname=~"Hami.+", alertstate="firing"}) or vector(0)',
            "Every firing hami-guard alert, the cluster rule on kube-state-metrics included.",
            "orange",
        ),
        count_stat(
            6,
            "GPU nodes without GPU capacity",
            'count(ALERTS{alertname="HamiGPUNodeWithoutGPUCapacity", alertstate="firing"}) or vector(0)',
            "The runbook's cluster rule (kube-state-metrics): Ready, schedulable nodes that carry the "
            "label a vendor's device-plugin DaemonSet selects its nodes by, and whose status lists none of "
            "that vendor's resources (nor another vendor's), whether or not a sidecar runs there "
            f"({NODE_LABELS}).",
            "red",
        ),
    ]


def check_matrix() -> table.Panel:
    return (
        table.Panel()
        .id(7)
        .title("Check state per node")
        .description(
            "The worst state of each check on each node (ok, pending within the grace, failed). "
            "The reason is not a metric label: it is in the node's sidecar, "
            "`kubectl -n <namespace> exec <pod> -c hami-sidecar -- ...` or a port-forward to :9395, "
            "at /readyz?verbose and /status."
        )
        .datasource(DATASOURCE)
        .with_target(query(f"min by (node, check) (device_plugin_check_up{{{NODE}}})", instant=True))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="groupingToMatrix",
                options={"columnField": "check", "rowField": "node", "valueField": "Value"},
            )
        )
        .mappings(STATE_MAPPINGS)
        .thresholds(steps((None, "red"), (0.5, "yellow"), (1, "green")))
        .cell_options(cm.TableColoredBackgroundCellOptions())
        .override_by_name(
            "node\\check", [dm.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "auto"})]
        )
        .sort_by([cb.TableSortByFieldState().display_name("node\\check")])
        .height(10)
        .span(14)
    )


def gpus_per_node() -> table.Panel:
    columns = {"Value #A": "on the host", "Value #B": "listed by the kubelet", "Value #C": "checkpoint"}
    return (
        table.Panel()
        .id(8)
        .title("GPUs per node: on the host vs listed by the kubelet")
        .description(
            "Physical GPUs: device nodes on the host (--device-glob), healthy ones the kubelet lists now "
            "(pod-resources), and the kubelet's checkpoint (history: a kubelet that drops the plugin does "
            "not rewrite it). Fewer listed than on the host: a lost GPU or a lost registration."
        )
        .datasource(DATASOURCE)
        .targets(
            [
                query(
                    f'max by (node, resource) (device_plugin_devices{{{NODE}, source="{s}"}})',
                    r,
                    instant=True,
                )
                for r, s in (("A", "host"), ("B", "pod_resources"), ("C", "checkpoint"))
            ]
        )
        .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize", options={"excludeByName": {"Time": True}, "renameByName": columns}
            )
        )
        .sort_by([cb.TableSortByFieldState().display_name("node")])
        .height(10)
        .span(10)
    )


# The hami check's reason codes, device_plugin_hami_registration's `reason` label
# (docs/runbook.md#hamischedulercannotseegpus and the two alerts after it), coloured as the verdict they
# carry.
HAMI_REASON_COLOURS = {
    "ok": "green",
    "repairing": "yellow",
    "no_evidence": "blue",
    "plugin_down": "blue",
    "no_handshake": "blue",
    "missing": "red",
    "unparsable": "red",
    "mismatched": "red",
    "stale_health": "red",
    "last_copy": "orange",
    "wrong_node": "red",
    "handshake_deleted": "red",
    "handshake_expired": "red",
    "format_skew": "red",
    "stamp_stalled": "red",
}


def hami_registration() -> table.Panel:
    """Per node and resource: the hami check's reason code, and the GPUs on each side of it."""
    mappings = [
        {
            "type": "value",
            "options": {
                code: {"text": code, "color": colour, "index": i}
                for i, (code, colour) in enumerate(HAMI_REASON_COLOURS.items())
            },
        }
    ]
    columns = {"Value #B": "in HAMi's annotation", "Value #C": "listed healthy by the kubelet"}
    order = {"node": 0, "resource": 1, "reason": 2, "Value #B": 3, "Value #C": 4}
    return (
        table.Panel()
        .id(15)
        .title("HAMi's registration per node")
        .description(
            "What HAMi's scheduler sees of each node: the sidecar's hami check reads the Node's register "
            "annotation of the resource (HAMi's device plugin writes it) and its handshake (the scheduler "
            f"stamps it; {ANNOTATIONS}), and compares the annotation with the GPUs "
            "the kubelet lists healthy. reason: ok; repairing (a difference within HAMi's own 30 s loop); "
            "not judged: no_evidence (the Node cannot be read), plugin_down (the plugin does not serve or "
            "register; HAMi's scheduler still offers the node from the annotation), no_handshake (no HAMi "
            "scheduler selects the node); a stale annotation, which liveness restarts the plugin for after "
            "--hami-repair: missing, unparsable, mismatched (the scheduler does not see GPUs the kubelet "
            "lists), stale_health (it places Pods on GPUs the kubelet took out), last_copy (the annotation "
            "is gone after the scheduler read it: it schedules on its last copy); wrong_node (NODE_NAME); "
            "handshake_deleted, handshake_expired (the scheduler keeps the node out); format_skew (the "
            "annotation is in the format HAMi's decoder for the vendor does not read: not ready, no "
            "restart); stamp_stalled (the plugin's Reported stamp stopped: its loop stopped, one restart). "
            "Alerts "
            "HamiSchedulerCannotSeeGPUs, HamiSchedulerPlacesPodsOnUnhealthyGPUs, "
            "HamiSchedulerSchedulesFromLastCopy. Empty where the sidecar has no API access or "
            "--no-hami-registration."
        )
        .datasource(DATASOURCE)
        .targets(
            [
                query(
                    f"max by (node, resource, reason) (device_plugin_hami_registration{{{NODE}}}) == 1",
                    "A",
                    instant=True,
                ),
                query(f"max by (node, resource) (device_plugin_hami_gpus{{{NODE}}})", "B", instant=True),
                query(
                    f'max by (node, resource) (device_plugin_devices{{{NODE}, source="pod_resources"}})',
                    "C",
                    instant=True,
                ),
            ]
        )
        .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "Value #A": True},
                    "indexByName": order,
                    "renameByName": columns,
                },
            )
        )
        .override_by_name(
            "reason",
            [
                dm.DynamicConfigValue(id_val="mappings", value=mappings),
                dm.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background"}),
            ],
        )
        .align(cm.FieldTextAlignment.AUTO)
        .sort_by([cb.TableSortByFieldState().display_name("node")])
        .height(8)
        .span(14)
    )


Targets = list[cogbuilder.Builder[cogvariants.Dataquery]]


def series(panel_id: int, title: str, description: str, targets: Targets, unit: str) -> timeseries.Panel:
    return (
        timeseries.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(targets)
        .unit(unit)
        .height(8)
        .span(12)
        .legend(
            cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.RIGHT)
        )
    )


def slo_line(panel: timeseries.Panel, colours: db.ThresholdsConfig) -> timeseries.Panel:
    return panel.thresholds(colours).thresholds_style(
        cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
    )


def increase(metric: str, by: str = "node, resource") -> str:
    return f"sum by ({by}) (increase({metric}{{{NODE}}}[$__rate_interval]))"


def build() -> db.Dashboard:
    node = (
        db.QueryVariable("node")
        .label("node")
        .datasource(DATASOURCE)
        .query("label_values(device_plugin_check_up, node)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".+")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
    )
    d = (
        db.Dashboard("hami-guard: GPU device plugin registration")
        .uid(UID)
        .description(
            "Which nodes have their GPUs registered with the kubelet and seen by HAMi's scheduler, the "
            "runbook's SLIs, restarts, GPUs HAMi marked unhealthy"
        )
        .tags(["hami-guard", "gpu", "kubelet"])
        .editable()
        .time("now-6h", "now")
        .refresh("1m")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(node)
        .with_row(db.Row("Fleet").id(100))
    )
    for panel in fleet_stats():
        d = d.with_panel(panel)
    d = d.with_panel(check_matrix()).with_panel(gpus_per_node())
    d = d.with_row(db.Row("SLIs (1 h windows, as the alerts)").id(101))
    d = d.with_panel(
        slo_line(
            series(
                9,
                "Registration success ratio",
                "Registration cycles the kubelet confirmed within the grace, over the last hour, per node "
                f"(SLO {REGISTRATION_SLO:.2%}: alert HamiDevicePluginRegistrationSLOBreach).",
                [
                    query(
                        f"hami:device_plugin_registration_success:ratio_rate1h{{{NODE}}}",
                        legend="{{node}} {{resource}}",
                    )
                ],
                "percentunit",
            ),
            steps((None, "red"), (REGISTRATION_SLO, "green")),
        )
    )
    d = d.with_panel(
        slo_line(
            series(
                10,
                "ListAndWatch latency P95",
                "From a registration cycle's start to the kubelet recording the plugin's devices, P95 over "
                f"the last hour (SLO {LISTANDWATCH_SLO:g} s: alert HamiDevicePluginListAndWatchSlow).",
                [
                    query(
                        f"hami:device_plugin_listandwatch_latency_seconds:p95_1h{{{NODE}}}",
                        legend="{{node}} {{resource}}",
                    )
                ],
                "s",
            ),
            steps((None, "green"), (LISTANDWATCH_SLO, "red")),
        )
    )
    d = d.with_row(db.Row("Registrations and restarts").id(102))
    d = d.with_panel(
        series(
            11,
            "Registration attempts",
            "Registration cycles opened (a new plugin socket or a kubelet restart) and those the kubelet "
            "confirmed.",
            [
                query(increase("device_plugin_registration_attempt_total"), "A", "{{node}} opened"),
                query(increase("device_plugin_registration_success_total"), "B", "{{node}} confirmed"),
            ],
            "short",
        ).draw_style(cm.GraphDrawStyle.BARS)
    )
    d = d.with_panel(
        series(
            12,
            "Liveness restarts asked for, kubelet restarts",
            "Liveness failure episodes for a plugin the kubelet does not hold (each asks the kubelet to "
            "restart the plugin), and kubelet restarts seen by the sidecar.",
            [
                query(
                    increase("device_plugin_liveness_restart_requests_total"), "A", "{{node}} restart asked"
                ),
                query(
                    increase("device_plugin_kubelet_restarts_total", "node"),
                    "B",
                    "{{node}} kubelet restarted",
                ),
            ],
            "short",
        ).draw_style(cm.GraphDrawStyle.BARS)
    )
    d = d.with_panel(
        series(
            13,
            "Restart budgets spent over time",
            "1 while a plugin's 3 restarts in vain are spent: liveness no longer asks, a person is needed. "
            "Only spent budgets are drawn.",
            [
                query(
                    f"max by (node, resource) (device_plugin_restart_budget_spent{{{NODE}}}) == 1",
                    "A",
                    "{{node}}",
                )
            ],
            "short",
        )
        .min(0)
        .max(1)
        .no_value("none spent")
        .line_interpolation(cm.LineInterpolation.STEP_AFTER)
    )
    d = d.with_panel(
        series(
            14,
            "GPUs fleet-wide: on the hosts vs listed by the kubelets",
            "Sum over the selected nodes. The gap is GPUs that GPU Pods cannot get.",
            [
                query(f'sum(device_plugin_devices{{{NODE}, source="host"}})', "A", "on the hosts"),
                query(
                    f'sum(device_plugin_devices{{{NODE}, source="pod_resources"}})',
                    "B",
                    "listed by the kubelets",
                ),
            ],
            "short",
        ).fill_opacity(10)
    )
    d = d.with_row(db.Row("HAMi's scheduler: the Node's annotations").id(103))
    d = d.with_panel(hami_registration())
    d = d.with_panel(
        series(
            16,
            "HAMi's registration by reason",
            "How many plugins (a node and a resource each) have each hami check reason over time: ok, "
            "or why HAMi's scheduler does not see the GPUs the kubelet lists (the table beside it names "
            "the nodes).",
            [
                query(
                    f"count by (reason) (device_plugin_hami_registration{{{NODE}}} == 1)",
                    legend="{{reason}}",
                )
            ],
            "short",
        )
        .span(10)
        .draw_style(cm.GraphDrawStyle.BARS)
        .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
        .min(0)
    )
    d = d.with_row(db.Row("GPUs HAMi marked unhealthy (--recover-unhealthy-after)").id(104))
    d = d.with_panel(
        series(
            17,
            "Unhealthy GPUs: plugin restarts asked for, GPUs brought back",
            "HAMi's plugin never marks a device healthy again once it marked it unhealthy (an XID, on "
            "NVIDIA's). With --recover-unhealthy-after the sidecar "
            "asks for one plugin restart when a GPU stayed unhealthy that long (never while a pod holds "
            "it), and counts the GPUs the restart brought back. Empty without the option.",
            [
                query(
                    increase("device_plugin_unhealthy_recovery_restarts_total"), "A", "{{node}} restart asked"
                ),
                query(
                    increase("device_plugin_unhealthy_devices_recovered_total"), "B", "{{node}} brought back"
                ),
            ],
            "short",
        ).draw_style(cm.GraphDrawStyle.BARS)
    )
    return d.with_panel(
        series(
            18,
            "GPUs unrecoverable",
            "GPUs unhealthy again after the plugin restart that re-read them: the device or its driver, "
            "not a transient fault. No more restarts are asked for them; drain the node and read what "
            f"failed ({INSPECT}; alert HamiNodeGPUUnrecoverable). Only nodes with such a GPU are drawn.",
            [
                query(
                    f"max by (node, resource) (device_plugin_unhealthy_devices_unrecoverable{{{NODE}}}) > 0",
                    "A",
                    "{{node}} {{resource}}",
                )
            ],
            "short",
        )
        .min(0)
        .no_value("none")
        .line_interpolation(cm.LineInterpolation.STEP_AFTER)
    )


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
