"""DaemonSet rollouts across two nodes (`make node-e2e`): the readinessProbe halts a rollout to a plugin
that cannot register at the first node it reaches, and does not halt one where a node has a dead GPU.

A second node, node-e2e-2, joins for this file only (`node-ctl node2-start`, tests/node/second.sh: its own
containerd and kubelet in namespaces nested in the first node's), labelled gpu=on like the first, so the
DaemonSet controller places a plugin pod on each; it leaves after (the Node and its pods deleted). The
DaemonSet keeps the shape of HAMi's chart: RollingUpdate with maxUnavailable 1. The new pod template
carries its fault through the stand-in's HAMI_STANDIN_FAULTS; a dead GPU is the fault file `dead-gpu` in
that node's /run/hami-standin (its folder of the run, seen from here). Times are appended to figures.txt.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.node.kit import (
    DEVICES,
    NODE,
    NS,
    RUN,
    SELECTOR,
    allocatable,
    container_status,
    figure,
    get,
    kubectl,
    kubelet_metric,
    node_ctl,
    node_resources,
    plugin_pod,
    probe_metrics,
    ready,
    wait,
)

if not RUN:
    pytest.skip("runs inside the node: make node-e2e", allow_module_level=True)

NODE2 = "node-e2e-2"
NODES = (NODE, NODE2)
DS = "daemonset/hami-device-plugin"
HASH = "controller-revision-hash"
BUDGET = 3  # the sidecar's restart budget (HAMI_GUARD_RESTART_BUDGET's default in the patch)
HALF = str(int(DEVICES) // 2)  # allocatable with one of the stand-in's two GPUs dead


def control(node: str) -> Path:
    """The node's /run/hami-standin, as this (the first) node's mount namespace sees it."""
    return Path("/run/hami-standin") if node == NODE else Path(RUN, NODE2, "run", "hami-standin")


def node_ready(node: str) -> bool:
    conditions = get("node", node, "")["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pod_get(pod: dict[str, Any], path: str) -> tuple[int, str]:
    """The sidecar's answer on `pod`'s IP (either node's: the second node's pods are routed from here)."""
    ip = pod["status"].get("podIP", "")
    try:
        with urllib.request.urlopen(f"http://{ip}:9395{path}", timeout=2) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")
    except OSError:
        return 0, ""


def sidecar_metric(pod: dict[str, Any], name: str) -> float | None:
    code, text = pod_get(pod, "/metrics")
    values = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values) if code == 200 and values else None


def plugin_restarts(pod: dict[str, Any]) -> int:
    return int(container_status(pod, "device-plugin").get("restartCount", 0))


def healthy(node: str) -> dict[str, Any] | None:
    """The node's plugin pod when it is Ready and the node's allocatable is the stand-in's devices."""
    pod = plugin_pod(node)
    return pod if ready(pod) and node_resources(node)[1] == DEVICES else None


def both_healthy(timeout: float = 240) -> dict[str, dict[str, Any]]:
    pods: dict[str, dict[str, Any]] = {}
    for n in NODES:
        pods[n] = wait(f"{n}: the plugin Ready, allocatable {DEVICES}", partial(healthy, n), timeout)
    return pods


def ds_status() -> dict[str, Any]:
    status: dict[str, Any] = get("daemonset", "hami-device-plugin")["status"]
    return status


@pytest.fixture(scope="module", autouse=True)
def second_node() -> Iterator[None]:
    """node-e2e-2 joined, its plugin pod Ready and registered, for this file's tests; gone after."""
    t0 = time.monotonic()
    node_ctl("node2-start", timeout=300)
    try:
        both_healthy(300)
        figure(
            f"rollout: {NODE2} joined, its plugin Ready and allocatable {DEVICES} "
            f"after {time.monotonic() - t0:.0f} s"
        )
        yield
    finally:
        node_ctl("node2-stop", timeout=180)
        wait(
            f"{NODE2}'s pods gone",
            lambda: not get("pods", selector=SELECTOR, field=f"spec.nodeName={NODE2}")["items"],
            60,
        )
        wait("the DaemonSet on one node", lambda: ds_status().get("desiredNumberScheduled") == 1, 60)


def test_rollout_to_a_plugin_that_cannot_register_halts() -> None:
    """A new template whose plugin never registers: the DaemonSet replaces one node's pod, which is never
    Ready, and stops there; the other node keeps its old pod, Ready, with its GPUs. The halted node's plugin
    is restarted by the kubelet no more than the sidecar's budget. `kubectl rollout undo` heals both."""
    pods = both_healthy()
    old = {n: p["metadata"]["name"] for n, p in pods.items()}
    old_hash = {p["metadata"]["labels"][HASH] for p in pods.values()}
    assert len(old_hash) == 1, old_hash
    (old_hash_value,) = old_hash

    t0 = time.monotonic()
    kubectl("set", "env", "-n", NS, DS, "-c", "device-plugin", "HAMI_STANDIN_FAULTS=noregister")
    try:

        def replaced() -> tuple[str, dict[str, Any]] | None:
            for n in NODES:
                p = plugin_pod(n)
                if p["metadata"]["labels"].get(HASH) != old_hash_value:
                    return n, p
            return None

        halted, pod = wait("a node's pod replaced by the new template", replaced, 120)
        t_replaced = time.monotonic() - t0
        other = NODE2 if halted == NODE else NODE

        # Until the budget is spent, at every look: the other node keeps its old pod, Ready, with its GPUs,
        # and the new pod is not Ready (pytest.fail: not an assertion `wait` would take for "not yet").
        def spent() -> bool:
            kept = plugin_pod(other)
            if kept["metadata"]["name"] != old[other] or kept["metadata"]["labels"][HASH] != old_hash_value:
                pytest.fail(f"the rollout went on to {other}: {kept['metadata']['name']}")
            if not ready(kept) or allocatable(other) != DEVICES:
                pytest.fail(f"{other} lost its plugin: Ready {ready(kept)}, allocatable {allocatable(other)}")
            p = plugin_pod(halted)
            if ready(p):
                pytest.fail(f"{halted}'s new pod became Ready")
            return sidecar_metric(p, "device_plugin_restart_budget_spent") == 1

        wait("the halted node's restart budget spent", spent, 600, 2)
        t_spent = time.monotonic() - t0
        pod = plugin_pod(halted)
        at_spent = plugin_restarts(pod)
        time.sleep(45)  # past another registration grace and liveness window: no further restart
        pod = plugin_pod(halted)
        assert plugin_restarts(pod) == at_spent == BUDGET, (at_spent, plugin_restarts(pod))
        assert not ready(pod)
        assert pod_get(pod, "/healthz")[0] == 200
        kept = plugin_pod(other)
        assert kept["metadata"]["name"] == old[other] and kept["metadata"]["labels"][HASH] == old_hash_value
        assert ready(kept) and node_ready(other)
        assert node_resources(other) == (DEVICES, DEVICES)
        status = ds_status()
        assert status.get("desiredNumberScheduled") == 2, status
        assert status.get("updatedNumberScheduled") == 1, status
        assert status.get("numberUnavailable") == 1, status
        assert status.get("numberAvailable") == 1, status
        halted_for = time.monotonic() - t0
        figure(
            f"rollout halted: {halted}'s pod replaced {t_replaced:.0f} s after the change, never Ready; "
            f"its plugin restarted {at_spent} times by the kubelet, budget spent at {t_spent:.0f} s, "
            f"no restart after; "
            f"{other} kept its old pod, Ready, allocatable {DEVICES}, for {halted_for:.0f} s "
            f"(DaemonSet: updatedNumberScheduled 1, numberUnavailable 1)"
        )
    finally:
        t1 = time.monotonic()
        kubectl("rollout", "undo", "-n", NS, DS)

    def healed() -> bool:
        status = ds_status()
        return (
            status.get("updatedNumberScheduled") == 2
            and status.get("numberAvailable") == 2
            and all(healthy(n) for n in NODES)
        )

    wait("both nodes healed by rollout undo", healed, 300, 1)
    t_undo = time.monotonic() - t1
    pods = both_healthy()
    assert {p["metadata"]["labels"][HASH] for p in pods.values()} == {old_hash_value}
    assert pods[other]["metadata"]["name"] == old[other]  # never touched
    figure(
        f"rollout undo: both nodes on the old template, Ready, allocatable {DEVICES}, "
        f"{t_undo:.0f} s after the undo"
    )


def test_rollout_with_a_dead_gpu_does_not_halt() -> None:
    """One node's GPU dead (its devices Unhealthy): a rollout replaces both nodes' pods, both Ready, and the
    dead-GPU node's plugin never gets a liveness failure (the kubelet's prober_probe_total) nor a restart."""
    both_healthy()
    dead = NODE2
    flag = control(dead) / "dead-gpu"
    flag.parent.mkdir(exist_ok=True)
    flag.touch()
    try:
        wait(
            f"{dead}: allocatable {HALF} (capacity {DEVICES})",
            lambda: node_resources(dead) == (DEVICES, HALF),
            60,
        )
        before = {n: plugin_pod(n) for n in NODES}
        old_hash = before[NODE]["metadata"]["labels"][HASH]
        assert ready(before[dead])
        t0 = time.monotonic()
        kubectl("rollout", "restart", "-n", NS, DS)

        def done() -> dict[str, dict[str, Any]] | None:
            status = ds_status()
            pods = {n: plugin_pod(n) for n in NODES}
            if not (status.get("updatedNumberScheduled") == 2 and status.get("numberAvailable") == 2):
                return None
            if any(p["metadata"]["labels"][HASH] == old_hash or not ready(p) for p in pods.values()):
                return None
            return pods

        pods = wait("the rollout done on both nodes", done, 300, 1)
        t_done = time.monotonic() - t0
        assert not ds_status().get("numberUnavailable"), ds_status()
        # Some more of the dead-GPU node's liveness probes (every 5 s after 10 s) on the new pod.
        time.sleep(30)
        pod = plugin_pod(dead)
        name = pod["metadata"]["name"]
        assert name == pods[dead]["metadata"]["name"] and ready(pod)
        assert node_resources(dead) == (DEVICES, HALF)  # the GPU still dead in the new plugin
        assert plugin_restarts(pod) == 0
        metrics = probe_metrics(dead)
        labels = {"probe_type": "Liveness", "container": "device-plugin", "pod": name}
        ok = kubelet_metric(metrics, "prober_probe_total", result="successful", **labels)
        failed = kubelet_metric(metrics, "prober_probe_total", result="failed", **labels)
        assert ok >= 5 and failed == 0, (ok, failed)
        code, verbose = pod_get(pod, "/readyz?verbose")
        figure(
            f"rollout with a dead GPU on {dead}: both nodes updated and Ready "
            f"{t_done:.0f} s after the change; "
            f"{dead}'s new plugin: {ok:.0f} liveness probes, all passed, 0 restarts, allocatable {HALF} of "
            f"{DEVICES}; its /readyz (all checks) {code}"
        )
        assert verbose  # the sidecar answered
    finally:
        flag.unlink(missing_ok=True)
    wait(f"{dead}: allocatable {DEVICES} again", lambda: allocatable(dead) == DEVICES, 60)
    both_healthy()
