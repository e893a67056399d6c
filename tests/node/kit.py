"""What the node end-to-end tests (tests/node/e2e_*.py) share: kubectl, waiting, the plugin pod on the node
`node-e2e`, the stand-in's fault files, the kubelet's metrics and node-ctl. The tests run inside the node's
namespaces (tests/node/node.sh, `make node-e2e`); NODE_E2E_DIR is the run's folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sidecar.deviceplugin.probes import pod_resources_devices
from testing.standin import APPLIED, LASTING

RUN = os.environ.get("NODE_E2E_DIR", "")

HERE = Path(__file__).parent
NODE = "node-e2e"
NS = "kube-system"
RESOURCE = "nvidia.com/gpu"
DEVICES = "20"  # the stand-in's 2 GPUs, each split 10 times as HAMi advertises them
CONTROL = Path("/run/hami-standin")
PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/nvidia-gpu.sock")
KUBELET_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"
# NODE_E2E_RUNS: how many times each recovery scenario is measured (BENCHMARKS.md gives three).
RUNS = int(os.environ.get("NODE_E2E_RUNS", "1"))
SELECTOR = "app.kubernetes.io/component=hami-device-plugin"
SIDECAR_IMAGE = "registry.invalid/hami-sidecar:0.1.0"  # as manifests/hami-patch names it

T = TypeVar("T")


@dataclass(frozen=True)
class Plugin:
    """One device plugin's DaemonSet on the node, as the tests reach it: the resource it registers and
    how many devices, its pods' label, its stand-in's fault folder and its sidecar's port."""

    resource: str
    devices: str
    selector: str
    control: Path
    port: int
    namespace: str = NS


# HAMi's NVIDIA plugin (manifests/example-hami through tests/node/overlay): every test's default.
NVIDIA = Plugin(RESOURCE, DEVICES, SELECTOR, CONTROL, 9395)


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def get(kind: str, name: str = "", namespace: str = NS, selector: str = "", field: str = "") -> Any:
    args = ["get", kind, *([name] if name else []), "-n", namespace, "-o", "json"]
    if selector:
        args += ["-l", selector]
    if field:
        args += ["--field-selector", field]
    return json.loads(kubectl(*args))


def wait(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """Polls until `check` returns something other than None or False (an assertion in it: not yet)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except (AssertionError, KeyError, IndexError) as e:  # not there yet (a pod being replaced)
            last = e
        else:
            if value is not None and value is not False:
                return value
            last = value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def node_resources(node: str = NODE, plugin: Plugin = NVIDIA) -> tuple[str, str]:
    status = get("node", node, "")["status"]
    return status["capacity"].get(plugin.resource, ""), status["allocatable"].get(plugin.resource, "")


def allocatable(node: str = NODE, plugin: Plugin = NVIDIA) -> str:
    return node_resources(node, plugin)[1]


def kubelet_devices(plugin: Plugin = NVIDIA) -> int:
    """How many healthy devices of the resource the kubelet itself lists now (pod-resources
    `GetAllocatableResources`): registration, seen before the Node's status carries it (the kubelet
    posts its status every nodeStatusUpdateFrequency, 10 s)."""
    reading = asyncio.run(pod_resources_devices(POD_RESOURCES, 2))
    return len((reading.value or {}).get(plugin.resource, ()))


def plugin_pod(node: str = NODE, plugin: Plugin = NVIDIA) -> dict[str, Any]:
    """The plugin's pod on `node` (one, not being deleted)."""
    pods = [
        p
        for p in get(
            "pods", namespace=plugin.namespace, selector=plugin.selector, field=f"spec.nodeName={node}"
        )["items"]
        if not p["metadata"].get("deletionTimestamp")
    ]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod: dict[str, Any] = pods[0]
    return pod


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for s in pod["status"].get("containerStatuses", []) + pod["status"].get("initContainerStatuses", []):
        if s["name"] == name:
            return dict(s)
    return {}


def restarts(name: str, plugin: Plugin = NVIDIA) -> int:
    return int(container_status(plugin_pod(plugin=plugin), name).get("restartCount", 0))


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def healthz(path: str = "/healthz", plugin: Plugin = NVIDIA) -> int:
    """The sidecar's answer, asked directly (as the kubelet's prober does, on the pod's IP)."""
    ip = plugin_pod(plugin=plugin)["status"].get("podIP", "")
    try:
        with urllib.request.urlopen(f"http://{ip}:{plugin.port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def sidecar_status(timeout: float = 2, plugin: Plugin = NVIDIA) -> dict[str, Any]:
    """The sidecar's /status document (OSError or ValueError when it cannot be read)."""
    ip = plugin_pod(plugin=plugin)["status"].get("podIP", "")
    with urllib.request.urlopen(f"http://{ip}:{plugin.port}/status", timeout=timeout) as r:
        doc: dict[str, Any] = json.load(r)
    return doc


def status_reason(plugin: Plugin = NVIDIA) -> str:
    """Why the sidecar fails liveness, from its /status (the failed checks' reasons)."""
    try:
        checks = sidecar_status(plugin=plugin).get("checks", {})
    except (OSError, ValueError):
        return "no /status"
    return "; ".join(f"{k}: {c.get('reason')}" for k, c in checks.items() if c.get("fails_liveness"))


def gpu_pod(name: str, devices: str, code: str) -> dict[str, Any]:
    """A Pod in `default` asking for `devices` of the resource, running `code` in the sidecar's image's
    Python."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "work",
                    "image": SIDECAR_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/opt/hami-guard/bin/python", "-c", code],
                    "resources": {"limits": {RESOURCE: devices}},
                }
            ],
        },
    }


def events(pod: str, namespace: str = NS) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get("events", namespace=namespace)["items"]
    return [e for e in items if e["involvedObject"].get("name") == pod]


def node_ctl(command: str, timeout: float = 120) -> None:
    subprocess.run([os.path.join(RUN, "node-ctl"), command], check=True, timeout=timeout)


def figure(line: str) -> None:
    with open(os.path.join(RUN, "figures.txt"), "a") as f:
        f.write(line + "\n")


def kubelet_metric(text: str, name: str, **labels: str) -> float:
    """Sum of the kubelet's samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def probe_metrics(node: str = NODE) -> str:
    return kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/probes")


def set_fault(name: str, on: bool, plugin: Plugin = NVIDIA) -> None:
    plugin.control.mkdir(exist_ok=True)
    path = plugin.control / name
    if on:
        path.touch()
    else:
        path.unlink(missing_ok=True)


def fault_applied(timeout: float = 15, plugin: Plugin = NVIDIA) -> None:
    """Waits until the running stand-in has applied the lasting fault files now in the folder (it reads
    them twice a second and says so in APPLIED): before a kubelet restart whose new kubelet.sock it must
    meet with them, or the restart can beat its next read."""
    control = plugin.control
    want = ",".join(sorted(p.name for p in control.iterdir() if p.name in LASTING))

    def applied() -> bool:
        try:
            said = (control / APPLIED).read_text()
        except OSError as e:
            raise AssertionError(f"no {APPLIED}: {e}") from e  # wait's last reading, on a timeout
        assert said == want, f"{APPLIED} says [{said}]"
        return True

    wait(f"the stand-in applying the faults [{want}]", applied, timeout, 0.1)


def healthy_plugin(timeout: float = 180, plugin: Plugin = NVIDIA) -> dict[str, Any]:
    """Waits for the plugin pod Ready and the node's allocatable back at the stand-in's devices."""

    def ready_pod() -> dict[str, Any] | None:
        pod = plugin_pod(plugin=plugin)
        return pod if ready(pod) else None

    pod = wait(f"the {plugin.resource} plugin pod Ready", ready_pod, timeout)
    wait(
        f"allocatable {plugin.resource}={plugin.devices}",
        lambda: allocatable(plugin=plugin) == plugin.devices,
        timeout,
    )
    return pod


def restored_after(
    fault: str,
    inflict: Callable[[], None],
    *,
    restart: bool = True,
    timeout: float = 180,
    plugin: Plugin = NVIDIA,
) -> None:
    """Inflicts a fault on a healthy node and times, from it: the sidecar's 503, the devices lost, the
    kubelet's restart of the plugin container for its failed liveness probe, the kubelet listing every
    device again (pod-resources: registered) and the Node's allocatable back (the kubelet posts its
    status every 10 s). `restart` False: a fault the plugin mends by itself, which must see no 503 and
    no restart.

    Measured repeatedly (NODE_E2E_RUNS above 1), each fault meets a plugin pod of its own, as a first
    failure does: the kubelet delays each restart of a container that restarted minutes before
    (CrashLoopBackOff, from 10 s doubling), which would measure the runs before. And it comes at a
    random moment of the kubelet's 10 s status cadence: right after a status post (the moment
    allocatable is seen back) it would always wait the longest."""
    if RUNS > 1:
        fresh_plugin_pod(plugin)
    else:
        healthy_plugin(plugin=plugin)
    time.sleep(random.uniform(0, 10))
    pod = plugin_pod(plugin=plugin)
    name = pod["metadata"]["name"]
    before = restarts("device-plugin", plugin)
    t0 = time.monotonic()
    inflict()
    # Each event's first time, polled together.
    seen: dict[str, float] = {}
    reason = ""
    want = {"lost", "registered", "back"} | ({"503", "restart"} if restart else set())

    def progress() -> bool:
        nonlocal reason
        now = time.monotonic() - t0
        if "503" not in seen and healthz(plugin=plugin) == 503:
            seen["503"] = now
            reason = status_reason(plugin)
            assert restart, f"{fault}: /healthz 503 ({reason}) for a fault the plugin mends by itself"
        devices = kubelet_devices(plugin)
        if "lost" not in seen and devices != int(plugin.devices):
            seen["lost"] = now
        if "restart" not in seen and restarts("device-plugin", plugin) > before:
            seen["restart"] = now
            assert restart, f"{fault}: the plugin restarted, which it mends by itself"
        after = "lost" in seen and (not restart or "restart" in seen)
        if after and "registered" not in seen and devices == int(plugin.devices):
            seen["registered"] = now
        if "registered" in seen and "back" not in seen and allocatable(plugin=plugin) == plugin.devices:
            seen["back"] = now
        return set(seen) >= want

    wait(f"{fault}: {', '.join(sorted(want))}", progress, timeout, 0.2)
    if not restart:
        assert restarts("device-plugin", plugin) == before
        figure(
            f"{fault}: no 503, no restart; the kubelet's devices lost at {seen['lost']:.1f} s, listed "
            f"again (registered) at {seen['registered']:.1f} s, allocatable restored {seen['back']:.1f} s "
            "after the fault"
        )
        healthy_plugin(plugin=plugin)
        return
    assert seen["503"] <= seen["restart"] <= seen["registered"] <= seen["back"], seen
    killing = [
        e["message"]
        for e in events(name, plugin.namespace)
        if e["reason"] == "Killing" and "device-plugin" in e["message"] and "liveness" in e["message"]
    ]
    assert killing, [(e["reason"], e["message"]) for e in events(name, plugin.namespace)]
    assert restarts("device-plugin", plugin) == before + 1
    assert restarts("hami-sidecar", plugin) == 0
    figure(
        f"{fault}: /healthz 503 after {seen['503']:.1f} s ({reason}), the kubelet's devices lost at "
        f"{seen['lost']:.1f} s, device-plugin restarted by the kubelet at {seen['restart']:.1f} s "
        f"({killing[0]}), registered again at {seen['registered']:.1f} s, allocatable restored "
        f"{seen['back']:.1f} s after the fault"
    )
    healthy_plugin(plugin=plugin)


def replaced(old: str, timeout: float = 180, plugin: Plugin = NVIDIA) -> dict[str, Any]:
    """Waits for the DaemonSet's pod that replaces the pod `old`, its plugin running; returns it."""

    def new_and_running() -> dict[str, Any] | None:
        pod = plugin_pod(plugin=plugin)
        running = container_status(pod, "device-plugin").get("state", {}).get("running")
        return pod if pod["metadata"]["name"] != old and running else None

    return wait("the DaemonSet's new pod running", new_and_running, timeout, 0.5)


def fresh_plugin_pod(plugin: Plugin = NVIDIA) -> None:
    """Replaces the plugin pod (the DaemonSet makes a new one) and waits for it healthy."""
    old = healthy_plugin(plugin=plugin)["metadata"]["name"]
    kubectl("delete", "pod", "-n", plugin.namespace, old, "--wait=true")
    replaced(old, 120, plugin)
    healthy_plugin(240, plugin)


def sidecar_usage(label: str, plugin: Plugin = NVIDIA) -> None:
    """The plugin pod's sidecar's CPU over 30 s and its RSS, read from /proc (this namespace sees every
    pod's processes); the sidecar told by its port (HAMI_GUARD_LISTEN; NVIDIA's: the default)."""
    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _is_sidecar_of(p, plugin)]
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
        f"{label}: hami-sidecar in the {plugin.resource} pod: {share * 100:.2f} % of a core over 30 s, "
        f"{rss / 1024:.1f} MiB RSS"
    )


def cmdline(p: Path) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_sidecar_of(p: Path, plugin: Plugin) -> bool:
    try:
        environ = p.joinpath("environ").read_bytes().split(b"\0")
    except OSError:
        return False
    if not cmdline(p).startswith("/opt/hami-guard/bin/python /opt/hami-guard/bin/hami-sidecar"):
        return False
    listen = [e for e in environ if e.startswith(b"HAMI_GUARD_LISTEN=")]
    if plugin.port == NVIDIA.port and not listen:
        return True
    return listen == [f"HAMI_GUARD_LISTEN=0.0.0.0:{plugin.port}".encode()]
