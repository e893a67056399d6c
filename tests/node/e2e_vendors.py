"""Another vendor's plugin on the real node (`make node-e2e`): an Ascend-shaped DaemonSet, installed the way
an Ascend operator installs it, beside HAMi's NVIDIA one.

The chart is tests/fixtures/ascend-chart (Project-HAMi/ascend-device-plugin's chart's shape: its
DaemonSet, labels, ServiceAccount and ClusterRole, the `device-plugin` container with its metrics port
9395, the device config listing one resource per chip: 910B3's and 310P's), rendered by Helm 3 with
hami-guard's post-renderer (`vendor=ascend` and nothing else about the node): the sidecar gets port 9396
and both chips' resources as candidates, and learns from the pod's own listener which one this node's
plugin serves; liveness follows the Ascend profile. The same render, then only what a node without an
NPU needs (`standin_daemonset`): the project's stand-in plays Ascend's plugin on a 910B3 (`--vendor
ascend`: `Ascend910B3.sock`, `huawei.com/Ascend910B3`, DCMI-shaped IDs, HAMi's Ascend annotations) in
`device-plugin`, its faults in /run/hami-standin-ascend, and the driver's hostPath goes (there is no
driver, and a hostPath of no type would create its folder on the machine).

Measured (appended to figures.txt, not asserted): the Ascend plugin's drop mended by the kubelet's
restart of its container for hami-guard's liveness; then NVIDIA's drop on the same node while the
Ascend pod runs beside it, to compare with NVIDIA's own figures (tests/node/e2e_node.py). At the end the
Ascend release is deleted and the node's label removed: the files after this one see the node as before.
"""

from __future__ import annotations

import glob
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.node.kit import (
    NODE,
    RUN,
    RUNS,
    Plugin,
    get,
    healthy_plugin,
    kubectl,
    restarts,
    restored_after,
    set_fault,
    sidecar_status,
    sidecar_usage,
    wait,
)

if not RUN:
    pytest.skip("runs inside the node: make node-e2e", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "tests" / "fixtures" / "ascend-chart"
POST_RENDERER = REPO / "manifests" / "hami-patch" / "post-renderer.sh"
STANDIN_IMAGE = "registry.invalid/hami-standin:0.1.0"  # tests/node/images.sh's name for it
RELEASE = "ascend"
# The release's own namespace: the chart creates a ConfigMap named as HAMi's scheduler's device config
# (config.deviceConfigMapName, hami-scheduler-device), which in HAMi's namespace would be HAMi's own
# (Helm refuses to take it over; kubectl apply overwrites it, and the delete after the file removed it
# from under HAMi's plugin pod).
NAMESPACE = "hami-ascend"
CHIP = "Ascend910B3"  # the node's chip: one of the chart's vnpus entries
NODE_LABEL = ("ascend", "on")  # the chart's nodeSelector
ASCEND = Plugin(
    resource=f"huawei.com/{CHIP}",
    devices="8",  # the stand-in's 2 NPUs, each listed 4 times (a 910B3's vNPU count)
    selector=f"app.kubernetes.io/component=hami-ascend-device-plugin,app.kubernetes.io/instance={RELEASE}",
    control=Path("/run/hami-standin-ascend"),
    port=9396,  # the post-renderer's: Ascend's own metrics server has 9395
    namespace=NAMESPACE,
)
SIDECAR_SETTINGS = {"HAMI_GUARD_KUBELET_PROCESS_NAME": "kubelet-e2e"}  # the node's kubelet binary's name


def helm_template() -> list[dict[str, Any]]:
    """The chart rendered by Helm 3 through the post-renderer, as `helm install` would apply it."""
    helm = sorted(glob.glob(str(REPO / "tests" / "helm" / "bin" / "helm-v3.*")))
    assert helm, "no Helm 3 in tests/helm/bin: make helm-binaries"
    env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}")  # python3 with PyYAML
    args = ["registry=registry.invalid", "vendor=ascend"]
    done = subprocess.run(
        [
            helm[-1],
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--post-renderer",
            str(POST_RENDERER),
        ]
        + [a for arg in args for a in ("--post-renderer-args", arg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def standin_daemonset(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The render with what a node without an NPU needs: the stand-in in `device-plugin`, every image
    imported (pull policy Never), the node's kubelet name for hami-guard, no driver hostPath."""
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    for c in spec["initContainers"]:
        c["imagePullPolicy"] = "Never"
        c["env"] = c.get("env", []) + [{"name": k, "value": v} for k, v in SIDECAR_SETTINGS.items()]
    (plugin,) = [c for c in spec["containers"] if c["name"] == "device-plugin"]
    plugin.update(
        image=STANDIN_IMAGE,
        imagePullPolicy="Never",
        command=["/opt/hami-guard/bin/python", "-m", "testing.standin"],
        args=["--vendor", "ascend", "--gpus", "2", "--control", str(ASCEND.control)],
    )
    plugin["volumeMounts"] = [m for m in plugin["volumeMounts"] if m["name"] != "hiai-driver"]
    plugin["volumeMounts"].append({"name": "standin-control", "mountPath": str(ASCEND.control)})
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "hiai-driver"]
    spec["volumes"].append(
        {"name": "standin-control", "hostPath": {"path": str(ASCEND.control), "type": "DirectoryOrCreate"}}
    )
    return docs


@pytest.fixture(scope="module")
def ascend() -> Iterator[list[dict[str, Any]]]:
    """The Ascend release installed on the node, its plugin Ready; deleted after the file."""
    set_fault("drop", False, ASCEND)
    docs = standin_daemonset(helm_template())
    rendered = yaml.safe_dump_all(docs)
    kubectl("label", "node", NODE, "=".join(NODE_LABEL), "--overwrite")
    kubectl("create", "namespace", NAMESPACE)
    kubectl("apply", "-f", "-", stdin=rendered)
    try:
        pods = lambda: get("pods", namespace=NAMESPACE, selector=ASCEND.selector)["items"] or None  # noqa: E731
        wait("the Ascend plugin's pod", pods, 120)
        healthy_plugin(240, ASCEND)
        yield docs
    finally:
        kubectl("delete", "--wait=true", "--ignore-not-found", "-f", "-", stdin=rendered, check=False)
        kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False)
        kubectl("label", "node", NODE, f"{NODE_LABEL[0]}-", check=False)


def test_ascend_patched_and_registered(ascend: list[dict[str, Any]]) -> None:
    """The post-renderer's Ascend pod: hami-sidecar on 9396, told both chips' resources, chose this node's
    from the pod's own listener and judges it registered; no container of the pod sharing a port with
    another, no restart."""
    (ds,) = [d for d in ascend if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    ports = [
        p["containerPort"] for c in spec["containers"] + spec["initContainers"] for p in c.get("ports", [])
    ]
    assert sorted(ports) == [9395, 9396], ports
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "hami-sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["HAMI_GUARD_PLUGIN_CANDIDATES"] == (
        f"huawei.com/{CHIP}={CHIP}.sock,huawei.com/Ascend310P=Ascend310P.sock"
    ), env
    status = sidecar_status(plugin=ASCEND)
    assert status["plugin_candidates"]["chosen"] == ASCEND.resource, status["plugin_candidates"]
    check = status["checks"][f"registered:{ASCEND.resource}"]
    assert check["state"] == "ok", check
    assert restarts("device-plugin", ASCEND) == 0


def test_sidecars_at_rest(ascend: list[dict[str, Any]]) -> None:
    """Both sidecars' CPU and RSS at rest (measured, not asserted): Ascend's looks at pod-resources
    between rounds, where NVIDIA's reads the kubelet's connections."""
    sidecar_usage("at rest beside each other", ASCEND)
    sidecar_usage("at rest beside each other")


RUN_IDS = [f"run{n + 1}" for n in range(RUNS)]


@pytest.mark.parametrize("run", RUN_IDS)
def test_ascend_drop(ascend: list[dict[str, Any]], run: str) -> None:
    """The Ascend plugin ends its ListAndWatch stream while it keeps serving: restarted by the kubelet for
    hami-guard's liveness, registered again."""
    restored_after(
        f"Ascend drop (ListAndWatch ended) ({run})", lambda: set_fault("drop", True, ASCEND), plugin=ASCEND
    )


@pytest.mark.parametrize("run", RUN_IDS)
def test_nvidia_drop_beside_ascend(ascend: list[dict[str, Any]], run: str) -> None:
    """NVIDIA's drop on the same node while the Ascend pod runs: its figures beside e2e_node.py's; the
    Ascend plugin untouched by it."""
    before = restarts("device-plugin", ASCEND)
    restored_after(f"NVIDIA drop beside the Ascend plugin ({run})", lambda: set_fault("drop", True))
    assert restarts("device-plugin", ASCEND) == before
    healthy_plugin(60, ASCEND)
