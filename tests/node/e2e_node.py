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

from testing.standin import FAIL_REGISTER, XID
from tests.node.kit import (
    CONTROL,
    DEVICES,
    KUBELET_SOCKET,
    NODE,
    NS,
    RESOURCE,
    RUN,
    RUNS,
    SELECTOR,
    allocatable,
    cmdline,
    container_status,
    fault_applied,
    figure,
    fresh_plugin_pod,
    get,
    gpu_pod,
    healthy_plugin,
    healthz,
    kubectl,
    kubelet_devices,
    kubelet_metric,
    node_ctl,
    node_resources,
    plugin_pod,
    probe_metrics,
    ready,
    replaced,
    restarts,
    restored_after,
    set_fault,
    sidecar_status,
    sidecar_usage,
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

    gpu_workload = gpu_pod(
        "gpu-workload",
        "1",
        "import os, time; print(os.environ.get('NVIDIA_VISIBLE_DEVICES'), flush=True); time.sleep(3600)",
    )
    kubectl("apply", "-f", "-", stdin=json.dumps(gpu_workload))
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
    sidecar_usage("healthy")


RUN_IDS = [f"run{n + 1}" for n in range(RUNS)]


@pytest.mark.parametrize("run", RUN_IDS)
def test_kubelet_restart_without_reregistration(run: str) -> None:
    """The headline failure: the real kubelet restarted, the plugin not registering again."""
    set_fault("ignore-kubelet-restart", True)
    try:
        fault_applied()
        restored_after(
            f"kubelet restart, plugin not re-registering ({run})", lambda: node_ctl("kubelet-restart")
        )
    finally:
        set_fault("ignore-kubelet-restart", False)


@pytest.mark.parametrize("run", RUN_IDS)
def test_drop(run: str) -> None:
    """The plugin ends its ListAndWatch stream while it keeps serving."""
    restored_after(f"drop (ListAndWatch ended) ({run})", lambda: set_fault("drop", True))


def one_shot(name: str) -> Callable[[], None]:
    """Sets a one-shot fault and waits until the stand-in took it (it removes the file)."""

    def inflict() -> None:
        set_fault(name, True)
        wait(f"the stand-in taking {name}", lambda: not (CONTROL / name).exists(), 15, 0.1)

    return inflict


@pytest.mark.parametrize("run", RUN_IDS)
def test_kubelet_restart_first_register_refused(run: str) -> None:
    """After a kubelet restart the plugin's first Register is refused: HAMi stops the plugin and starts
    it again 30 s later by itself. Its own retry must win: no 503, no restart."""

    def inflict() -> None:
        one_shot(FAIL_REGISTER)()
        node_ctl("kubelet-restart")

    restored_after(f"kubelet restart, the first Register refused ({run})", inflict, restart=False)


def test_sidecar_killed_does_not_restart_the_plugin() -> None:
    """The sidecar's own failure is never the plugin's restart: killed, the kubelet restarts the sidecar
    container, and the device-plugin container outlives its liveness probe's failure window."""
    healthy_plugin()
    plugin_before, sidecar_before = restarts("device-plugin"), restarts("hami-sidecar")
    pids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and "bin/hami-sidecar" in cmdline(p)]
    assert len(pids) == 1
    os.kill(int(pids[0].name), 9)
    wait("the sidecar restarted", lambda: restarts("hami-sidecar") > sidecar_before, 60)
    # Past the liveness window (periodSeconds 2 x failureThreshold 2) many times over.
    time.sleep(30)
    assert restarts("device-plugin") == plugin_before
    healthy_plugin()


def roll_sidecar_env(value: str) -> dict[str, Any]:
    """Rolls the DaemonSet to hami-sidecar with HAMI_GUARD_PROBE_INTERVAL=value; returns the new pod."""
    return roll_sidecar(f"HAMI_GUARD_PROBE_INTERVAL={value}")


def roll_sidecar(*env: str) -> dict[str, Any]:
    """Rolls the DaemonSet to hami-sidecar with `env` (kubectl set env: NAME=value, NAME- removes);
    returns the new pod."""
    old = plugin_pod()["metadata"]["name"]
    kubectl("set", "env", "-n", NS, "daemonset/hami-device-plugin", "-c", "hami-sidecar", *env)
    return replaced(old)


def test_sidecar_bad_flag_does_not_restart_the_plugin() -> None:
    """A setting the sidecar cannot parse is served, not exited on: /healthz 200, so the plugin is never
    restarted for it; /sidecarz 503 shows the sidecar's own fault."""
    healthy_plugin()
    try:
        roll_sidecar_env("not-a-number")
        wait(f"allocatable {RESOURCE}={DEVICES}", lambda: allocatable() == DEVICES, 120)
        time.sleep(35)  # past the plugin's liveness window (initialDelaySeconds 10, 2 x 2 s)
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


def node_cpu_seconds() -> float:
    """The CPU time of every process of the node's PID namespace (this test runs in it), with that of
    the children they reaped: the kubelet, containerd, the shims with each probe's runc and command."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = p.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / tick


def set_liveness(period: int, failures: int) -> None:
    """Rolls the DaemonSet to the plugin's livenessProbe with these settings, and waits for it healthy."""
    probe = {"periodSeconds": period, "failureThreshold": failures}
    patch = {
        "spec": {"template": {"spec": {"containers": [{"name": "device-plugin", "livenessProbe": probe}]}}}
    }
    old = plugin_pod()["metadata"]["name"]
    kubectl("patch", "-n", NS, "daemonset/hami-device-plugin", "-p", json.dumps(patch))
    replaced(old)
    healthy_plugin(240)


@pytest.mark.skipif(not os.environ.get("NODE_E2E_PROBE_COST"), reason="a measurement: NODE_E2E_PROBE_COST=1")
def test_liveness_probe_cost() -> None:
    """What the exec livenessProbe costs the node at each period: the node's CPU over 60 s at rest, per
    setting, and the probes the kubelet counted."""
    shipped = plugin_pod()["spec"]["containers"]
    live = next(c for c in shipped if c["name"] == "device-plugin")["livenessProbe"]
    labels = {"probe_type": "Liveness", "container": "device-plugin"}
    try:
        for period, failures in ((5, 3), (2, 2), (1, 1)):
            set_liveness(period, failures)
            time.sleep(10)
            before, c0, t0 = probe_metrics(), node_cpu_seconds(), time.monotonic()
            time.sleep(60)
            after, c1, t1 = probe_metrics(), node_cpu_seconds(), time.monotonic()
            probes = kubelet_metric(after, "prober_probe_total", **labels) - kubelet_metric(
                before, "prober_probe_total", **labels
            )
            figure(
                f"liveness probe every {period} s: {probes / (t1 - t0) * 60:.1f} probes a minute, the node's "
                f"processes {(c1 - c0) / (t1 - t0) * 100:.2f} % of a core"
            )
    finally:
        set_liveness(live["periodSeconds"], live["failureThreshold"])


# The recovery of devices HAMi never marks healthy again, switched on for the tests below. The node has
# no GPU: two device nodes every machine has stand for the stand-in's two GPUs' (the rule wants the host
# to still show the devices).
RECOVERY_ON = ("HAMI_GUARD_RECOVER_UNHEALTHY_AFTER=10", "HAMI_GUARD_DEVICE_GLOB=/host/dev/tty[12]")
RECOVERY_OFF = ("HAMI_GUARD_RECOVER_UNHEALTHY_AFTER-", "HAMI_GUARD_DEVICE_GLOB=/host/dev/nvidia[0-9]*")


@pytest.fixture(scope="module")
def recovery_on() -> Any:
    roll_sidecar(*RECOVERY_ON)
    healthy_plugin(240)
    yield
    roll_sidecar(*RECOVERY_OFF)
    healthy_plugin(240)


@pytest.mark.parametrize("run", RUN_IDS)
def test_xid_recovered_by_one_restart(recovery_on: None, run: str) -> None:
    """A transient XID on the first GPU: HAMi's plugin lists its devices Unhealthy for good; after 10 s,
    no pod holding one, the sidecar asks for one restart, and the new process lists them Healthy."""
    restored_after(f"XID on one GPU, recovery after 10 s ({run})", one_shot(XID))


@pytest.mark.parametrize("run", RUN_IDS)
def test_xid_on_a_gpu_a_pod_holds(recovery_on: None, run: str) -> None:
    """The same XID while a running pod holds every device: no restart, however long; once the pod is
    gone, the restart follows and the devices come back."""
    fresh_plugin_pod()  # a sidecar that restarted for no GPU yet (the test before recovered this one)
    before = restarts("device-plugin")
    pod = gpu_pod("gpu-holder", DEVICES, "import time; time.sleep(3600)")
    kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    try:
        wait(
            "the GPU pod Running",
            lambda: get("pod", "gpu-holder", "default")["status"].get("phase") == "Running",
            120,
        )
        one_shot(XID)()
        t0 = time.monotonic()
        wait("the devices listed unhealthy", lambda: kubelet_devices() == int(DEVICES) // 2, 30, 0.2)
        # Past the 10 s and the liveness window: polled, every answer 200, no restart.
        while time.monotonic() - t0 < 30:
            assert healthz() == 200, status_reason()
            assert restarts("device-plugin") == before
            time.sleep(1)
        reason = recover_reason()
        assert "held" in reason or "holds" in reason, reason
        figure(f"XID on a GPU a pod holds ({run}): 30 s, /healthz 200 throughout, no restart ({reason})")
    finally:
        kubectl("delete", "pod", "-n", "default", "gpu-holder", "--wait=true", check=False)
    t1 = time.monotonic()
    wait(
        "the plugin restarted once the pod is gone", lambda: restarts("device-plugin") == before + 1, 90, 0.5
    )
    wait(f"allocatable {RESOURCE}={DEVICES}", lambda: allocatable() == DEVICES, 90, 0.5)
    figure(
        f"XID on a GPU a pod holds ({run}): the pod deleted, allocatable restored "
        f"{time.monotonic() - t1:.1f} s later"
    )
    healthy_plugin()


def recover_reason() -> str:
    """The `recover:` check's reason, from the sidecar's /status."""
    checks = sidecar_status().get("checks", {})
    return str(checks.get(f"recover:{RESOURCE}", {}).get("reason", ""))
