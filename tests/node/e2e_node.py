"""End-to-end tests on a real node: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the
kubelet, containerd and runc, brought up by tests/node/node.sh (`make node-e2e`), which runs this file
inside the node's namespaces. HAMi's device-plugin DaemonSet shape with the hami-patch component
(manifests/example-hami, rendered by kubectl kustomize through tests/node/overlay) is applied as it is;
the DaemonSet controller and the scheduler place its pod. The overlay only puts the project's stand-in
for HAMi's plugin (testing.standin) in the `device-plugin` container, whose faults are files in
/run/hami-standin, and names the node's kubelet process (kubelet-e2e).

The tests share the node and run in file order; each leaves the plugin registered and Ready. Timings
(fault to allocatable restored, probes served, the sidecar's CPU and RSS) are appended to
$NODE_E2E_DIR/figures.txt, which node.sh prints: they are measured, not asserted. The restart budget
against the kubelet's CrashLoopBackOff is shown by tests/node/e2e_rollout.py's halted rollout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.node.kit import (
    DEVICES,
    KUBELET_SOCKET,
    NODE,
    NS,
    RESOURCE,
    RUN,
    SELECTOR,
    SIDECAR_IMAGE,
    allocatable,
    container_status,
    events,
    fault_applied,
    figure,
    get,
    healthy_plugin,
    healthz,
    kubectl,
    kubelet_metric,
    node_ctl,
    node_resources,
    plugin_pod,
    probe_metrics,
    ready,
    restarts,
    set_fault,
    status_reason,
    wait,
)

if not RUN:
    pytest.skip("runs inside the node: make node-e2e", allow_module_level=True)


def test_healthy_node() -> None:
    """nvidia.com/gpu in capacity and allocatable, a GPU pod admitted and Running with its Allocate answer,
    the plugin Ready, and the kubelet's prober getting 200 from /healthz."""
    capacity, alloc = node_resources()
    assert (capacity, alloc) == (DEVICES, DEVICES)
    pod = plugin_pod()
    assert ready(pod)
    assert healthz() == 200
    assert restarts("device-plugin") == 0

    gpu_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-workload", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "work",
                    "image": SIDECAR_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        "/opt/hami-guard/bin/python",
                        "-c",
                        "import os, time; print(os.environ.get('NVIDIA_VISIBLE_DEVICES'), flush=True); "
                        "time.sleep(3600)",
                    ],
                    "resources": {"limits": {RESOURCE: "1"}},
                }
            ],
        },
    }
    kubectl("apply", "-f", "-", stdin=json.dumps(gpu_pod))
    try:
        running = wait(
            "the GPU pod Running",
            lambda: (p := get("pod", "gpu-workload", "default"))["status"].get("phase") == "Running" and p,
            120,
        )
        assert running["spec"]["nodeName"] == NODE
        visible = wait(
            "the GPU pod's log", lambda: kubectl("logs", "-n", "default", "gpu-workload").strip(), 30
        )
        # The device the kubelet got from Allocate: one of HAMi's split IDs.
        assert visible.startswith("GPU-") and visible.count(",") == 0, visible
        wait("allocatable unchanged, one device in use", lambda: allocatable() == DEVICES, 30)
    finally:
        kubectl("delete", "pod", "-n", "default", "gpu-workload", "--wait=true", check=False)

    # The kubelet's prober: every /healthz probe it made in a minute succeeded.
    before = probe_metrics()
    t0 = time.monotonic()
    time.sleep(60)
    after = probe_metrics()
    minutes = (time.monotonic() - t0) / 60
    labels = {"probe_type": "Liveness", "container": "device-plugin"}
    ok = kubelet_metric(after, "prober_probe_total", result="successful", **labels) - kubelet_metric(
        before, "prober_probe_total", result="successful", **labels
    )
    failed = kubelet_metric(after, "prober_probe_total", result="failed", **labels) - kubelet_metric(
        before, "prober_probe_total", result="failed", **labels
    )
    ready_ok = kubelet_metric(
        after, "prober_probe_total", result="successful", probe_type="Readiness", container="device-plugin"
    ) - kubelet_metric(
        before, "prober_probe_total", result="successful", probe_type="Readiness", container="device-plugin"
    )
    assert ok >= 10 and failed == 0, (ok, failed)
    figure(
        f"healthy: the kubelet's prober: {ok / minutes:.1f} /healthz liveness probes per minute, all 200; "
        f"{ready_ok / minutes:.1f} /readyz readiness probes per minute"
    )
    sidecar_usage(pod)


def sidecar_usage(pod: dict[str, Any]) -> None:
    """The sidecar's CPU over 30 s and its RSS, read from /proc (the pod shares the node's PID namespace)."""
    pids = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and _cmdline(p).startswith("/opt/hami-guard/bin/python /opt/hami-guard/bin/hami-sidecar")
    ]
    assert len(pids) == 1, pids
    pid = pids[0]
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    c0, t0 = cpu(), time.monotonic()
    time.sleep(30)
    share = (cpu() - c0) / (time.monotonic() - t0)
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS")
    )
    figure(
        f"healthy: hami-sidecar in the pod: {share * 100:.2f} % of a core over 30 s, {rss / 1024:.1f} MiB RSS"
    )


def _cmdline(p: Path) -> str:
    try:
        return p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def restored_after(fault: str, inflict: Callable[[], None], timeout: float = 180) -> None:
    """Inflicts a fault on a healthy node; checks the sidecar's 503, the kubelet's restart of the plugin
    container for its failed liveness probe, and allocatable back; records the time it all took."""
    healthy_plugin()
    pod = plugin_pod()
    name = pod["metadata"]["name"]
    before = restarts("device-plugin")
    t0 = time.monotonic()
    inflict()
    # Each event's first time, polled together: the sidecar's 503, allocatable lost, the kubelet's restart
    # of the plugin container, allocatable back after it.
    seen: dict[str, float] = {}
    reason = ""

    def progress() -> bool:
        nonlocal reason
        now = time.monotonic() - t0
        if "503" not in seen and healthz() == 503:
            seen["503"] = now
            reason = status_reason()
        alloc = allocatable()
        if "lost" not in seen and alloc != DEVICES:
            seen["lost"] = now
        if "restart" not in seen and restarts("device-plugin") > before:
            seen["restart"] = now
        if "restart" in seen and "back" not in seen and alloc == DEVICES:
            seen["back"] = now
        return len(seen) == 4

    wait(f"{fault}: 503, allocatable lost, the plugin restarted, allocatable back", progress, timeout, 0.2)
    assert seen["503"] <= seen["restart"] <= seen["back"], seen
    killing = [
        e["message"]
        for e in events(name)
        if e["reason"] == "Killing" and "device-plugin" in e["message"] and "liveness" in e["message"]
    ]
    assert killing, [(e["reason"], e["message"]) for e in events(name)]
    assert restarts("device-plugin") == before + 1
    assert restarts("hami-sidecar") == 0
    figure(
        f"{fault}: /healthz 503 after {seen['503']:.1f} s ({reason}), allocatable lost at "
        f"{seen['lost']:.1f} s, device-plugin restarted by the kubelet at {seen['restart']:.1f} s "
        f"({killing[0]}), allocatable restored {seen['back']:.1f} s after the fault"
    )
    healthy_plugin()


def test_kubelet_restart_without_reregistration() -> None:
    """The headline failure: the real kubelet restarted, the plugin not registering again."""
    set_fault("ignore-kubelet-restart", True)
    try:
        fault_applied()
        restored_after("kubelet restart, plugin not re-registering", lambda: node_ctl("kubelet-restart"))
    finally:
        set_fault("ignore-kubelet-restart", False)


def test_drop() -> None:
    """The plugin ends its ListAndWatch stream while it keeps serving."""
    restored_after("drop (ListAndWatch ended)", lambda: set_fault("drop", True))


def test_sidecar_killed_does_not_restart_the_plugin() -> None:
    """The sidecar's own failure is never the plugin's restart: killed, the kubelet restarts the sidecar
    container, and the device-plugin container outlives its liveness probe's failure window."""
    healthy_plugin()
    plugin_before, sidecar_before = restarts("device-plugin"), restarts("hami-sidecar")
    pids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and "bin/hami-sidecar" in _cmdline(p)]
    assert len(pids) == 1
    os.kill(int(pids[0].name), 9)
    wait("the sidecar restarted", lambda: restarts("hami-sidecar") > sidecar_before, 60)
    # periodSeconds 5 x failureThreshold 3, and more.
    time.sleep(30)
    assert restarts("device-plugin") == plugin_before
    healthy_plugin()


def roll_sidecar_env(value: str) -> dict[str, Any]:
    """Rolls the DaemonSet to hami-sidecar with HAMI_GUARD_PROBE_INTERVAL=value; returns the new pod."""
    old = plugin_pod()["metadata"]["name"]
    kubectl(
        "set",
        "env",
        "-n",
        NS,
        "daemonset/hami-device-plugin",
        "-c",
        "hami-sidecar",
        f"HAMI_GUARD_PROBE_INTERVAL={value}",
    )

    def replaced() -> dict[str, Any] | None:
        pod = plugin_pod()
        running = container_status(pod, "device-plugin").get("state", {}).get("running")
        return pod if pod["metadata"]["name"] != old and running else None

    return wait("the DaemonSet's new pod running", replaced, 180, 1)


def test_sidecar_bad_flag_does_not_restart_the_plugin() -> None:
    """A setting the sidecar cannot parse is served, not exited on: /healthz 200, so the plugin is never
    restarted for it; /sidecarz 503 shows the sidecar's own fault."""
    healthy_plugin()
    try:
        roll_sidecar_env("not-a-number")
        wait(f"allocatable {RESOURCE}={DEVICES}", lambda: allocatable() == DEVICES, 120)
        time.sleep(35)  # past the plugin's liveness window (initialDelaySeconds 10, 3 x 5 s)
        assert restarts("device-plugin") == 0
        assert healthz() == 200
        assert healthz("/sidecarz") == 503
        assert not ready(plugin_pod())
    finally:
        roll_sidecar_env("10")  # the patch's value
    healthy_plugin(240)


def init_log(pod: str) -> str:
    """hami-initcheck's output, read from the kubelet's log files of the pod (/var/log/pods) as it exits:
    the kubelet removes an exited attempt's container, and its log with it, once the next one runs."""
    lines: list[str] = []
    for path in sorted(Path("/var/log/pods").glob(f"{NS}_{pod}_*/hami-initcheck/*.log")):
        with contextlib.suppress(OSError):
            # CRI log lines: <time> <stream> <tag> <text>
            lines += [line.split(" ", 3)[-1] for line in path.read_text(errors="replace").splitlines()]
    return "\n".join(lines)


def test_init_container_without_kubelet_socket() -> None:
    """kubelet.sock missing: hami-initcheck exits 100, the pod shows Init:Error (then back-off); once the
    kubelet creates its socket again, --wait lets the pod start."""
    healthy_plugin()
    old = plugin_pod()["metadata"]["name"]
    node_ctl("kubelet-stop")
    KUBELET_SOCKET.unlink(missing_ok=True)
    node_ctl("kubelet-start")
    # A started kubelet creates kubelet.sock again at once: remove it again once it is up, so the
    # device manager keeps serving on an unlinked socket, and replace the pod.
    wait("kubelet.sock re-created", KUBELET_SOCKET.exists, 60)
    KUBELET_SOCKET.unlink()
    kubectl("delete", "pod", "-n", NS, old, "--wait=false")
    try:
        seen: dict[str, Any] = {}

        def progress() -> bool:
            """The new pod's init container's exit code, and the status kubectl shows for the pod; the
            status is Init:Error only until the kubelet's back-off runs the container again."""
            pods = [p for p in get("pods", selector=SELECTOR)["items"] if p["metadata"]["name"] != old]
            if not pods:
                return False
            name = pods[0]["metadata"]["name"]
            st = container_status(pods[0], "hami-initcheck")
            term = st.get("state", {}).get("terminated") or st.get("lastState", {}).get("terminated")
            if term and "exit" not in seen:
                seen["exit"], seen["name"] = term["exitCode"], name
                seen["log"] = init_log(name)
            cols = kubectl("get", "pod", "-n", NS, name, "--no-headers").split()
            if len(cols) > 2 and cols[2] in ("Init:Error", "Init:CrashLoopBackOff"):
                seen.setdefault("status", cols[2])
            return "exit" in seen and "status" in seen

        wait("hami-initcheck's exit and the pod's Init status", progress, 200, 0.3)
        assert seen["exit"] == 100, seen
        failed = [line for line in seen["log"].splitlines() if line.startswith("fail:")]
        assert failed, seen["log"]
        figure(f"init: hami-initcheck exited {seen['exit']}, the pod {seen['status']}; {failed[0]}")
    finally:
        node_ctl("kubelet-restart")  # kubelet.sock again
    healthy_plugin(240)
