"""Monitoring for real: a live Prometheus scrapes three simulated nodes, each with its own sidecar.

Prometheus (Debian's `prometheus`) runs on 127.0.0.1 with the PodMonitor's scrape, as the Prometheus
Operator generates it (its relabelings and the PodMonitor's own, over the meta labels Kubernetes
discovery would give each pod of the shipped DaemonSet), and the PrometheusRule's groups. The sidecars
read their Nodes (HAMi's annotations) from a stand-in of the API server's nodes endpoint. The rules'
expressions are the shipped ones; only the test-time copy's `for:` and 1 h windows are shortened
(see `rules_for_the_test`). Faults are driven on one node, and Prometheus' HTTP API must show the recording
rules' values, the expected alerts pending then firing for that node only, and every alert resolved
after the fix. Then every dashboard panel's query must return data from that Prometheus.

Also here: the dashboard JSON is the generator's output, and is dashboard JSON Grafana's own schema
(as grafana-foundation-sdk models it) reads back whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from hami_guard.flags import PluginSpec
from hami_guard.profiles import DEFAULT, PROFILES, VendorProfile, named, sanitized
from manifests.monitoring import dashboard, vendors
from sidecar.app import Sidecar
from sidecar.cli import serve
from sidecar.config import AUTO_DEVICES, Settings
from sidecar.hami.verdicts import DIFFERS, NOT_JUDGED, SCHEDULER_TICK, UNSEEN
from sidecar.kube.access import ApiAccess
from sidecar.reasons import HAMI_CODES
from testing import FakeDevicePlugin, FakeKubelet, free_port
from tests.conftest import require_tool
from tests.hamifixture import HANDSHAKE, REGISTER, Gpu, marshal

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "manifests" / "monitoring"
GPU = "nvidia.com/gpu"
NAMESPACE = "kube-system"
NODES = ("gpu-node-a", "gpu-node-b", "gpu-node-c")
FAULTY = NODES[0]
# The test-time copy of the rules: every `for:` becomes FOR and every `[1h]` window WINDOW, so that an
# alert fires within seconds and the SLO alert clears a few seconds after its last failure. Nothing
# else of the expressions changes (test_rules_keep_the_shipped_expressions).
FOR = "1s"
WINDOW = "6s"
# --recover-unhealthy-after on every node, as a DaemonSet would set it: a GPU not listed healthy this long
# gets the one plugin restart that re-reads it.
RECOVER_AFTER = 1.0
# How long HAMi's annotation may differ from the kubelet before the hami check fails (HAMi's loop: 30 s).
HAMI_REPAIR = 1.0
# With a 1 s scrape interval Grafana's $__rate_interval is 4 x 1 s.
RATE_INTERVAL = "4s"
# Each wait's bound; the whole test takes about 45 s (42-48 s on a 2-core machine, alone or two at once).
STEP_TIMEOUT = 15.0


# -- the shipped manifests, as a Prometheus configuration ---------------------------------------
def rules_for_the_test() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]
    for group in spec["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR
            rule["expr"] = rule["expr"].replace("[1h]", f"[{WINDOW}]")
    return spec


def test_rules_keep_the_shipped_expressions() -> None:
    shipped = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]
    rules = [r for g in shipped["groups"] for r in g["rules"]]
    copied = [r for g in rules_for_the_test()["groups"] for r in g["rules"]]
    assert len(rules) == len(copied)
    for mine, theirs in zip(copied, rules, strict=True):
        assert mine["expr"].replace(f"[{WINDOW}]", "[1h]") == theirs["expr"]
        assert {k: v for k, v in mine.items() if k not in ("expr", "for")} == {
            k: v for k, v in theirs.items() if k not in ("expr", "for")
        }


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_template() -> tuple[dict[str, str], str, str]:
    """The DaemonSet pod's labels (HAMi's; the patch keeps them), the sidecar container and its port."""
    (ds,) = [
        d
        for d in yaml.safe_load_all((ROOT / "manifests" / "example-hami" / "hami.yaml").read_text())
        if d and d["kind"] == "DaemonSet"
    ]
    patch = yaml.safe_load((ROOT / "manifests" / "hami-patch" / "patch.yaml").read_text())
    (sidecar,) = [
        c for c in patch["spec"]["template"]["spec"]["initContainers"] if c["name"] == "hami-sidecar"
    ]
    return ds["spec"]["template"]["metadata"]["labels"], sidecar["name"], sidecar["ports"][0]["name"]


def relabeling(r: dict[str, Any]) -> dict[str, Any]:
    """A PodMonitor RelabelConfig as Prometheus' relabel_config (the operator's generateRelabelConfig)."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    out = {keys.get(k, k): v for k, v in r.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def scrape_config(targets: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """The operator's scrape job for the PodMonitor (pkg/prometheus/promcfg.go, generatePodMonitorConfig)
    over static targets that carry the meta labels Kubernetes' pod discovery would give them.
    `targets`: node name -> (pod name, port)."""
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    labels, container, port_name = pod_template()
    static = []
    for node, (pod, port) in targets.items():
        meta = {
            "__meta_kubernetes_namespace": NAMESPACE,
            "__meta_kubernetes_pod_name": pod,
            "__meta_kubernetes_pod_node_name": node,
            "__meta_kubernetes_pod_phase": "Running",
            "__meta_kubernetes_pod_container_name": container,
            "__meta_kubernetes_pod_container_port_name": port_name,
        }
        for k, v in labels.items():
            meta[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = v
            meta[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
        static.append({"targets": [f"127.0.0.1:{port}"], "labels": meta})
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
    ]
    for k, v in sorted(monitor["spec"]["selector"].get("matchLabels", {}).items()):
        relabel.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_pod_label_{sanitize(k)}",
                    f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}",
                ],
                "regex": f"({v});true",
            }
        )
    relabel += [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": endpoint["port"],
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{NAMESPACE}/{monitor['metadata']['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *(relabeling(r) for r in endpoint.get("relabelings", [])),
    ]
    return {
        "job_name": f"podMonitor/{NAMESPACE}/{monitor['metadata']['name']}/0",
        "honor_labels": False,
        "metrics_path": endpoint["path"],
        "scheme": "http",
        "static_configs": static,
        "relabel_configs": relabel,
    }


# -- the API server's Nodes, as the sidecars' hami check reads them ---------------------------------
class Nodes:
    """GET /api/v1/nodes/<name> on 127.0.0.1, plain HTTP: each node's HAMi annotations (the register
    annotation listing its two GPUs, as HAMi's plugin writes it, and a scheduler's handshake) and its
    allocatable GPUs. `annotations` is the test's to change. The fake plugin's device IDs (GPU-0, GPU-1)
    are no GPU UUIDs: the hami check judges the annotation's presence and form, not its list."""

    def __init__(self, names: tuple[str, ...]) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        gpus = marshal([Gpu("GPU-0"), Gpu("GPU-1")])
        self.annotations = {n: {REGISTER: gpus, HANDSHAKE: f"Requesting_{stamp}"} for n in names}
        self.port = free_port()

    def access(self) -> ApiAccess:
        return ApiAccess(f"http://127.0.0.1:{self.port}", token="test")

    async def node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.annotations:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        meta = {"name": name, "annotations": dict(self.annotations[name])}
        return web.json_response({"kind": "Node", "metadata": meta, "status": {"allocatable": {GPU: "2"}}})


@contextlib.asynccontextmanager
async def node_api(names: tuple[str, ...]) -> AsyncIterator[Nodes]:
    nodes = Nodes(names)
    app = web.Application()
    app.router.add_get("/api/v1/nodes/{name}", nodes.node)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", nodes.port).start()
        yield nodes
    finally:
        await runner.cleanup()


# -- a simulated node with its sidecar ------------------------------------------------------------
@dataclass
class SimNode:
    name: str
    pod: str
    kubelet: FakeKubelet
    plugin: FakeDevicePlugin
    sidecar: Sidecar
    port: int

    async def healthz(self, http: aiohttp.ClientSession, status: int) -> bool:
        async with http.get(f"http://127.0.0.1:{self.port}/healthz") as r:
            await r.read()
            return r.status == status


@contextlib.asynccontextmanager
async def sim_node(name: str, api: Nodes, vendor: VendorProfile = DEFAULT) -> AsyncIterator[SimNode]:
    """FakeKubelet, FakeDevicePlugin (two GPUs, two device nodes on the 'host') and the real sidecar,
    which reads its Node from `api`; the plugin is `vendor`'s (its default resource, socket and device
    nodes)."""
    root = tempfile.mkdtemp(prefix="hg-mon-")
    resource = vendor.resources.default
    plugin = PluginSpec(resource, vendor.socket_for(resource))
    glob = root + vendor.devices.glob  # under the 'host's /dev
    try:
        folder = os.path.join(root, "device-plugins")
        pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
        for n in range(2):
            device = Path(glob.replace("[0-9]*", str(n)))
            device.parent.mkdir(parents=True, exist_ok=True)
            device.touch()
        settings = Settings(
            device_plugin_dir=folder,
            vendor=vendor.name,
            plugins=(plugin,),
            pod_resources_socket=pod_resources,
            host="127.0.0.1",
            port=free_port(),
            expect_devices=AUTO_DEVICES,
            device_glob=glob,
            # Generous for a loaded machine: a probe that times out is a failed check, here on a healthy
            # node; every event (a socket created or deleted) still triggers a round at once.
            probe_interval=1.0,
            probe_timeout=0.8,
            registration_grace=1.0,
            recover_unhealthy_after=RECOVER_AFTER,
            driver_gpus_dir=os.path.join(root, "no-driver"),  # the device nodes say the GPUs are there
            node_name=name,
            hami_api=api.access(),
            hami_interval=0.5,
            hami_repair=HAMI_REPAIR,
        )
        async with (
            FakeKubelet(folder, pod_resources, dial_timeout=0.5) as kubelet,
            FakeDevicePlugin(folder, plugin.resource, plugin.socket, register_timeout=5) as fake,
        ):
            sidecar = Sidecar(settings)
            stop = asyncio.Event()
            task = asyncio.get_running_loop().create_task(serve(settings, stop, sidecar))
            try:
                await until(lambda: sidecar.ready or task.done(), f"{name}'s sidecar's first probe round")
                assert not task.done(), task
                yield SimNode(name, f"hami-device-plugin-{name[-1]}", kubelet, fake, sidecar, settings.port)
            finally:
                stop.set()
                await asyncio.wait_for(task, 5)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def until(
    predicate: Callable[[], object] | Callable[[], Awaitable[object]],
    what: str,
    timeout: float = STEP_TIMEOUT,
    interval: float = 0.1,
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


# -- Prometheus -----------------------------------------------------------------------------------
AlertKey = tuple[str, str, str]  # alertname, node, check


@dataclass
class Prometheus:
    url: str
    http: aiohttp.ClientSession
    seen: dict[AlertKey, set[str]] = field(default_factory=dict)
    active: dict[AlertKey, str] = field(default_factory=dict)
    alerts_seen: list[dict[str, Any]] = field(default_factory=list)

    async def api(self, path: str, **params: str) -> Any:
        async with self.http.get(f"{self.url}/api/v1/{path}", params=params) as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "success", (path, params, body)
            return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    async def values(self, expr: str) -> dict[str, float]:
        """node -> value of an instant query whose series carry a node label."""
        return {s["metric"]["node"]: float(s["value"][1]) for s in await self.query(expr)}

    async def poll_alerts(self) -> None:
        """Every alert Prometheus holds now (pending and firing), remembered by key and state."""
        alerts = (await self.api("alerts"))["alerts"]
        self.active = {}
        for a in alerts:
            key = (a["labels"]["alertname"], a["labels"].get("node", ""), a["labels"].get("check", ""))
            self.active[key] = a["state"]
            self.seen.setdefault(key, set()).add(a["state"])
            self.alerts_seen.append(a)

    def firing(self, node: str) -> set[AlertKey]:
        return {k for k, state in self.active.items() if k[1] == node and state == "firing"}

    def on(self, node: str) -> set[AlertKey]:
        return {k for k in self.active if k[1] == node}


@contextlib.asynccontextmanager
async def prometheus(
    tmp: Path, targets: dict[str, tuple[str, int]], *jobs: dict[str, Any]
) -> AsyncIterator[Prometheus]:
    """Prometheus with the test-time rules, scraping the sidecars (`targets`) as the PodMonitor does, and
    `jobs` besides."""
    binary = require_tool("prometheus")
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rules_for_the_test()))
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [scrape_config(targets), *jobs],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:

            async def ready() -> bool:
                assert proc.returncode is None, (tmp / "prometheus.log").read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/-/ready") as r:
                        return r.status == 200
                return False

            await until(ready, "Prometheus to be ready", interval=0.1)
            yield Prometheus(url, http)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


# -- the end-to-end test --------------------------------------------------------------------------
CHECK_FAILING = "HamiDevicePluginCheckFailing"
NOT_ALLOCATABLE = "HamiNodeGPUsNotAllocatable"
SLO = "HamiDevicePluginRegistrationSLOBreach"
BUDGET = "HamiDevicePluginRestartBudgetSpent"
KUBELET = "HamiNodeKubeletFault"
UNRECOVERABLE = "HamiNodeGPUUnrecoverable"
SCHEDULER = "HamiSchedulerCannotSeeGPUs"
LAST_COPY = "HamiSchedulerSchedulesFromLastCopy"


async def test_live_prometheus_scrapes_three_sidecars_and_alerts_for_the_faulty_node_only(
    tmp_path: Path,
) -> None:
    started = time.time()
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(node_api(NODES))
        nodes = {name: await stack.enter_async_context(sim_node(name, api)) for name in NODES}
        prom = await stack.enter_async_context(
            prometheus(tmp_path, {n.name: (n.pod, n.port) for n in nodes.values()})
        )
        http = await stack.enter_async_context(aiohttp.ClientSession())
        a = nodes[FAULTY]
        print(f"setup {time.time() - started:.1f}s")

        # The scrape: every target up, with the labels the PodMonitor gives it.
        async def all_up() -> bool:
            up = await prom.query('up{job="kube-system/hami-guard"} == 1')
            return {s["metric"].get("node") for s in up} == set(NODES)

        await until(all_up, "every sidecar scraped")
        for s in await prom.query("up"):
            m = s["metric"]
            assert m["pod"] == nodes[m["node"]].pod
            assert (m["namespace"], m["container"], m["endpoint"]) == (
                NAMESPACE,
                "hami-sidecar",
                "guard-http",
            )

        # Seed the SLIs: a kubelet restart on every node, after which each plugin registers again.
        for n in nodes.values():
            await n.kubelet.restart()

        async def slis_everywhere() -> bool:
            ratio = await prom.values("hami:device_plugin_registration_success:ratio_rate1h")
            p95 = await prom.values("hami:device_plugin_listandwatch_latency_seconds:p95_1h")
            return (
                ratio == dict.fromkeys(NODES, 1.0)
                and set(p95) == set(NODES)
                and all(0 < v <= 2 for v in p95.values())
            )

        await until(slis_everywhere, "registration ratio 1 and P95 <= 2 s on every node")

        async def quiet(nodes_: tuple[str, ...] = NODES) -> bool:
            await prom.poll_alerts()
            return not any(prom.on(n) for n in nodes_)

        await until(quiet, "no alert after the seeding")
        print(f"{time.time() - started:.1f}s seeded")

        # From here on only the faulty node may alert.
        prom.seen.clear()

        async def expect(what: str, expected: set[AlertKey]) -> None:
            """Exactly `expected` firing on the faulty node, each seen pending first; nothing elsewhere."""

            async def exactly() -> bool:
                await prom.poll_alerts()
                assert not any(prom.on(n) for n in NODES if n != FAULTY), (what, prom.active)
                return prom.firing(FAULTY) == expected

            await until(exactly, f"{what}: {sorted(expected)} firing on {FAULTY}, nothing else")
            print(f"{time.time() - started:.1f}s {what}: firing")
            for key in expected:
                assert {"pending", "firing"} <= prom.seen[key], (what, key, prom.seen[key])

        async def resolved(what: str) -> None:
            await until(quiet, f"{what}: every alert resolved after the fix")
            print(f"{time.time() - started:.1f}s {what}: resolved")

        def forget(*keys: AlertKey) -> None:
            for key in keys:
                prom.seen.pop(key, None)

        # 1. The kubelet drops the plugin (kubernetes issue 131013), which keeps serving: the checkpoint
        #    still lists both GPUs (history), pod-resources none. The fix: the plugin's restart, what the
        #    kubelet does after the liveness probe's failures.
        dropped = {(CHECK_FAILING, FAULTY, "registered"), (NOT_ALLOCATABLE, FAULTY, "")}
        forget(*dropped)
        await a.kubelet.drop(GPU)
        await expect("a kubelet that drops the plugin", dropped)
        await a.plugin.restart()
        await resolved("a kubelet that drops the plugin")

        # 2. A lost GPU (one of two unhealthy): the devices check names it. The recovery asks for a plugin
        #    restart after RECOVER_AFTER, which nothing does here: the GPU is healthy again first.
        lost = {(CHECK_FAILING, FAULTY, "devices")}
        forget(*lost)
        a.plugin.set_health("GPU-1", False)
        await expect("a lost GPU", lost)
        a.plugin.set_health("GPU-1", True)
        await resolved("a lost GPU")

        # 3. No re-registration after a kubelet restart: a failed registration cycle (ratio 0), liveness
        #    fails. Then three plugin restarts in vain spend the budget: the page replaces the other two.
        unregistered = {
            (CHECK_FAILING, FAULTY, "registered"),
            (NOT_ALLOCATABLE, FAULTY, ""),
            (SLO, FAULTY, ""),
        }
        forget(*unregistered, (BUDGET, FAULTY, ""))
        a.plugin.register_enabled = False
        await a.kubelet.restart()
        await expect("no re-registration after a kubelet restart", unregistered)

        async def ratio_zero_here_only() -> bool:
            ratio = await prom.values("hami:device_plugin_registration_success:ratio_rate1h")
            return ratio.get(FAULTY) == 0 and all(v == 1 for n, v in ratio.items() if n != FAULTY)

        await until(ratio_zero_here_only, "the registration ratio 0 on the faulty node only")
        for _ in range(3):
            await until(lambda: a.healthz(http, 503), "liveness to ask for a plugin restart")
            await a.plugin.restart()
            await until(lambda: a.healthz(http, 200), "a new registration cycle")
        await expect("the restart budget spent", {(BUDGET, FAULTY, ""), (SLO, FAULTY, "")})
        assert await prom.values("device_plugin_restart_budget_spent == 1") == {FAULTY: 1.0}
        a.plugin.register_enabled = True
        await a.plugin.restart()
        await resolved("no re-registration after a kubelet restart")

        # 4. The kubelet is missing: readiness shows it, nothing restarts; the kubelet fault alert speaks
        #    (and the SLO: its restart's registration cycle cannot complete).
        missing = {(KUBELET, FAULTY, ""), (SLO, FAULTY, "")}
        forget(*missing)
        await a.kubelet.stop(unlink_socket=True)
        await expect("a missing kubelet", missing)
        await a.kubelet.start()
        await resolved("a missing kubelet")

        # 5. A broken GPU: unhealthy, the recovery's plugin restart re-reads it (the test restarts the plugin,
        #    as the kubelet does on the liveness failure), and the plugin lists it unhealthy again. The
        #    devices check names the lost GPU first; the unrecoverable alert then takes its place. The fix:
        #    the GPU listed healthy again (a replaced GPU, re-read).
        broken = {(UNRECOVERABLE, FAULTY, "")}
        forget(*broken)
        asked = "device_plugin_unhealthy_recovery_restarts_total"
        before = await prom.values(asked)  # step 2's restart was asked for too
        a.plugin.set_health("GPU-1", False)
        await until(lambda: a.healthz(http, 503), "the recovery to ask for the plugin restart")
        await a.plugin.restart()
        await expect("a GPU unhealthy again after the restart that re-read it", broken)
        assert await prom.values("device_plugin_unhealthy_devices_unrecoverable > 0") == {FAULTY: 1.0}
        assert await prom.values(asked) == {n: v + 1 if n == FAULTY else v for n, v in before.items()}
        a.plugin.set_health("GPU-1", True)
        await resolved("a GPU unhealthy again after the restart that re-read it")

        # 6. HAMi's register annotation gone from the Node after HAMi's scheduler could read it (every
        #    sidecar has read it, with the same handshake, for longer than the scheduler's tick): the
        #    scheduler schedules on its last copy. After HAMI_REPAIR the hami check fails liveness, which no
        #    one acts on here. Then the scheduler cleans the node up and stamps a new handshake: its copy is
        #    gone, it cannot see the GPUs. The fix: the annotation written again.
        await asyncio.sleep(max(0.0, started + SCHEDULER_TICK + 1 - time.time()))
        copy = {(LAST_COPY, FAULTY, "")}
        unseen = {(SCHEDULER, FAULTY, "")}
        forget(*copy, *unseen)
        register = api.annotations[FAULTY].pop(REGISTER)
        await expect("HAMi's register annotation gone after the scheduler read it", copy)
        assert await prom.values('device_plugin_hami_registration{reason="last_copy"} == 1') == {FAULTY: 1.0}
        assert await prom.values("device_plugin_hami_gpus") == {FAULTY: 0.0} | {n: 2.0 for n in NODES[1:]}
        handshake = api.annotations[FAULTY][HANDSHAKE]
        api.annotations[FAULTY][HANDSHAKE] = "Requesting_2001-01-01 00:00:00"
        await expect("HAMi's register annotation missing, the scheduler's copy gone", unseen)
        assert await prom.values('device_plugin_hami_registration{reason="missing"} == 1') == {FAULTY: 1.0}
        api.annotations[FAULTY][REGISTER] = register
        api.annotations[FAULTY][HANDSHAKE] = handshake
        await resolved("HAMi's register annotation missing")

        # Every alert that went off named the faulty node, its summary too, and linked its fix.
        fired = [x for x in prom.alerts_seen if x["state"] == "firing"]
        assert {x["labels"]["alertname"] for x in fired} == {
            CHECK_FAILING,
            NOT_ALLOCATABLE,
            SLO,
            BUDGET,
            KUBELET,
            UNRECOVERABLE,
            SCHEDULER,
            LAST_COPY,
        }
        for x in fired:
            assert x["labels"]["node"] == FAULTY
            assert FAULTY in x["annotations"]["summary"]
            assert x["annotations"]["runbook_url"].startswith("docs/runbook.md#")

        # 5. Every dashboard panel's queries, as Grafana would send them over the test's time range.
        await dashboard_queries_return_data(prom, started, time.time())


async def dashboard_queries_return_data(prom: Prometheus, start: float, end: float) -> None:
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = grafana_expr(target["expr"], end - start)
            if target.get("instant"):
                result = await prom.query(expr)
            else:
                data = await prom.api(
                    "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1"
                )
                result = data["result"]
            assert result, f"panel {panel['title']!r}: {target['expr']} returned no data"
            checked += 1
    assert checked >= 21


def grafana_expr(expr: str, seconds: float) -> str:
    """A panel's query with the dashboard's variables as Grafana fills them in: node = All (`.+`)."""
    out = (
        expr.replace("$node", ".+")
        .replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__range", f"{round(seconds)}s")
    )
    assert "$" not in out, out
    return out


# -- each vendor: the cluster rule on kube-state-metrics, the fix of an unrecoverable device --------------
def test_the_committed_vendor_parts_are_the_generators_output() -> None:
    """prometheusrule.yaml's generated regions and manifests/network-policy (the vendors' folders whole) are
    `make profiles`' output (manifests/monitoring/vendors.py, from the profiles)."""
    expected = vendors.generated(ROOT)
    for path, text in expected.items():
        assert (ROOT / path).read_text() == text, f"{path}: run make profiles"
    folder = ROOT / vendors.VENDOR_POLICIES
    shipped = {p.relative_to(ROOT) for p in folder.rglob("*") if p.is_file()}
    assert shipped == {p for p in expected if vendors.VENDOR_POLICIES in p.parents}, "run make profiles"
    # Each region once; the rest of the file is left as written, and a stale region is written afresh.
    text = (ROOT / vendors.RULES).read_text()
    for name in vendors.REGIONS:
        assert text.count(f"{vendors.BEGIN}{name} ") == text.count(f"{vendors.END}{name}\n") == 1
    edited = text.replace("# Every rule keeps", "# Each rule keeps")
    assert vendors.rules(edited.replace("vendor: ascend", "vendor: acme")) == edited
    with pytest.raises(ValueError, match="has no end"):
        vendors.rules(text.replace(f"{vendors.END}cluster", "# cut"))


def test_the_docs_name_every_vendors_label_and_the_allowlist_they_need() -> None:
    """docs/deploy.md's kube-state-metrics allowlist is every label the cluster rule reads (the generated
    rule's header says the same), and the runbook's section names each vendor's label and its rule's
    `vendor`; its unrecoverable section each vendor's command."""
    allowlist = f"--metric-labels-allowlist=nodes=[{','.join(vendors.label_keys())}]"
    assert allowlist in (ROOT / "docs/deploy.md").read_text()
    assert allowlist in (ROOT / vendors.RULES).read_text()
    runbook = (ROOT / "docs/runbook.md").read_text()
    cluster = runbook.split("## HamiGPUNodeWithoutGPUCapacity\n", 1)[1].split("\n## ", 1)[0]
    unrecoverable = runbook.split("## HamiNodeGPUUnrecoverable\n", 1)[1].split("\n## ", 1)[0]
    for p in vendors.watched():
        assert f"| `{p.name}` | `{p.chart.node_label}`" in cluster, p.name
    for p in PROFILES:
        assert f"`{p.devices.inspect.split('; ')[-1]}`" in unrecoverable, p.name


# The commonWords of Ascend's chart (Project-HAMi/ascend-device-plugin v1.4.0 charts/ascend-device-plugin,
# values.yaml deviceConfig vnpus.configs), each node's resource huawei.com/<commonWord>.
ASCEND_CHIPS = (
    "Ascend910A",
    "Ascend910B2",
    "Ascend910B3",
    "Ascend910B4-1",
    "Ascend910B4",
    "Ascend310P",
    "Ascend910C",
)


def test_kube_state_metrics_names_of_the_vendors_labels_and_resources() -> None:
    """kube-state-metrics' names (v2.18.0, internal/store/utils.go): node label keys as its own test names
    them (utils_test.go, TestKubeLabelsToPrometheusLabels), each vendor's label, and each vendor's resources
    in its capacity expression, another vendor's in none."""
    for key, name in (
        ("app1", "label_app1"),
        ("0_app3", "label_0_app3"),
        ("$app4", "label__app4"),
        ("camelCase", "label_camel_case"),
        ("snake_camelCase", "label_snake_camel_case"),
        ("nvidia.com/gpu.present", "label_nvidia_com_gpu_present"),
    ):
        assert vendors.node_label(key) == name
    assert [vendors.selected(p) for p in vendors.watched()] == [
        'label_gpu="on"',
        'label_feature_node_kubernetes_io_pci_0300_1002_present="true"',
        'label_ascend="on"',
        'label_birentech_com="gpu"',
        'label_dcu="on"',
    ]
    assert vendors.label_keys() == [p.chart.node_label.partition("=")[0] for p in PROFILES]
    resources = {
        "nvidia": ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"),
        "amd": ("amd.com/gpu", "amd.com/cpx_nps1"),
        "ascend": tuple(f"huawei.com/{c}" for c in ASCEND_CHIPS),
        "biren": ("birentech.com/gpu", "birentech.com/1-2-gpu"),
        "dcu": ("hygon.com/dcunum",),
    }
    assert sanitized("huawei.com/Ascend910B4-1") == "huawei_com_Ascend910B4_1"
    for p in PROFILES:
        for vendor, names in resources.items():
            for resource in names:
                matched = re.fullmatch(p.resources.capacity, sanitized(resource)) is not None
                assert matched == (vendor == p.name), (p.name, resource)


def kube_state_metrics_text(nodes: dict[str, tuple[dict[str, str], dict[str, int]]]) -> str:
    """kube-state-metrics' /metrics for `nodes` (name: its allowed labels, its extended resources' capacity),
    in its names: kube_node_labels' label_<key>, kube_node_status_capacity's sanitized resource, unit integer;
    every node Ready and schedulable."""
    families: dict[str, list[str]] = {}
    for node, (labels, capacity) in nodes.items():
        add = families.setdefault
        add("kube_node_status_condition", []).append(
            f'kube_node_status_condition{{node="{node}",condition="Ready",status="true"}} 1'
        )
        add("kube_node_spec_unschedulable", []).append(f'kube_node_spec_unschedulable{{node="{node}"}} 0')
        named_labels = "".join(f',{vendors.node_label(k)}="{v}"' for k, v in labels.items())
        add("kube_node_labels", []).append(f'kube_node_labels{{node="{node}"{named_labels}}} 1')
        for resource, count in capacity.items():
            series = f'node="{node}",resource="{sanitized(resource)}",unit="integer"'
            add("kube_node_status_capacity", []).append(f"kube_node_status_capacity{{{series}}} {count}")
    return "".join(f"# TYPE {name} gauge\n" + "\n".join(lines) + "\n" for name, lines in families.items())


@contextlib.asynccontextmanager
async def kube_state_metrics(text: str) -> AsyncIterator[dict[str, Any]]:
    """A stand-in of kube-state-metrics serving `text` at /metrics: its scrape job."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield {
            "job_name": "kube-state-metrics",
            "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
        }
    finally:
        await runner.cleanup()


async def test_live_prometheus_names_each_vendors_nodes_resources_and_commands(tmp_path: Path) -> None:
    """The shipped rules in a live Prometheus that scrapes a Hygon DCU node's sidecar and kube-state-metrics
    (a stand-in with its names) for nodes of every vendor, each labelled as its chart selects them: the
    cluster rule fires for each vendor's node without that vendor's resources, naming the vendor and its
    resource, and for no other node: not one that has them, and not one that serves another vendor's
    devices while it carries NVIDIA's label too. A DCU device unhealthy again after the restart that
    re-read it is alerted with the DCU's command (hy-smi), not NVIDIA's."""
    watched = vendors.watched()
    default_label = dict([DEFAULT.chart.node_label.split("=", 1)])
    nodes: dict[str, tuple[dict[str, str], dict[str, int]]] = {}
    for p in watched:
        label = dict([p.chart.node_label.split("=", 1)])
        nodes[f"{p.name}-down"] = (label, {})
        nodes[f"{p.name}-up"] = (label, {p.resources.default: 4})
        if not p.default:  # a node of this vendor's that carries NVIDIA's label too
            nodes[f"{p.name}-also-{DEFAULT.name}"] = (label | default_label, {p.resources.default: 4})
    nodes["cpu-node"] = ({}, {})
    expected = {(f"{p.name}-down", p.name) for p in watched}
    dcu = named("dcu")
    assert dcu
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(node_api(("dcu-node",)))
        node = await stack.enter_async_context(sim_node("dcu-node", api, dcu))
        ksm = await stack.enter_async_context(kube_state_metrics(kube_state_metrics_text(nodes)))
        prom = await stack.enter_async_context(prometheus(tmp_path, {node.name: (node.pod, node.port)}, ksm))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        cluster: dict[tuple[str, str], dict[str, Any]] = {}

        async def cluster_firing() -> bool:
            for a in (await prom.api("alerts"))["alerts"]:
                if a["labels"]["alertname"] == vendors.ALERT:
                    assert (a["labels"]["node"], a["labels"].get("vendor")) in expected, a
                    if a["state"] == "firing":
                        cluster[(a["labels"]["node"], a["labels"]["vendor"])] = a
            return set(cluster) == expected

        await until(cluster_firing, "the cluster rule firing for each vendor's node without its resources")
        for (name, vendor), alert in cluster.items():
            owner = named(vendor)
            assert owner and alert["labels"]["severity"] == "critical"
            summary = alert["annotations"]["summary"]
            assert summary.startswith(f"{owner.vendor} node {name} is Ready")
            assert f"has no {vendors.resource_text(owner)} capacity" in summary
            assert alert["annotations"]["description"].endswith(f"on the node itself: {owner.devices.check}.")
        # The DCU: a device unhealthy for the duration, the plugin restarted (as the kubelet does on the
        # liveness failure), unhealthy again.
        node.plugin.set_health("GPU-1", False)
        await until(lambda: node.healthz(http, 503), "the recovery to ask for the plugin restart")
        await node.plugin.restart()
        unrecoverable: list[dict[str, Any]] = []

        async def named_with_its_command() -> bool:
            await cluster_firing()
            unrecoverable[:] = [
                a
                for a in (await prom.api("alerts"))["alerts"]
                if a["labels"]["alertname"] == UNRECOVERABLE and a["state"] == "firing"
            ]
            return bool(unrecoverable)

        await until(named_with_its_command, "the DCU device unrecoverable")
        (alert,) = unrecoverable
        assert (alert["labels"]["node"], alert["labels"]["resource"]) == ("dcu-node", dcu.resources.default)
        description = alert["annotations"]["description"]
        assert f"read what failed ({dcu.devices.inspect})," in description and "nvidia" not in description


# -- the dashboard ----------------------------------------------------------------------------------
def dashboard_json() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((MONITORING / "dashboard.json").read_text())
    return loaded


def test_the_committed_dashboard_is_the_generators_output() -> None:

    assert (MONITORING / "dashboard.json").read_text() == dashboard.render(), "run `make dashboard`"


def test_the_dashboard_reads_back_whole_as_grafana_dashboard_json() -> None:
    """grafana-foundation-sdk's models of Grafana's dashboard schema (panels by their plugin's own
    options and field config, Prometheus queries by their data source's model) read every field back:
    nothing unknown, nothing of the wrong type."""

    register_default_plugins()
    committed = dashboard_json()
    assert json.loads(json.dumps(Dashboard.from_json(committed), cls=JSONEncoder)) == committed
    # A field the schema does not know would not come back: the check is not vacuous.
    spoiled = json.loads(json.dumps(committed))
    spoiled["panels"][1]["options"]["colourMode"] = "background"
    assert json.loads(json.dumps(Dashboard.from_json(spoiled), cls=JSONEncoder)) != spoiled


def test_the_dashboard_is_laid_out_and_queries_through_its_variables() -> None:
    d = dashboard_json()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["node"]["includeAll"] and variables["node"]["multi"]
    panels = d["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["description"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in [p, *p["targets"]]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"]))
            assert used <= set(variables) | {"__rate_interval", "__range"}, (p["title"], used)
            if "node" in t["expr"] or "device_plugin" in t["expr"]:
                assert 'node=~"$node"' in t["expr"], (p["title"], t["expr"])
    titles = {p["title"] for p in panels}
    for wanted in (
        "Check state per node",
        "Registration success ratio",
        "ListAndWatch latency P95",
        "Registration attempts",
        "Liveness restarts asked for, kubelet restarts",
        "Restart budgets spent",
        "GPUs per node: on the host vs listed by the kubelet",
        "HAMi's registration per node",
        "HAMi's registration by reason",
        "Unhealthy GPUs: plugin restarts asked for, GPUs brought back",
        "GPUs unrecoverable",
    ):
        assert wanted in titles


def test_the_dashboard_colours_every_reason_code_of_the_hami_check() -> None:
    assert tuple(dashboard.HAMI_REASON_COLOURS) == HAMI_CODES


def test_each_harm_of_the_hami_check_has_its_alert_and_the_unjudged_reasons_none() -> None:
    """The reason codes each HAMi alert reads are the verdicts' groups (sidecar.hami.verdicts): what HAMi's
    scheduler cannot see, the GPUs it places Pods on that the kubelet took out, its last copy; every code
    a plugin restart is asked for has an alert, and no code that judges nothing has one."""
    shipped = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]
    alerts = {r["alert"]: r["expr"] for g in shipped["groups"] for r in g["rules"] if "alert" in r}

    def reasons(name: str) -> frozenset[str]:
        (found,) = re.findall(r'device_plugin_hami_registration\{reason=~?"([^"]+)"\}', alerts[name])
        return frozenset(found.split("|"))

    assert reasons("HamiSchedulerCannotSeeGPUs") == UNSEEN
    assert reasons("HamiSchedulerPlacesPodsOnUnhealthyGPUs") == {"stale_health"}
    assert reasons("HamiSchedulerSchedulesFromLastCopy") == {"last_copy"}
    alerted = {c for n in alerts if "hami_registration" in alerts[n] for c in reasons(n)}
    assert alerted >= DIFFERS and not NOT_JUDGED & alerted and alerted <= set(HAMI_CODES)


def test_kustomize_ships_the_dashboard_as_a_grafana_sidecar_configmap() -> None:

    out = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(MONITORING)], capture_output=True, text=True, check=True
    ).stdout
    (cm,) = [o for o in yaml.safe_load_all(out) if o and o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["name"] == "hami-guard-dashboard"  # no hash suffix: one dashboard, updated in place
    assert json.loads(cm["data"]["hami-guard.json"]) == dashboard_json()
