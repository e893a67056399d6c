"""The DRA drivers' install route, as operators install: real Helm 3 and Helm 4 render the chart-shaped
fixtures of HAMi's and NVIDIA's DRA driver charts (tests/fixtures/hami-dra-chart, nvidia-dra-chart;
docs/deploy.md lists the facts they mirror) through the post-renderer (manifests/hami-patch, its
dra.yaml applied by kubectl kustomize); kubernetes-validate checks what comes out, and a real
hami-sidecar runs with the rendered settings, once against the kubelet's real plugin manager and DRA
manager (tests/realdra)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from testing.realdra import RealDraDriver, RealDraKubelet, Release
from tests.conftest import require_dra_fixture
from tests.test_manifests import (
    KUBERNETES_VERSIONS,
    MANIFESTS,
    PATCH,
    REGISTRY,
    ROOT,
    Obj,
    by_name,
    clean_env,
    doc_commands,
    docs,
    free_port,
    helm_home,
    http_get,
    http_status,
    key,
    run,
    tool,
    validate_files,
)

FIXTURES = ROOT / "tests" / "fixtures"
CHARTS = {"hami": FIXTURES / "hami-dra-chart", "nvidia": FIXTURES / "nvidia-dra-chart"}
# The charts want Kubernetes >= 1.34 (HAMi's) and >= 1.32 (NVIDIA's); a cluster gives Helm its version.
KUBE = ("--kube-version", "1.34.0")
GPUS = ("--set", "gpuResourcesEnabledOverride=true")  # NVIDIA's chart refuses GPUs without it
HAMI_DRIVER = "hami-core-gpu.project-hami.io"
NVIDIA_GPU, NVIDIA_CD = "gpu.nvidia.com", "compute-domain.nvidia.com"

# chart, release, namespace, values; the DaemonSet's name; {container: driver}; the kubelet's folder
CASES: dict[str, tuple[str, str, str, tuple[str, ...], str, dict[str, str], str]] = {
    "hami": ("hami", "hami-dra-driver", "hami-system", (), "hami-dra-driver-kubelet-plugin",
             {"gpus": HAMI_DRIVER}, "/var/lib/kubelet"),
    "hami-nameOverride": ("hami", "gpu", "gpu-operator", ("--set", "nameOverride=hdra"),
                          "hdra-kubelet-plugin", {"gpus": HAMI_DRIVER}, "/var/lib/kubelet"),
    "hami-k0s-paths": (
        "hami", "hami-dra-driver", "hami-system",
        ("--set", "kubeletPlugin.kubeletRegistrarDirectoryPath=/var/lib/k0s/kubelet/plugins_registry",
         "--set", "kubeletPlugin.kubeletPluginsDirectoryPath=/var/lib/k0s/kubelet/plugins"),
        "hami-dra-driver-kubelet-plugin", {"gpus": HAMI_DRIVER}, "/var/lib/k0s/kubelet",
    ),
    "hami-no-self-probe": ("hami", "hami-dra-driver", "hami-system",
                           ("--set", "kubeletPlugin.containers.gpus.healthcheckPort=-1"),
                           "hami-dra-driver-kubelet-plugin", {"gpus": HAMI_DRIVER}, "/var/lib/kubelet"),
    "nvidia": ("nvidia", "nvidia-dra-driver-gpu", "nvidia-dra-driver-gpu", GPUS,
               "nvidia-dra-driver-gpu-kubelet-plugin",
               {"compute-domains": NVIDIA_CD, "gpus": NVIDIA_GPU}, "/var/lib/kubelet"),
    "nvidia-nameOverride": ("nvidia", "dra", "gpu-operator", (*GPUS, "--set", "nameOverride=nvdra"),
                            "nvdra-kubelet-plugin",
                            {"compute-domains": NVIDIA_CD, "gpus": NVIDIA_GPU}, "/var/lib/kubelet"),
    "nvidia-gpus-only": ("nvidia", "nvidia-dra-driver-gpu", "nvidia-dra-driver-gpu",
                         (*GPUS, "--set", "resources.computeDomains.enabled=false"),
                         "nvidia-dra-driver-gpu-kubelet-plugin", {"gpus": NVIDIA_GPU}, "/var/lib/kubelet"),
    "nvidia-compute-domains-only": ("nvidia", "nvidia-dra-driver-gpu", "nvidia-dra-driver-gpu",
                                    ("--set", "resources.gpus.enabled=false"),
                                    "nvidia-dra-driver-gpu-kubelet-plugin", {"compute-domains": NVIDIA_CD},
                                    "/var/lib/kubelet"),
}  # fmt: skip

_renders: dict[tuple[str, str, bool], str] = {}


def render(which: str, case: str, *extra: str, patched: bool = True) -> list[Obj]:
    """`helm template` of a case (each render once per session: the tests only read it)."""
    chart, release, namespace, values, *_ = CASES[case]
    h = helm_home(which)
    cache = (which, case + " ".join(extra), patched)
    if cache not in _renders:
        args = ["template", release, str(CHARTS[chart]), "--namespace", namespace, *KUBE, *values, *extra]
        post = h.post_renderer if patched else []
        result = h(*args, *post)
        assert result.returncode == 0, result.stderr
        _renders[cache] = result.stdout
    return docs(_renders[cache])


def daemonset(objects: list[Obj]) -> Obj:
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    return ds


def without_guard(ds: Obj, chart_ds: Obj) -> Obj:
    """The DaemonSet less what hami-guard adds and changes: its sidecar and volume, hostPID, and the
    driver containers' probes (the chart's livenessProbe, replaced, comes back from the chart's)."""
    ds = copy.deepcopy(ds)
    pod = ds["spec"]["template"]["spec"]
    chart_containers = by_name(chart_ds["spec"]["template"]["spec"]["containers"])
    del pod["hostPID"]
    pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "hami-sidecar"]
    pod["containers"] = [c for c in pod["containers"] if c["name"] != "hami-sidecar"]
    pod["volumes"] = [v for v in pod["volumes"] if not v["name"].startswith("hami-guard-")]
    for c in pod["containers"]:
        c.pop("readinessProbe")
        c.pop("livenessProbe")
        if "livenessProbe" in chart_containers[c["name"]]:
            c["livenessProbe"] = chart_containers[c["name"]]["livenessProbe"]
    return ds


def sidecar_env(ds: Obj) -> dict[str, str]:
    pod = ds["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"] + pod["containers"])["hami-sidecar"]
    return {e["name"]: e["value"] for e in sidecar["env"]}


def probe_path(probe: Obj) -> str:
    """The path a driver container's probe asks the sidecar for (httpGet, or the exec command's GET)."""
    if "httpGet" in probe:
        return str(probe["httpGet"]["path"])
    found = re.search(r"GET (\S+) HTTP/1\.0", probe["exec"]["command"][-1])
    assert found, probe
    return found.group(1)


def check_patched(ds: Obj, drivers: dict[str, str], kubelet_dir: str) -> None:
    """The sidecar, its settings and the probes agree with the chart and with each other."""
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # the kubelet's connections are read from its /proc/<pid>/net/unix
    inits = by_name(pod["initContainers"])
    sidecar = inits["hami-sidecar"]
    assert list(inits)[-1] == "hami-sidecar"  # after the chart's init containers, before the drivers
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == f"{REGISTRY}/hami-sidecar:0.1.0"
    env = sidecar_env(ds)
    assert env["HAMI_GUARD_DRA_DRIVER"].split(",") == list(drivers.values())
    assert env["HAMI_GUARD_DRA_REGISTRY_DIR"] == f"{kubelet_dir}/plugins_registry"
    volumes = by_name(pod["volumes"])
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    for name in ("plugins-registry", "plugins"):  # the chart's folders, read-only, where the chart has them
        assert mounts[name]["readOnly"] is True
        assert mounts[name]["mountPath"] == volumes[name]["hostPath"]["path"]
    assert volumes["hami-guard-device-plugins"]["hostPath"]["path"] == f"{kubelet_dir}/device-plugins"
    assert mounts["hami-guard-device-plugins"]["mountPath"] == "/var/lib/kubelet/device-plugins"
    # Each driver container asks about its own driver only: one driver's failure restarts no other.
    containers = by_name(pod["containers"])
    for container, driver in drivers.items():
        c = containers[container]
        others = [d for n, d in drivers.items() if n != container]
        excluded = [f"exclude={k}:{d}" for d in others for k in ("dra-plugin", "dra-registered")]
        live, ready = probe_path(c["livenessProbe"]), probe_path(c["readinessProbe"])
        assert live == "/healthz" + ("?" + "&".join(excluded) if excluded else "")
        assert ready == "/readyz?" + "&".join(["exclude=kubelet", "exclude=checkpoint", *excluded])
        assert c["livenessProbe"]["exec"]["command"][:2] == ["bash", "-c"]
        assert driver not in live


@pytest.mark.parametrize("which", ["helm3", "helm4"])
@pytest.mark.parametrize("case", CASES)
def test_dra_render_carries_the_sidecar_and_leaves_the_charts_objects(which: str, case: str) -> None:
    *_, name, drivers, kubelet_dir = CASES[case]
    namespace = CASES[case][2]
    before = {key(o): o for o in render(which, case, patched=False)}
    after = {key(o): o for o in render(which, case)}
    assert set(after) == set(before)
    ds_key = ("DaemonSet", namespace, name)
    assert key(daemonset(list(after.values()))) == ds_key
    for k, o in before.items():
        assert (without_guard(after[k], o) if k == ds_key else after[k]) == o, k
    check_patched(after[ds_key], drivers, kubelet_dir)
    # The chart's startupProbe (its self-probe) stays: liveness starts once the driver serves.
    for c in before[ds_key]["spec"]["template"]["spec"]["containers"]:
        assert by_name(after[ds_key]["spec"]["template"]["spec"]["containers"])[c["name"]].get(
            "startupProbe"
        ) == c.get("startupProbe")


@pytest.mark.parametrize("case", CASES)
def test_dra_helm3_and_helm4_render_the_same(case: str) -> None:
    three, four = render("helm3", case), render("helm4", case)
    assert {key(o): o for o in three} == {key(o): o for o in four}
    assert len(three) == len(four)


def test_every_dra_render_validates_strictly(tmp_path: Path) -> None:
    """Every case, the sidecar as a container and the httpGet liveness too, against the schemas of the
    versions the charts install on (1.33 and 1.37 of test_manifests' three)."""
    paths, count = [], 0
    for case in CASES:
        objects = render("helm3", case)
        paths.append(tmp_path / f"{case}.yaml")
        paths[-1].write_text(yaml.safe_dump_all(objects))
        count += len(objects)
    rendered = yaml.safe_dump_all(render("helm3", "nvidia", patched=False))
    other = ["sidecar=container", "liveness=http", f"registry={REGISTRY}"]
    result = run([str(PATCH / "post-renderer.sh"), *other], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    ds = daemonset(docs(result.stdout))
    names = [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]
    assert names == ["compute-domains", "gpus", "hami-sidecar"]
    gpus = by_name(ds["spec"]["template"]["spec"]["containers"])["gpus"]
    assert gpus["livenessProbe"]["httpGet"]["path"].startswith("/healthz?exclude=dra-plugin:compute-domain")
    paths.append(tmp_path / "other-forms.yaml")
    paths[-1].write_text(result.stdout)
    validate_files(paths, count + len(docs(result.stdout)), KUBERNETES_VERSIONS[1:])


def test_the_dra_liveness_command_is_the_device_plugins_asking_its_own_path() -> None:
    """The driver containers run the device plugin's livenessProbe command (tests/test_manifests.py runs it
    against a sidecar that is down, silent, given a bad flag, 200, 500 and 503), only its path differs."""
    patch = yaml.safe_load((PATCH / "patch.yaml").read_text())
    device = by_name(patch["spec"]["template"]["spec"]["containers"])["device-plugin"]["livenessProbe"]
    pod = daemonset(render("helm3", "nvidia"))["spec"]["template"]["spec"]
    command = device.pop("exec")["command"]
    assert [c["name"] for c in pod["containers"]] == ["compute-domains", "gpus"]
    for c in pod["containers"]:
        live = copy.deepcopy(c["livenessProbe"])
        path = probe_path(live)
        assert path != "/healthz"
        assert live.pop("exec")["command"] == [*command[:-1], command[-1].replace("/healthz", path)]
        assert live == device


def test_a_dra_driver_named_by_a_setting_and_one_the_setting_does_not_find() -> None:
    """dra-driver=CONTAINER=DRIVER=SOCKET names a driver's registration socket (a driver with rolling
    updates names it after its pod) and wins over what the container runs; a container no DaemonSet
    has is a bad setting: exit 2, one line."""
    rendered = yaml.safe_dump_all(render("helm3", "hami", patched=False))
    socket = "hami-core-gpu.project-hami.io-reg.sock"
    args = [f"registry={REGISTRY}", f"dra-driver=gpus={HAMI_DRIVER}={socket}", "dra-grace=200", "tag=0.1.1"]
    args += ["probe-interval=5", "probe-timeout=1", "liveness-period=10", "liveness-failures=4"]
    result = run([str(PATCH / "post-renderer.sh"), *args], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    ds = daemonset(docs(result.stdout))
    env = sidecar_env(ds)
    assert env["HAMI_GUARD_DRA_DRIVER"] == f"{HAMI_DRIVER}={socket}"
    timing = ("HAMI_GUARD_DRA_GRACE", "HAMI_GUARD_PROBE_INTERVAL", "HAMI_GUARD_PROBE_TIMEOUT")
    assert [env[k] for k in timing] == ["200", "5", "1"]
    pod = ds["spec"]["template"]["spec"]
    assert by_name(pod["initContainers"])["hami-sidecar"]["image"] == f"{REGISTRY}/hami-sidecar:0.1.1"
    live = by_name(pod["containers"])["gpus"]["livenessProbe"]
    assert (live["periodSeconds"], live["failureThreshold"]) == (10, 4)
    bad = [f"registry={REGISTRY}", "dra-driver=gpu=gpu.nvidia.com"]
    result = run([str(PATCH / "post-renderer.sh"), *bad], input=rendered, env=clean_env())
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "no DaemonSet has a container named gpu" in line


def test_a_kubelet_plugin_of_an_unknown_driver_is_left_alone_and_named_it_is_patched() -> None:
    """A DaemonSet whose containers run no kubelet plugin the post-renderer knows is not patched (a
    guess would watch the wrong driver): with nothing else to patch, exit 1 with one line."""
    chart = daemonset(render("helm3", "hami", patched=False))
    chart["spec"]["template"]["spec"]["containers"][0]["args"] = ["example-kubelet-plugin -v 4"]
    rendered = yaml.safe_dump(chart)
    result = run([str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}"], input=rendered, env=clean_env())
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    named = [f"registry={REGISTRY}", "dra-driver=gpus=gpu.example.com"]
    result = run([str(PATCH / "post-renderer.sh"), *named], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert sidecar_env(daemonset(docs(result.stdout)))["HAMI_GUARD_DRA_DRIVER"] == "gpu.example.com"


def test_a_real_sidecar_takes_the_rendered_settings(tmp_path: Path) -> None:
    """hami-sidecar started with the rendered NVIDIA DaemonSet's environment (its folders moved under a
    temporary folder, nothing listening there): it accepts the settings (/sidecarz 200, no
    configuration error), judges the drivers the render names, every check a probe excludes is one it
    has, and, no driver having registered within the grace yet, each driver container's liveness
    command passes while its readiness path fails."""
    ds = daemonset(render("helm3", "nvidia"))
    env = {k: v for k, v in sidecar_env(ds).items()}
    registry, plugins = tmp_path / "plugins_registry", tmp_path / "device-plugins"
    registry.mkdir()
    plugins.mkdir()
    env["HAMI_GUARD_DRA_REGISTRY_DIR"] = str(registry)
    env["HAMI_GUARD_DEVICE_PLUGIN_DIR"] = str(plugins)
    env["HAMI_GUARD_POD_RESOURCES_SOCKET"] = str(tmp_path / "pod-resources.sock")
    port = free_port()
    env["HAMI_GUARD_LISTEN"] = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar"],
        env={**clean_env(), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and proc.poll() is None:
            try:
                if http_status(port, "/sidecarz") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert http_status(port, "/sidecarz") == 200  # the settings were taken, a round has run
        status = json.loads(http_get(port, "/status")[1])
        assert set(status["dra"]["drivers"]) == {NVIDIA_GPU, NVIDIA_CD}
        assert status["dra"]["grace"] == float(env["HAMI_GUARD_DRA_GRACE"])
        for driver in (NVIDIA_GPU, NVIDIA_CD):
            reg = status["dra"]["drivers"][driver]["registration_socket"]
            assert reg["path"] == f"{registry}/{driver}-reg.sock"  # the helper's name, in the chart's folder
        containers = by_name(ds["spec"]["template"]["spec"]["containers"])
        for name in ("gpus", "compute-domains"):
            c = containers[name]
            for probe in (c["livenessProbe"], c["readinessProbe"]):
                for excluded in re.findall(r"exclude=([^&]+)", probe_path(probe)):
                    assert http_status(port, f"/healthz/{excluded}") != 404, excluded
            command = c["livenessProbe"]["exec"]["command"][-1].replace("127.0.0.1/9395", f"127.0.0.1/{port}")
            assert run(["bash", "-c", command]).returncode == 0  # pending within the grace: no restart
            assert http_status(port, probe_path(c["readinessProbe"])) == 503  # not registered: not ready
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("release", ["new", "old"])
async def test_the_rendered_probes_against_the_kubelets_real_dra_manager(
    short_tmp: str, release: str
) -> None:
    """The rendered NVIDIA DaemonSet's sidecar settings and probes, with NVIDIA's two drivers on the
    kubelet plugin helper registered with the kubelet's real plugin manager and DRA manager
    (tests/realdra, v1.37.2 and v1.36.5; folders moved under a temporary folder, a 3 s grace and 0.5 s
    rounds).
    Both registered: each container's liveness command passes and its readiness path answers 200.
    The compute-domain driver crashes: its container's liveness command fails on the sidecar's 503,
    while the gpus container's passes and stays ready: one driver's failure restarts no other."""
    require_dra_fixture(release)

    rel: Release = "new" if release == "new" else "old"

    ds = daemonset(render("helm3", "nvidia"))
    registry, dp_dir = Path(short_tmp, "plugins_registry"), Path(short_tmp, "device-plugins")
    registry.mkdir()
    dp_dir.mkdir()
    port = free_port()
    env = {
        **sidecar_env(ds),
        "HAMI_GUARD_DRA_REGISTRY_DIR": str(registry),
        "HAMI_GUARD_DEVICE_PLUGIN_DIR": str(dp_dir),
        "HAMI_GUARD_POD_RESOURCES_SOCKET": str(Path(short_tmp, "pod-resources.sock")),
        "HAMI_GUARD_LISTEN": f"127.0.0.1:{port}",
        "HAMI_GUARD_DRA_GRACE": "3",
        "HAMI_GUARD_PROBE_INTERVAL": "0.5",
        "HAMI_GUARD_PROBE_TIMEOUT": "0.4",
    }
    kubelet = RealDraKubelet(str(registry), f"{short_tmp}/state", str(dp_dir / "kubelet.sock"), release=rel)
    drivers = {
        d: RealDraDriver(d, str(registry), f"{short_tmp}/plugins/{d}", release=rel)
        for d in (NVIDIA_GPU, NVIDIA_CD)
    }
    containers = by_name(ds["spec"]["template"]["spec"]["containers"])

    def probes(name: str) -> tuple[int, int]:
        """A container's liveness command's exit and its readiness path's status, as the kubelet runs them."""
        c = containers[name]
        command = c["livenessProbe"]["exec"]["command"][-1].replace("127.0.0.1/9395", f"127.0.0.1/{port}")
        try:
            ready = http_status(port, probe_path(c["readinessProbe"]))
        except OSError:  # not listening yet
            ready = 0
        return run(["bash", "-c", command]).returncode, ready

    async def until(name: str, want: tuple[int, int]) -> None:
        async with asyncio.timeout(30):
            while await asyncio.to_thread(probes, name) != want:
                await asyncio.sleep(0.2)

    proc = None
    try:
        for d in drivers.values():
            await d.start()
        await kubelet.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar",
            env={**clean_env(), **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        for name in ("gpus", "compute-domains"):
            await until(name, (0, 200))  # registered: alive and ready
        await drivers[NVIDIA_CD].crash()
        await until("compute-domains", (1, 503))  # its liveness fails: the kubelet would restart it
        assert await asyncio.to_thread(probes, "gpus") == (0, 200)  # the other driver's: untouched
    finally:
        if proc is not None:
            proc.kill()
            await proc.wait()
        for d in drivers.values():
            await d.close()
        await kubelet.close()


def test_checkov_finds_only_hostpid_added_to_the_dra_charts(tmp_path: Path) -> None:
    """One checkov run on both charts' renders, unpatched and patched: the patch adds exactly one finding
    to each chart's own, CKV_K8S_17 (hostPID, which the sidecar needs to read the kubelet's connections,
    docs/deploy.md), and clears CKV_K8S_9 (the drivers get a readinessProbe)."""
    paths = []
    for case in ("hami", "nvidia"):
        for patched in (False, True):
            paths.append(tmp_path / f"{case}-{'patched' if patched else 'chart'}.yaml")
            paths[-1].write_text(yaml.safe_dump_all(render("helm3", case, patched=patched)))
    result = run(
        [tool("checkov"), "--skip-download", "--framework", "kubernetes", "-o", "json"]
        + [a for p in paths for a in ("-f", str(p))],
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
        timeout=300,
    )
    report = json.loads(result.stdout)
    failed: dict[str, set[tuple[str, str]]] = {p.name: set() for p in paths}
    for r in report if isinstance(report, list) else [report]:
        for c in r["results"]["failed_checks"]:
            failed[Path(c["file_path"]).name].add((c["check_id"], c["resource"]))
    for case in ("hami", "nvidia"):
        theirs, ours = failed[f"{case}-chart.yaml"], failed[f"{case}-patched.yaml"]
        assert theirs  # privileged drivers fail checks: the comparison means something
        (added,) = ours - theirs
        (cleared,) = theirs - ours
        assert (added[0], cleared[0]) == ("CKV_K8S_17", "CKV_K8S_9"), (added, cleared)
        assert added[1] == cleared[1] and added[1].endswith("-kubelet-plugin")


# --- The DRA install lines of docs/deploy.md ----------------------------------------------------------


def test_deploy_doc_dra_install_lines_are_the_tested_ones() -> None:
    """Each `helm upgrade --install` line of docs/deploy.md's DRA section, run as `helm template` on the
    fixture of its chart (with the cluster's version, which an install takes from the cluster) gives a
    render the tests above check."""
    commands = doc_commands("docs/deploy.md", "DRA drivers")
    installs = [c for c in commands if c.startswith("helm upgrade --install")]
    charts = {
        "$HAMI_DRA/chart/hami-dra-driver": ("hami", {"gpus": HAMI_DRIVER}),
        "nvidia/nvidia-dra-driver-gpu": ("nvidia", {"compute-domains": NVIDIA_CD, "gpus": NVIDIA_GPU}),
    }
    assert len(installs) == 4, installs  # each chart with Helm 3 and with Helm 4
    seen = set()
    for line in installs:
        argv = shlex.split(line.replace("$REGISTRY", REGISTRY))
        which = "helm4" if argv[argv.index("--post-renderer") + 1] == "hami-guard" else "helm3"
        chart, drivers = charts[argv[4]]
        seen.add((which, chart))
        argv = [a.replace("./manifests/", str(MANIFESTS) + "/") for a in argv[3:]]
        argv[1] = str(CHARTS[chart])
        result = helm_home(which)("template", *argv, *KUBE)
        assert result.returncode == 0, result.stderr
        check_patched(daemonset(docs(result.stdout)), drivers, "/var/lib/kubelet")
    assert len(seen) == 4
    assert "helm repo add nvidia https://helm.ngc.nvidia.com/nvidia" in commands
