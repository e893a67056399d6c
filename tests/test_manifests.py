"""manifests/ and the Dockerfiles, installed as operators do: real Helm 3 and Helm 4 (built by `make
helm-binaries` from their Go modules) render the chart-shaped fixture of HAMi's device plugin
(tests/fixtures/hami-chart, docs/deploy.md) with the post-renderer; kubectl kustomize builds the
component route; kubernetes-validate, promtool and checkov check what comes out."""

from __future__ import annotations

import atexit
import copy
import functools
import http.client
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from bench.stress import MEMORY_LIMIT_MIB
from hami_guard.flags import AUTO_DEVICES, Expect
from hami_guard.profiles import DEFAULT, named
from manifests.monitoring import vendors as monitoring_vendors
from sidecar.config import parse_settings
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
PATCH = MANIFESTS / "hami-patch"
CHART = ROOT / "tests" / "fixtures" / "hami-chart"
TOOLS = ROOT / ".venv-tools" / "bin"
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0", "1.37.0")  # native sidecars on from 1.29; the newest
CRD_KINDS = {"PodMonitor", "PrometheusRule"}  # not in the Kubernetes schemas; promtool checks the rules
RUNBOOK = "docs/runbook.md"  # every alert's runbook_url base: manifests/monitoring/runbook.yaml's default
INSTALL = "Install on a cluster"  # the README's section with the install lines
REGISTRY = "registry.example.org/platform"  # as manifests/example-hami has it (example.org is reserved)
GUARD = ("hami-initcheck", "hami-sidecar")
Obj = dict[str, Any]


def makefile_var(name: str) -> str:
    found = re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, name
    return found.group(1)


HELM = {"helm3": makefile_var("HELM3_VERSION"), "helm4": makefile_var("HELM4_VERSION")}


def tool(name: str) -> str:
    local = TOOLS / name
    return str(local) if local.exists() else require_tool(name)


def helm_binary(which: str) -> str:
    """tests/helm/bin/helm-<version> (`make helm-binaries`): a skip where missing, a failure in CI."""
    path = ROOT / "tests" / "helm" / "bin" / f"helm-{HELM[which]}"
    if not path.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path.name} is required in CI (make helm-binaries)")
        pytest.skip(f"{path.name} not built (make helm-binaries)")
    return str(path)


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", 120)
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kw)


def docs(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def kustomize(folder: Path) -> list[Obj]:
    return docs(kustomized(folder))


@functools.cache
def kustomized(folder: Path) -> str:
    """`kubectl kustomize` of a folder, once per session (the tests only read it)."""
    result = run([require_tool("kubectl"), "kustomize", str(folder)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def kustomizations() -> list[Path]:
    found = []
    for k in sorted(MANIFESTS.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(k.parent)
    return found


def by_name(items: list[Obj] | None) -> dict[str, Obj]:
    return {i["name"]: i for i in items or []}


def key(o: Obj) -> tuple[str, str, str]:
    return (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])


def validate(objects: list[Obj], where: Path) -> None:
    """kubernetes-validate --strict against every version: each object passes."""
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    path = where / "objects.yaml"
    path.write_text(yaml.safe_dump_all(core))
    for version in KUBERNETES_VERSIONS:
        result = run([tool("kubernetes-validate"), "--strict", "--no-warn", "-k", version, str(path)])
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed for resource") == len(core)


# --- Helm: the fixture chart rendered as operators render HAMi's ------------------------------------


class Helm:
    """One Helm binary with its own (temporary) home: hermetic, the plugin installed for Helm 4."""

    def __init__(self, which: str, home: Path) -> None:
        self.which, self.binary = which, helm_binary(which)
        self.renders: dict[tuple[str, str, tuple[str, ...], bool], str] = {}
        home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            **{f"HELM_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")},
        }
        # Plugins in $HELM_DATA_HOME/plugins, Helm's default (Helm 4.3.2's `plugin install` writes
        # there even when HELM_PLUGINS names another folder, which `plugin list` then reads).
        self.env.pop("HELM_PLUGINS", None)
        self.env.pop("KUBECONFIG", None)
        for name in list(self.env):
            if name.startswith("HAMI_GUARD_"):
                del self.env[name]
        if which == "helm4":
            # The README's line: installs the plugin from the repository (a link to the folder).
            done = self("plugin", "install", str(PATCH))
            assert done.returncode == 0, done.stdout + done.stderr

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run([self.binary, *args], env=self.env, cwd=ROOT)

    @property
    def post_renderer(self) -> list[str]:
        target = "hami-guard" if self.which == "helm4" else str(PATCH / "post-renderer.sh")
        return ["--post-renderer", target, "--post-renderer-args", f"registry={REGISTRY}"]

    def template(self, release: str, namespace: str, *values: str, patched: bool = True) -> list[Obj]:
        """`helm template` of the fixture (each render once per session: the tests only read it)."""
        key = (release, namespace, values, patched)
        if key not in self.renders:
            args = ["template", release, str(CHART), "--namespace", namespace, *values]
            result = self(*args, *(self.post_renderer if patched else []))
            assert result.returncode == 0, result.stderr
            self.renders[key] = result.stdout
        return docs(self.renders[key])


@functools.cache
def helm_home(which: str) -> Helm:
    """One Helm home a binary for the session, removed when the tests end."""

    home = Path(tempfile.mkdtemp(prefix=f"hami-guard-{which}-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return Helm(which, home)


@pytest.fixture(params=["helm3", "helm4"])
def helm(request: pytest.FixtureRequest) -> Helm:
    return helm_home(request.param)


# release, namespace, values; the DaemonSet's name; the resource and socket the sidecar must watch
CASES: dict[str, tuple[str, str, tuple[str, ...], str, str]] = {
    "hami": ("hami", "kube-system", (), "hami-device-plugin", "nvidia.com/gpu=nvidia-gpu.sock"),
    "gpu": ("gpu", "kube-system", (), "gpu-hami-device-plugin", "nvidia.com/gpu=nvidia-gpu.sock"),
    "my-hami": ("my-hami", "kube-system", (), "my-hami-device-plugin", "nvidia.com/gpu=nvidia-gpu.sock"),
    "fullnameOverride": (
        "gpu",
        "kube-system",
        ("--set", "fullnameOverride=vgpu"),
        "vgpu-device-plugin",
        "nvidia.com/gpu=nvidia-gpu.sock",
    ),
    "namespace": ("hami", "gpu-operator", (), "hami-device-plugin", "nvidia.com/gpu=nvidia-gpu.sock"),
    "imageRegistry": (
        "hami",
        "kube-system",
        ("--set", "global.imageRegistry=mirror.example.org"),
        "hami-device-plugin",
        "nvidia.com/gpu=nvidia-gpu.sock",
    ),
    "resourceName": (
        "hami",
        "kube-system",
        ("--set", "resourceName=nvidia.com/vgpu"),
        "hami-device-plugin",
        "nvidia.com/vgpu=nvidia-vgpu.sock",
    ),
    "hostNetwork": (
        "hami",
        "kube-system",
        ("--set", "devicePlugin.hostNetwork=true"),
        "hami-device-plugin",
        "nvidia.com/gpu=nvidia-gpu.sock",
    ),
    "pluginPath": (
        "hami",
        "kube-system",
        ("--set", "devicePlugin.pluginPath=/var/lib/k0s/kubelet/device-plugins"),
        "hami-device-plugin",
        "nvidia.com/gpu=nvidia-gpu.sock",
    ),
}


def without_guard(ds: Obj, plugin: str = "device-plugin") -> Obj:
    """The DaemonSet less what hami-guard adds: its containers and volumes, the plugin's probes."""
    ds = copy.deepcopy(ds)
    pod = ds["spec"]["template"]["spec"]
    for field in ("initContainers", "containers"):
        kept = [c for c in pod.get(field, []) if c["name"] not in GUARD]
        if kept:
            pod[field] = kept
        else:
            pod.pop(field, None)
    pod["volumes"] = [v for v in pod["volumes"] if not v["name"].startswith("hami-guard-")]
    for c in pod["containers"]:
        if c["name"] == plugin:
            c.pop("livenessProbe")
            c.pop("readinessProbe")
    return ds


def sidecar_settings(sidecar: Obj) -> Any:
    """What the real hami-sidecar makes of the sidecar container's variables (parse_settings)."""
    env = {e["name"]: e["value"] for e in sidecar["env"] if isinstance(e.get("value"), str)}
    return parse_settings([], environ=env)


def check_patched(ds: Obj, plugin: str, registry: str = REGISTRY) -> None:
    """The sidecar, the init container and the probes are there and agree with the chart."""
    pod = ds["spec"]["template"]["spec"]
    init = by_name(pod["initContainers"])
    sidecar = init["hami-sidecar"]
    assert list(init)[-2:] == ["hami-initcheck", "hami-sidecar"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: started, and probed, first
    assert sidecar["startupProbe"]["tcpSocket"]["port"] == 9395  # listening: the plugin may start
    assert init["hami-initcheck"]["image"] == f"{registry}/hami-initcheck:0.1.0"
    assert sidecar["image"] == f"{registry}/hami-sidecar:0.1.0"
    read = sidecar_settings(sidecar)
    assert [f"{p.resource}={p.socket}" for p in read.plugins] == [plugin]
    assert read.expect_devices == AUTO_DEVICES and read.device_glob == "/host/dev/nvidia[0-9]*"
    assert read.hami_config == "/config/config.json"
    assert (read.vendor, read.port) == ("nvidia", 9395)
    plugin_container = by_name(pod["containers"])["device-plugin"]
    assert plugin_container["livenessProbe"]["exec"]["command"][:2] == ["bash", "-c"]
    # The rollout gate, whatever the resource: serving and registration only.
    assert plugin_container["readinessProbe"]["httpGet"]["path"] == (
        "/readyz?exclude=kubelet&exclude=checkpoint&exclude=devices&exclude=hami&exclude=recover"
    )
    # Every mount of hami-guard's containers names a volume of the pod (the validator does not check).
    volumes = by_name(pod["volumes"])
    for c in init.values():
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, (c["name"], m["name"])
            if c["name"] in GUARD:
                assert m["readOnly"] is True
    # The kubelet's folders follow HAMi's devicePlugin.pluginPath.
    plugin_dir = volumes["device-plugin"]["hostPath"]["path"].rstrip("/")
    assert volumes["hami-guard-device-plugins"]["hostPath"]["path"].rstrip("/") == plugin_dir
    pod_resources = volumes["hami-guard-pod-resources"]["hostPath"]["path"]
    assert pod_resources == plugin_dir.rsplit("/", 1)[0] + "/pod-resources"


@pytest.mark.parametrize("case", CASES)
def test_helm_render_carries_the_sidecar_and_leaves_hamis_objects_untouched(helm: Helm, case: str) -> None:
    release, namespace, values, name, plugin = CASES[case]
    before = {key(o): o for o in helm.template(release, namespace, *values, patched=False)}
    after = {key(o): o for o in helm.template(release, namespace, *values)}
    assert set(after) == set(before)
    (ds_key,) = [k for k in after if k[0] == "DaemonSet"]
    assert ds_key == ("DaemonSet", namespace, name)
    for k, o in before.items():
        assert (without_guard(after[k]) if k == ds_key else after[k]) == o, k
    check_patched(after[ds_key], plugin)


@pytest.mark.parametrize("case", CASES)
def test_helm3_and_helm4_render_the_same(case: str) -> None:
    release, namespace, values, _, _ = CASES[case]
    three = helm_home("helm3").template(release, namespace, *values)
    four = helm_home("helm4").template(release, namespace, *values)
    assert {key(o): o for o in three} == {key(o): o for o in four}  # the same objects (Helm 4 orders them)
    assert len(three) == len(four)


def test_every_render_validates_strictly(tmp_path: Path) -> None:
    """Every case's patched render, and the kustomize route, against each schema (one run per version)."""
    paths, count = [], 0
    for case, (release, namespace, values, _, _) in CASES.items():
        objects = helm_home("helm3").template(release, namespace, *values)
        paths.append(tmp_path / f"{case}.yaml")
        paths[-1].write_text(yaml.safe_dump_all(objects))
        count += len(objects)
    # The other forms: the sidecar as a container (before 1.29), the httpGet liveness.
    rendered = (MANIFESTS / "example-hami" / "hami.yaml").read_text()
    other = ["sidecar=container", "liveness=http", f"registry={REGISTRY}"]
    result = run([str(PATCH / "post-renderer.sh"), *other], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    paths.append(tmp_path / "other-forms.yaml")
    paths[-1].write_text(result.stdout)
    validate_files(paths, count + len(docs(result.stdout)))


def validate_files(paths: list[Path], count: int, versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> None:
    """kubernetes-validate --strict on files holding `count` objects, against each version in one run."""
    for version in versions:
        result = run([tool("kubernetes-validate"), "--strict", "--no-warn", "-k", version, *map(str, paths)])
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed for resource") == count


def test_a_render_the_patch_does_not_match_fails_with_one_line(helm: Helm) -> None:
    args = ["template", "hami", str(CHART), "-n", "kube-system", "--set", "devicePlugin.enabled=false"]
    result = helm(*args, *helm.post_renderer)
    assert result.returncode != 0
    if helm.which == "helm3":
        assert "no DaemonSet labelled app.kubernetes.io/component=hami-device-plugin" in result.stderr
    else:  # Helm 4.3 drops a post-renderer plugin's stderr (docs/deploy.md): only that it failed
        assert 'plugin "hami-guard" exited with error' in result.stderr
    # The post-renderer alone: exit 1, one line.
    unpatched = helm(*args)
    assert unpatched.returncode == 0
    alone = run([str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}"], input=unpatched.stdout)
    assert alone.returncode == 1
    assert alone.stdout == ""
    assert len(alone.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "set the registry"),
        (["registry=Bad Registry"], "registry='Bad Registry' is not valid"),
        ([f"registry={REGISTRY}", "expect-devices=many"], "expect-devices='many' is not valid"),
        ([f"registry={REGISTRY}", "colour=blue"], "unknown setting 'colour=blue'"),
        (
            [f"registry={REGISTRY}", "recover-unhealthy-after=10 min"],
            "recover-unhealthy-after='10 min' is not valid",
        ),
        (
            [f"registry={REGISTRY}", "recover-unhealthy-after=-1m"],
            "recover-unhealthy-after='-1m' is not valid",
        ),
        # Above the sidecar's own bound, which it would refuse (not ready, judging nothing).
        (
            [f"registry={REGISTRY}", "recover-unhealthy-after=31d"],
            "recover-unhealthy-after='31d' is not valid",
        ),
    ],
)
def test_a_bad_setting_fails_with_one_line(args: list[str], message: str) -> None:
    rendered = (MANIFESTS / "example-hami" / "hami.yaml").read_text()
    result = run([str(PATCH / "post-renderer.sh"), *args], input=rendered, env=clean_env())
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert message in line


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_GUARD_")}
    return {**env, **extra}


def test_every_setting_reaches_the_sidecar_and_the_probes() -> None:
    rendered = (MANIFESTS / "example-hami" / "hami.yaml").read_text()
    args = [
        "plugin=example.com/gpu=example-gpu.sock",
        "expect-devices=4",
        "device-glob=/host/dev/accel[0-9]*",
        "registration-grace=60",
        "probe-interval=5",
        "probe-timeout=1",
        "liveness-period=10",
        "liveness-failures=4",
        "tag=0.1.1",
        "recover-unhealthy-after=10m",
    ]
    # An argument wins over the environment; the environment sets what the arguments do not.
    env = clean_env(HAMI_GUARD_REGISTRY=REGISTRY, HAMI_GUARD_EXPECT_DEVICES="2")
    result = run([str(PATCH / "post-renderer.sh"), *args], input=rendered, env=env)
    assert result.returncode == 0, result.stderr
    (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"])["hami-sidecar"]
    env_of = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env_of["HAMI_GUARD_PLUGIN"] == "example.com/gpu=example-gpu.sock"
    assert env_of["HAMI_GUARD_EXPECT_DEVICES"] == "4"
    assert env_of["HAMI_GUARD_DEVICE_GLOB"] == "/host/dev/accel[0-9]*"
    assert env_of["HAMI_GUARD_REGISTRATION_GRACE"] == "60"
    assert env_of["HAMI_GUARD_PROBE_INTERVAL"] == "5"
    assert env_of["HAMI_GUARD_PROBE_TIMEOUT"] == "1"
    assert env_of["HAMI_GUARD_RECOVER_UNHEALTHY_AFTER"] == "10m"
    read = sidecar_settings(sidecar)
    assert (read.plugins, read.device_glob) == (
        (("example.com/gpu", "example-gpu.sock"),),
        "/host/dev/accel[0-9]*",
    )
    assert sidecar["image"] == f"{REGISTRY}/hami-sidecar:0.1.1"
    live = by_name(pod["containers"])["device-plugin"]["livenessProbe"]
    assert (live["periodSeconds"], live["failureThreshold"]) == (10, 4)

    # sidecar=container (before Kubernetes 1.29), liveness=http, expect-devices=none.
    more = ["sidecar=container", "liveness=http", "expect-devices=none", f"registry={REGISTRY}"]
    result = run([str(PATCH / "post-renderer.sh"), *more], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert "hami-sidecar" not in by_name(pod["initContainers"])
    sidecar = by_name(pod["containers"])["hami-sidecar"]
    assert "restartPolicy" not in sidecar
    assert {e["name"]: e.get("value") for e in sidecar["env"]}["HAMI_GUARD_EXPECT_DEVICES"] == "0"
    assert sidecar_settings(sidecar).expect_devices.kind is Expect.OFF
    live = by_name(pod["containers"])["device-plugin"]["livenessProbe"]
    assert live["httpGet"] == {"path": "/healthz", "port": 9395}
    assert "exec" not in live


def post_rendered(*args: str, **env: str) -> Obj:
    """The example chart's DaemonSet through the post-renderer, with the registry and `args`."""
    rendered = (MANIFESTS / "example-hami" / "hami.yaml").read_text()
    argv = [str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}", *args]
    result = run(argv, input=rendered, env=clean_env(**env))
    assert result.returncode == 0, result.stderr
    (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
    return ds


def sidecar_env(ds: Obj) -> dict[str, Any]:
    sidecar = by_name(ds["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]
    return {e["name"]: e.get("value") for e in sidecar["env"]}


@pytest.mark.parametrize(
    ("value", "seconds"), [("90", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("30d", 2592000.0)]
)
def test_recover_unhealthy_after_reaches_the_sidecar_and_nothing_else_changes(
    value: str, seconds: float
) -> None:
    """The setting adds HAMI_GUARD_RECOVER_UNHEALTHY_AFTER to the sidecar, which reads it as that
    duration; the rest of the render is the default's (the probes already leave `recover:` to liveness)."""
    on = post_rendered(f"recover-unhealthy-after={value}")
    env = sidecar_env(on)
    assert env["HAMI_GUARD_RECOVER_UNHEALTHY_AFTER"] == value
    read = parse_settings([], environ={"HAMI_GUARD_RECOVER_UNHEALTHY_AFTER": value})
    assert read.recover_unhealthy_after == seconds
    sidecar = by_name(on["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]
    sidecar["env"] = [e for e in sidecar["env"] if e["name"] != "HAMI_GUARD_RECOVER_UNHEALTHY_AFTER"]
    assert on == post_rendered()


def test_recover_unhealthy_after_is_off_by_default_and_at_zero() -> None:
    """Off, the sidecar's default, adds nothing; the environment sets it too, and an argument wins."""
    default = post_rendered()
    assert "HAMI_GUARD_RECOVER_UNHEALTHY_AFTER" not in sidecar_env(default)
    for off in ("0", "0s", "0.0m"):
        assert post_rendered(f"recover-unhealthy-after={off}") == default
    from_env = post_rendered(HAMI_GUARD_RECOVER_UNHEALTHY_AFTER="15m")
    assert sidecar_env(from_env)["HAMI_GUARD_RECOVER_UNHEALTHY_AFTER"] == "15m"
    assert post_rendered("recover-unhealthy-after=0", HAMI_GUARD_RECOVER_UNHEALTHY_AFTER="15m") == default


def test_every_post_renderer_setting_is_documented() -> None:
    """Each key the post-renderer takes is in docs/deploy.md's table of settings."""
    result = run([str(PATCH / "post-renderer.sh"), "no-such-setting=1"], input="", env=clean_env())
    assert result.returncode == 2
    keys = result.stderr.strip().split("KEY one of ", 1)[1].split(", ")
    assert "recover-unhealthy-after" in keys
    table = doc_section("docs/deploy.md", "Settings")
    for key in keys:
        assert f"`{key}`" in table, key


def test_an_upgrade_render_carries_the_patch_only_with_the_post_renderer(helm: Helm) -> None:
    """Helm keeps no post-renderer with a release: `helm upgrade` without it drops hami-guard. The
    README's upgrade line passes it again; a render of the upgraded chart (new values) keeps it."""
    upgraded = ("--set", "global.imageTag=v2.10.1", "--set", "devicePlugin.deviceSplitCount=5")
    with_it = helm.template("hami", "kube-system", *upgraded)
    (ds,) = [o for o in with_it if o["kind"] == "DaemonSet"]
    check_patched(ds, "nvidia.com/gpu=nvidia-gpu.sock")
    images = {c["image"] for c in ds["spec"]["template"]["spec"]["containers"]}
    assert "docker.io/projecthami/hami:v2.10.1" in images
    without = helm.template("hami", "kube-system", *upgraded, patched=False)
    assert "hami-sidecar" not in yaml.safe_dump_all(without)


# --- Every vendor's device-plugin DaemonSet ----------------------------------------------------------------
# Chart-shaped fixtures of the vendors' own charts and manifests (tests/fixtures, docs/deploy.md lists the
# facts they mirror): HAMi's Ascend and AMD plugins ship charts, its Hygon DCU and Biren plugins manifests.
FIXTURES = ROOT / "tests" / "fixtures"
ASCEND_910B3 = "huawei.com/Ascend910B3=Ascend910B3.sock"
ONE_CHIP = (
    "--set-json",
    'vnpus=[{"chipName":"310P3","commonWord":"Ascend310P","resourceName":"huawei.com/Ascend310P"}]',
)


class Vendor(NamedTuple):
    chart: str
    release: str
    namespace: str
    values: tuple[str, ...]
    args: tuple[str, ...]  # more post-renderer settings
    daemonset: tuple[str, str]  # its namespace and name
    container: str  # the plugin's
    vendor: str
    plugin: str  # what the sidecar watches
    port: int  # the sidecar's
    glob: str  # "": no devices counted (at least one healthy device)


VENDORS: dict[str, Vendor] = {
    "ascend": Vendor(
        "ascend-chart",
        "npu",
        "kube-system",
        (),
        (f"plugin={ASCEND_910B3}",),
        ("kube-system", "hami-ascend-device-plugin"),
        "device-plugin",
        "ascend",
        ASCEND_910B3,
        9396,
        "",
    ),
    "ascend-one-chip": Vendor(
        "ascend-chart",
        "npu",
        "npu-system",
        ONE_CHIP,
        (),
        ("npu-system", "hami-ascend-device-plugin"),
        "device-plugin",
        "ascend",
        "huawei.com/Ascend310P=Ascend310P.sock",
        9396,
        "",
    ),
    "amd": Vendor(
        "amd-chart",
        "amd",
        "kube-system",
        (),
        (),
        ("kube-system", "amd-gpu-device-plugin-daemonset"),
        "amd-gpu-dp-cntr",
        "amd",
        "amd.com/gpu=amd.com_gpu",
        9395,
        "/host/dev/dri/renderD[0-9]*",
    ),
    "dcu": Vendor(
        "dcu-chart",
        "dcu",
        "kube-system",
        (),
        (),
        ("kube-system", "dcu-device-plugin-daemonset"),
        "dcu-dp-cntr",
        "dcu",
        "hygon.com/dcunum=hygon.com_dcunum",
        9395,
        "/host/dev/dri/renderD[0-9]*",
    ),
    "biren": Vendor(
        "biren-chart",
        "biren",
        "kube-system",
        (),
        (),
        ("biren-gpu", "biren-device-plugin-daemonset"),
        "k8s-device-plugin",
        "biren",
        "birentech.com/gpu=birentech.com_gpu",
        9395,
        "/host/dev/biren/card_[0-9]*",
    ),
}


@functools.cache
def vendor_render(which: str, case: str, patched: bool = True, extra: tuple[str, ...] = ()) -> str:
    """`helm template` of a vendor's fixture, through the post-renderer (once per session)."""
    v, h = VENDORS[case], helm_home(which)
    more = [a for arg in (*v.args, *extra) for a in ("--post-renderer-args", arg)]
    args = ["template", v.release, str(FIXTURES / v.chart), "--namespace", v.namespace, *v.values]
    result = h(*args, *((*h.post_renderer, *more) if patched else ()))
    assert result.returncode == 0, result.stderr
    return result.stdout


def the_daemonset(objects: list[Obj], case: str) -> Obj:
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    assert (ds["metadata"]["namespace"], ds["metadata"]["name"]) == VENDORS[case].daemonset
    return ds


def pod_ports(pod: Obj) -> list[int]:
    """Every port the pod's containers declare (one network namespace: none may repeat)."""
    return [
        p["containerPort"]
        for c in pod["containers"] + pod.get("initContainers", [])
        for p in c.get("ports", [])
    ]


@pytest.mark.parametrize("case", VENDORS)
def test_each_vendors_chart_carries_the_sidecar_for_that_vendor(helm: Helm, case: str) -> None:
    """Each vendor's DaemonSet, found by its label (or its pods'), gets the sidecar and the init check, and
    its plugin's container the probes, on a port no container of the pod has; the sidecar, as it reads its
    variables, watches that vendor's resource and socket, counts its device nodes where the profile names
    them, and reads the kubelet's folders the plugin mounts. Nothing else of the chart changes."""
    v = VENDORS[case]
    before = {key(o): o for o in docs(vendor_render(helm.which, case, patched=False))}
    after = {key(o): o for o in docs(vendor_render(helm.which, case))}
    assert set(after) == set(before)
    ds = the_daemonset(list(after.values()), case)
    for k, o in before.items():
        assert (without_guard(after[k], v.container) if k == key(ds) else after[k]) == o, k
    pod = ds["spec"]["template"]["spec"]
    init = by_name(pod["initContainers"])
    assert list(init)[-2:] == ["hami-initcheck", "hami-sidecar"]
    sidecar = init["hami-sidecar"]
    read = sidecar_settings(sidecar)
    assert read.vendor == v.vendor
    assert [f"{p.resource}={p.socket}" for p in read.plugins] == [v.plugin]
    assert (read.device_glob, read.expect_devices.kind) == (v.glob, Expect.AUTO if v.glob else Expect.ANY)
    assert read.hami_config == ""  # HAMi's node configuration is the NVIDIA plugin's alone
    # The ports: the sidecar's is no other container's, and every probe asks it there.
    ports = pod_ports(pod)
    assert len(ports) == len(set(ports)), ports
    assert (read.port, sidecar["ports"][0]["containerPort"]) == (v.port, v.port)
    assert sidecar["startupProbe"]["tcpSocket"]["port"] == v.port
    assert {sidecar[p]["httpGet"]["port"] for p in ("readinessProbe", "livenessProbe")} == {v.port}
    plugin = by_name(pod["containers"])[v.container]
    assert plugin["readinessProbe"]["httpGet"] == {
        "path": "/readyz?exclude=kubelet&exclude=checkpoint&exclude=devices&exclude=hami&exclude=recover",
        "port": v.port,
    }
    command = plugin["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["bash", "-c"] and f"/dev/tcp/127.0.0.1/{v.port} " in command[2]
    # The kubelet's folders: the plugin's device-plugins folder, pod-resources beside it (the sidecar reads
    # it where the pod has no hostPID), the host's /dev under /host/dev; every mount names a volume.
    volumes = by_name(pod["volumes"])
    assert volumes["hami-guard-device-plugins"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert volumes["hami-guard-pod-resources"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert set(mounts) == {"hami-guard-device-plugins", "hami-guard-pod-resources", "hami-guard-host-dev"}
    assert mounts["hami-guard-pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    assert read.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    for c in init.values():
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), c["name"]


@pytest.mark.parametrize("case", VENDORS)
def test_each_vendors_render_is_the_same_with_helm3_and_helm4(case: str) -> None:
    three = {key(o): o for o in docs(vendor_render("helm3", case))}
    four = {key(o): o for o in docs(vendor_render("helm4", case))}
    assert three == four


def test_every_vendors_render_validates_strictly(tmp_path: Path) -> None:
    paths, count = [], 0
    for case in VENDORS:
        objects = docs(vendor_render("helm3", case))
        paths.append(tmp_path / f"{case}.yaml")
        paths[-1].write_text(yaml.safe_dump_all(objects))
        count += len(objects)
    validate_files(paths, count)


def test_a_chart_of_several_ascend_chips_gives_the_sidecar_its_candidates(helm: Helm) -> None:
    """Each node's Ascend plugin registers its own chip's resource: with several in the chart's device
    config and no plugin=, the sidecar is given them all as candidates and learns which one its node's
    plugin serves (sidecar/deviceplugin/candidates.py); the render is plugin='s (the case ascend) but for
    that variable. With one entry, that one (ascend-one-chip). A pod with hostNetwork, where the sidecar
    cannot tell, is refused in one line, naming plugin=."""
    v = VENDORS["ascend"]
    args = ["template", v.release, str(FIXTURES / v.chart), "--namespace", v.namespace]
    result = helm(*args, *helm.post_renderer)
    assert result.returncode == 0, result.stderr
    ds = the_daemonset(docs(result.stdout), "ascend")
    sidecar = by_name(ds["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert "HAMI_GUARD_PLUGIN" not in env
    both = "huawei.com/Ascend910B3=Ascend910B3.sock,huawei.com/Ascend310P=Ascend310P.sock"
    assert env["HAMI_GUARD_PLUGIN_CANDIDATES"] == both
    read = sidecar_settings(sidecar)
    assert read.plugins == ()
    assert [f"{p.resource}={p.socket}" for p in read.plugin_candidates] == both.split(",")
    assert (read.vendor, read.port) == ("ascend", v.port)
    named = the_daemonset(docs(vendor_render(helm.which, "ascend")), "ascend")
    for e in by_name(named["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]["env"]:
        if e["name"] == "HAMI_GUARD_PLUGIN":
            e.update(name="HAMI_GUARD_PLUGIN_CANDIDATES", value=both)
    assert unordered(ds) == unordered(named)
    # hostNetwork: every process of the node listens in the pod's network namespace.
    chart = helm(*args).stdout
    assert chart.count("      priorityClassName:") == 1
    chart = chart.replace("      priorityClassName:", "      hostNetwork: true\n      priorityClassName:")
    alone = run([str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}"], input=chart, env=clean_env())
    assert alone.returncode == 1 and alone.stdout == ""
    assert alone.stderr.count("\n") == 1
    assert (
        "huawei.com/Ascend910B3, huawei.com/Ascend310P): with hostNetwork, the sidecar cannot tell"
        in alone.stderr
    )
    assert "set plugin=RESOURCE=SOCKET" in alone.stderr


@pytest.mark.parametrize("case", ["amd", "dcu", "biren", "ascend-one-chip"])
def test_each_vendors_component_equals_the_post_renderer(case: str, tmp_path: Path) -> None:
    """The kustomize route for a vendor: its component (manifests/hami-patch/vendors/<vendor>) on the chart's
    render, with the images set, gives what the post-renderer gives. Ascend's sidecar also needs the
    node's resource, one env patch (its component leaves it to the operator)."""
    v = VENDORS[case]
    (tmp_path / "chart.yaml").write_text(vendor_render("helm3", case, patched=False))
    folder = os.path.relpath(PATCH / "vendors" / v.vendor, tmp_path)
    kustomization: Obj = {
        "resources": ["chart.yaml"],
        "components": [folder],
        "images": [
            {"name": f"registry.invalid/{name}", "newName": f"{REGISTRY}/{name}"}
            for name in ("hami-sidecar", "hami-initcheck")
        ],
    }
    if v.vendor == "ascend":
        plugin = {"name": "HAMI_GUARD_PLUGIN", "value": v.plugin}
        env_patch = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": v.daemonset[1], "namespace": v.daemonset[0]},
            "spec": {"template": {"spec": {"initContainers": [{"name": "hami-sidecar", "env": [plugin]}]}}},
        }
        (tmp_path / "plugin.yaml").write_text(yaml.safe_dump(env_patch))
        kustomization["patches"] = [{"path": "plugin.yaml"}]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    component = {key(o): unordered(o) for o in kustomize(tmp_path)}
    post = {key(o): unordered(o) for o in docs(vendor_render("helm3", case))}
    assert component == post
    # Every variable of the component's sidecar is one the sidecar takes (Ascend's too: no `auto`).
    ds = the_daemonset(kustomize(tmp_path), case)
    read = sidecar_settings(by_name(ds["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"])
    assert read.vendor == v.vendor and read.port == v.port


def unordered(o: Obj) -> Obj:
    """An object with its pod's init containers and their variables by name (an operator's own patch of
    the sidecar's env, as for Ascend's resource, moves them in the list; their order does not matter)."""
    o = copy.deepcopy(o)
    pod = (o.get("spec") or {}).get("template", {}).get("spec")
    if pod and "initContainers" in pod:
        pod["initContainers"] = {c["name"]: c for c in pod["initContainers"]}
        for c in pod["initContainers"].values():
            c["env"] = {e["name"]: e for e in c.get("env", [])}
    return o


def test_selector_container_and_port_reach_a_vendor_without_a_profile() -> None:
    """A vendor without a profile works with explicit settings: its DaemonSet by selector=, its resource
    by plugin=, the sidecar on port=; no vendor is set, and no device nodes are counted unless
    device-glob= names them."""
    chart = vendor_render("helm3", "biren", patched=False).replace(
        "name: biren-device-plugin\n", "name: acme\n"
    )
    argv = [
        str(PATCH / "post-renderer.sh"),
        f"registry={REGISTRY}",
        "selector=name=acme",
        "plugin=acme.example/xpu=acme.sock",
        "port=9500",
    ]
    result = run(argv, input=chart, env=clean_env())
    assert result.returncode == 0, result.stderr
    (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"])["hami-sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert "HAMI_GUARD_VENDOR" not in env and "HAMI_GUARD_EXPECT_DEVICES" not in env
    read = sidecar_settings(sidecar)
    assert (read.plugins, read.port) == ((("acme.example/xpu", "acme.sock"),), 9500)
    # The plugin's container is the one serving in the kubelet's folder.
    assert by_name(pod["containers"])["k8s-device-plugin"]["readinessProbe"]["httpGet"]["port"] == 9500
    # Without plugin=: refused, one line.
    refused = run(argv[:-2], input=chart, env=clean_env())
    assert refused.returncode == 1 and "a vendor without a profile: set plugin=" in refused.stderr


def test_components_for_a_label_of_ones_own(tmp_path: Path) -> None:
    """`render.py components DIR vendor=... selector=...`: one component, for a DaemonSet relabelled."""
    argv = [
        sys.executable,
        str(PATCH / "render.py"),
        "components",
        str(tmp_path),
        "vendor=dcu",
        "selector=app=dcu",
    ]
    result = run(argv, env=clean_env())
    assert result.returncode == 0, result.stderr
    component = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert component["patches"] == [
        {"path": "patch.yaml", "target": {"kind": "DaemonSet", "labelSelector": "app=dcu"}}
    ]
    patch = yaml.safe_load((tmp_path / "patch.yaml").read_text())
    assert patch["spec"]["template"]["spec"]["containers"][0]["name"] == "dcu-dp-cntr"
    bad = run([*argv[:4], "selector=app=x"], env=clean_env())
    assert bad.returncode == 2 and "name one" in bad.stderr


# --- The kustomize route, the examples, the README ---------------------------------------------------


def test_every_kustomization_is_found() -> None:
    names = {str(p.relative_to(MANIFESTS)) for p in kustomizations()}
    policies = {f"network-policy/vendors/{v}" for v in ("amd", "ascend", "biren")}  # DCU's: none
    assert names == {"example-hami", "network-policy", "monitoring", "npd", *policies}


@pytest.mark.parametrize("folder", kustomizations(), ids=lambda p: p.name)
def test_kustomization_builds_and_validates_strictly(folder: Path, tmp_path: Path) -> None:
    objects = kustomize(folder)
    assert objects
    if [o for o in objects if o["kind"] not in CRD_KINDS]:
        validate(objects, tmp_path)
    # No namespace is written into hami-guard's own objects: they go where HAMi runs.
    if folder.name != "example-hami":
        assert all("namespace" not in o["metadata"] for o in objects), folder.name


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The validator really is strict: the same DaemonSet with one unknown field fails."""
    (ds,) = [o for o in kustomize(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(ds))
    result = run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[-1], str(path)])
    assert result.returncode != 0
    assert "periodSecond" in result.stdout + result.stderr


def test_the_example_is_the_fixture_rendered() -> None:
    """example-hami/hami.yaml is `make manifests`' render of the fixture chart (release hami)."""
    rendered = helm_home("helm3").template("hami", "kube-system", "--kube-version", "1.33.0", patched=False)
    assert docs((MANIFESTS / "example-hami" / "hami.yaml").read_text()) == rendered


def test_kustomize_route_equals_the_post_renderer() -> None:
    """The README's kustomize route (the component and an images entry) gives what the post-renderer gives
    with the same registry and the chart's defaults."""
    component = {key(o): o for o in kustomize(MANIFESTS / "example-hami")}
    rendered = (MANIFESTS / "example-hami" / "hami.yaml").read_text()
    result = run([str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}"], input=rendered, env=clean_env())
    assert result.returncode == 0, result.stderr
    post = {key(o): o for o in docs(result.stdout)}
    assert component == post
    (ds,) = [o for o in post.values() if o["kind"] == "DaemonSet"]
    check_patched(ds, "nvidia.com/gpu=nvidia-gpu.sock")


def doc_section(doc: str, title: str) -> str:
    """The `## title` section of a Markdown file of the repository (README.md, docs/deploy.md), up to
    the next `## ` heading: a missing heading fails, so a moved section is never silently untested."""
    text = (ROOT / doc).read_text()
    assert f"\n## {title}\n" in text, f"{doc} has no section '## {title}'"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def doc_commands(doc: str, title: str) -> list[str]:
    """The shell lines of a section's code blocks (continuations joined)."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", doc_section(doc, title), re.DOTALL):
        for raw in block.replace("\\\n", " ").splitlines():
            line = raw.strip()
            if line and not line.startswith("#"):
                lines.append(re.sub(r"\s+", " ", line))
    return lines


def test_readme_install_lines_are_the_tested_ones(tmp_path: Path) -> None:
    """Each `helm upgrade --install` line of the README's install section, run as `helm template` on the
    fixture with the registry filled in, gives the render the tests check; `helm plugin install` is the
    line Helm uses."""
    commands = doc_commands("README.md", INSTALL)
    installs = [c for c in commands if c.startswith("helm upgrade --install")]
    assert len(installs) == 2, installs  # Helm 3 (the script) and Helm 4 (the plugin)
    assert "helm plugin install ./manifests/hami-patch" in commands
    assert any(c.startswith("helm repo add hami-charts ") for c in commands)
    for line in installs:
        argv = shlex.split(line.replace("$REGISTRY", REGISTRY))
        which = "helm4" if "hami-guard" in argv[argv.index("--post-renderer") + 1] else "helm3"
        h = helm_home(which)
        argv = [a.replace("./manifests/", str(MANIFESTS) + "/") for a in argv[3:]]
        argv = [str(CHART) if a == "hami-charts/hami" else a for a in argv]
        result = h("template", *argv)
        assert result.returncode == 0, result.stderr
        (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
        check_patched(ds, "nvidia.com/gpu=nvidia-gpu.sock")
        # The README's check: `grep -c 'name: hami-sidecar'` on the release's manifest says 1.
        assert sum("name: hami-sidecar" in line for line in result.stdout.splitlines()) == 1
    # The kustomize route's template line renders what example-hami holds.
    (line,) = [c for c in commands if c.startswith("helm template hami hami-charts/hami")]
    argv = shlex.split(line.split(">", 1)[0])
    argv = [str(CHART) if a == "hami-charts/hami" else a for a in argv[2:]]
    result = helm_home("helm3")("template", *argv)
    assert result.returncode == 0, result.stderr
    assert docs(result.stdout) == docs((MANIFESTS / "example-hami" / "hami.yaml").read_text())


# --- The plugin's probes against a real sidecar, or none -------------------------------------------


def plugin_probes() -> tuple[str, str]:
    (ds,) = [o for o in kustomize(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    plugin = by_name(ds["spec"]["template"]["spec"]["containers"])["device-plugin"]
    return plugin["livenessProbe"]["exec"]["command"][2], plugin["readinessProbe"]["httpGet"]["path"]


def liveness(port: int) -> tuple[int, str, float]:
    """The plugin's livenessProbe command, run as the kubelet's exec prober runs it, against a port."""
    command = plugin_probes()[0]
    assert "127.0.0.1/9395" in command
    start = time.monotonic()
    result = run(["bash", "-c", command.replace("127.0.0.1/9395", f"127.0.0.1/{port}")])
    return result.returncode, result.stdout, time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def answering() -> Iterator[tuple[int, list[int]]]:
    """An HTTP server on loopback answering /healthz with the status at the head of the list."""
    statuses = [200]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(statuses[0])
            self.end_headers()
            self.wfile.write(b"[-]plugin:nvidia.com/gpu failed\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], statuses
    server.shutdown()
    server.server_close()


def test_liveness_fails_on_the_sidecars_503_only(answering: tuple[int, list[int]]) -> None:
    """The kubelet's exec prober: exit 0 is success, anything else failure (pkg/probe/exec). A 503
    fails, a 200 passes; a 500 (not the sidecar's verdict) passes."""
    port, statuses = answering
    assert liveness(port)[:2] == (0, "")
    statuses[0] = 503
    code, out, _ = liveness(port)
    assert code == 1
    assert "503" in out
    statuses[0] = 500
    assert liveness(port)[0] == 0


def test_a_sidecar_not_serving_never_fails_the_plugins_liveness() -> None:
    """Nothing listening (a crashed, OOM-killed or not yet pulled sidecar; a bad flag that exits): every
    probe of a whole failure window passes. A listener that never answers: passes, within the probe's
    timeout (the kubelet counts an exec probe past timeoutSeconds as a failure)."""
    (ds,) = [o for o in kustomize(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    live = by_name(ds["spec"]["template"]["spec"]["containers"])["device-plugin"]["livenessProbe"]
    port = free_port()
    for _ in range(live["failureThreshold"]):
        assert liveness(port)[0] == 0
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        code, _, took = liveness(silent.getsockname()[1])
    assert code == 0
    assert took < live["timeoutSeconds"]


def test_a_sidecar_with_a_bad_flag_never_fails_the_plugins_liveness() -> None:
    """The real sidecar started with a bad flag: whatever it does with it (exit, or serve /healthz 200
    with the reason in /readyz), the plugin's liveness command passes all through a failure window."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "--listen", f"127.0.0.1:{port}", "--probe-interval", "nonsense"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:  # serving the refusal, or gone
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        (ds,) = [o for o in kustomize(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
        live = by_name(ds["spec"]["template"]["spec"]["containers"])["device-plugin"]["livenessProbe"]
        for _ in range(live["failureThreshold"] * 2):
            assert liveness(port)[0] == 0
            time.sleep(0.2)
        # The sidecar's own probes: NotReady with the reason, never a liveness failure that would
        # restart it into CrashLoopBackOff for a setting a restart cannot mend.
        guard = by_name(ds["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]
        assert http_status(port, guard["livenessProbe"]["httpGet"]["path"]) == 200
        assert http_status(port, guard["readinessProbe"]["httpGet"]["path"]) == 503
    finally:
        proc.kill()
        proc.wait()


def http_status(port: int, path: str) -> int:
    return http_get(port, path)[0]


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


GATE_SCRIPT = """
import asyncio, json, os, socket, sys, tempfile, aiohttp
from sidecar.config import DeviceExpectation, Settings
from sidecar.cli import serve
from testing import FakeKubelet, FakeDevicePlugin
READY = sys.argv[1]
async def get(port, path):
    async with aiohttp.ClientSession() as c, c.get(f'http://127.0.0.1:{port}{path}') as r:
        return r.status
async def phase(register):
    d = tempfile.mkdtemp(prefix='hg-'); dp = d + '/dp'; os.mkdir(dp)
    s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()
    st = Settings(device_plugin_dir=dp, pod_resources_socket=d + '/pr.sock', host='127.0.0.1', port=port,
                  expect_devices=DeviceExpectation.at_least(8), device_glob=d + '/nvidia[0-9]*',
                  probe_interval=1, probe_timeout=0.5, registration_grace=30)
    stop = asyncio.Event()
    async with FakeKubelet(dp, d + '/pr.sock', dial_timeout=1) as k, FakeDevicePlugin(dp) as p:
        p.register_enabled = register
        t = asyncio.ensure_future(serve(st, stop))
        await asyncio.sleep(0.5); await k.restart()
        loop = asyncio.get_running_loop(); end = loop.time() + 30
        while loop.time() < end:  # registered (or, unregistering, the sidecar's rounds have run)
            await asyncio.sleep(0.2)
            try:
                if await get(port, READY if register else '/sidecarz') == 200:
                    break
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(1.5)  # a few more probe rounds: the answers below are settled
        out = {'readyz': await get(port, '/readyz'), 'gate': await get(port, READY),
               'healthz': await get(port, '/healthz')}
        stop.set(); await t
        return out
async def main():
    print(json.dumps({'registered': await phase(True), 'unregistered': await phase(False)}))
asyncio.run(main())
"""


def test_the_rollout_gate_waits_for_registration_not_for_gpus_or_the_kubelet() -> None:
    """The plugin's readinessProbe path on a real sidecar: with the plugin registered but fewer GPUs than
    expected, /readyz fails and the gate passes (a dead GPU must not stall every later rollout); with a
    plugin that has not registered, the gate fails (what a rollback would mend)."""
    gate = plugin_probes()[1]
    result = run([sys.executable, "-c", GATE_SCRIPT, gate], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["registered"] == {"readyz": 503, "gate": 200, "healthz": 200}, seen
    assert seen["unregistered"]["gate"] == 503, seen
    assert seen["unregistered"]["healthz"] == 200, seen  # within the grace: nothing restarts


def rule_groups(tmp_path: Path) -> Path:
    doc = yaml.safe_load((MANIFESTS / "monitoring" / "prometheusrule.yaml").read_text())
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(doc["spec"]))
    return path


def shipped_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MANIFESTS / "monitoring" / "prometheusrule.yaml").read_text())
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def doc_anchors(doc: str) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (outside code blocks), and its explicit
    <a id="...">s."""
    text = (ROOT / doc).read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.DOTALL), re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    result = subprocess.run(
        [require_tool("promtool"), "check", "rules", str(rule_groups(tmp_path))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(shipped_rules())} rules found" in result.stdout
    # 17 written by hand, and the cluster rule of each vendor whose chart selects its nodes by a label.
    assert len(shipped_rules()) == 17 + len(monitoring_vendors.watched()) == 22


def test_every_alert_names_its_node_and_links_its_fix_in_the_runbook() -> None:
    """summary, description and a runbook_url into a section of docs/runbook.md; `node` in every
    aggregation."""
    anchors = doc_anchors(RUNBOOK)
    alerts = [r for r in shipped_rules() if "alert" in r]
    assert alerts
    for rule in alerts:
        notes = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(notes), rule["alert"]
        assert "$labels.node" in notes["summary"], rule["alert"]
        url, _, anchor = notes["runbook_url"].partition("#")
        assert url == RUNBOOK, rule["alert"]
        # A per-check link (HamiDevicePluginCheckFailing, HamiDRADriverCheckFailing) names every check the
        # rule can report: those its expression selects, less the kubelet check that silences it.
        reported = {c for m in re.findall(r'check=~?"([^"]+)"', rule["expr"]) for c in m.split("|")}
        wanted = (
            [anchor.replace("{{ $labels.check }}", c) for c in sorted(reported - {"kubelet"})]
            if "{{" in anchor
            else [anchor]
        )
        for a in wanted:
            assert a in anchors, f"{rule['alert']}: {RUNBOOK} has no #{a}"
        assert rule["labels"]["severity"] in {"warning", "critical"}
    for rule in shipped_rules():
        for by in re.findall(r"\bby \(([^)]*)\)", rule["expr"]):
            assert "node" in [label.strip() for label in by.split(",")], (
                rule.get("alert", rule.get("record")),
                by,
            )


def doc_links(path: Path) -> Iterator[tuple[str, Path, str]]:
    """Every reference into a Markdown file of the repository that `path` holds: Markdown links in the
    docs; in comments and manifests a path of docs/ or README.md with its anchor (a template such as
    `#check-{{ $labels.check }}` aside). Each as (as written, the file it names, the anchor or "")."""
    text = path.read_text()
    if path.suffix == ".md":
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        found = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    else:
        found = re.findall(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md(?:#[\w-]+)?)(?![\w{-])", text)
    for target in found:
        name, _, anchor = target.partition("#")
        if not name:
            yield target, path, anchor
            continue
        near, top = path.parent / name, ROOT / name  # relative to the file, else to the repository
        yield target, near if near.exists() else top, anchor


def test_every_link_into_the_docs_resolves() -> None:
    """Every link of README.md, BENCHMARKS.md and docs/, and every reference to a section of them in the
    code, the tests and the manifests, names a file that exists and a section it has: a section moved
    out of the README, or renamed, leaves no reference behind."""
    sources = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    kinds = {".py", ".yaml", ".proto", ".sh"}
    for folder in ("hami_guard", "initcheck", "sidecar", "doctor", "testing", "tests", "manifests", "bench"):
        sources += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in kinds]
    sources += [ROOT / "Makefile", ROOT / ".ci" / "run"]
    broken = []
    for source in sources:
        for target, doc, anchor in doc_links(source):
            where = source.relative_to(ROOT)
            if not doc.exists():
                broken.append(f"{where}: {target}: no such file")
            elif anchor and doc.suffix == ".md" and anchor not in doc_anchors(str(doc.relative_to(ROOT))):
                broken.append(f"{where}: {target}: no such section")
    assert broken == []


def test_the_runbook_base_is_one_setting_that_reaches_every_alert(tmp_path: Path) -> None:
    """kubectl kustomize of manifests/monitoring: runbook.yaml's base starts every alert's runbook_url (and
    is left out of the output); set to another base, every runbook_url follows, its section unchanged."""
    shipped = kustomize(MANIFESTS / "monitoring")
    assert "hami-guard-runbook" not in {o["metadata"]["name"] for o in shipped}  # local-config: not applied

    def urls(objects: list[Obj]) -> list[str]:
        (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
        rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
        return [r["annotations"]["runbook_url"] for r in rules if "alert" in r]

    alerts = [r for r in shipped_rules() if "alert" in r]
    assert urls(shipped) == [r["annotations"]["runbook_url"] for r in alerts]
    assert all(u.startswith(f"{RUNBOOK}#") for u in urls(shipped))
    copy_ = tmp_path / "monitoring"
    shutil.copytree(MANIFESTS / "monitoring", copy_)
    base = "https://git.example.org/platform/hami-guard/-/blob/main/docs/runbook.md"  # example.org: reserved
    runbook = yaml.safe_load((copy_ / "runbook.yaml").read_text())
    runbook["data"]["base"] = base
    (copy_ / "runbook.yaml").write_text(yaml.safe_dump(runbook))
    result = run([require_tool("kubectl"), "kustomize", str(copy_)])
    assert result.returncode == 0, result.stderr
    changed = urls(docs(result.stdout))
    assert len(changed) == len(alerts) == len(urls(shipped))
    for before, after in zip(urls(shipped), changed, strict=True):
        assert after == base + "#" + before.split("#", 1)[1]


def test_promtool_unit_tests_fire_and_stay_silent(tmp_path: Path) -> None:
    rule_groups(tmp_path)
    shutil.copy(MANIFESTS / "monitoring" / "tests" / "rules-test.yaml", tmp_path)
    result = subprocess.run(
        [require_tool("promtool"), "test", "rules", str(tmp_path / "rules-test.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load((tmp_path / "rules-test.yaml").read_text())["tests"]
    cases = [a for t in tests for a in t.get("alert_rule_test", [])]
    for name in {r["alert"] for r in shipped_rules() if "alert" in r}:
        mine = [a for a in cases if a["alertname"] == name]
        fired = [e for a in mine for e in a["exp_alerts"]]
        assert fired, f"{name}: no test where it fires"
        assert all(e["exp_labels"].get("node") for e in fired), f"{name}: an alert without its node"
        assert any(a["exp_alerts"] == [] for a in mine), f"{name}: no test where it stays silent"
        assert all("runbook_url" in e["exp_annotations"] for e in fired), name
    recorded = {t["expr"] for t in tests for t in t.get("promql_expr_test", [])}
    for rule in shipped_rules():
        if "record" in rule:
            assert any(rule["record"] in expr for expr in recorded), f"{rule['record']}: no value test"


def test_checkov_passes_on_hami_guards_objects_and_adds_nothing_to_the_charts(tmp_path: Path) -> None:
    """One checkov run: hami-guard's own objects (in a namespace, as `kubectl apply -n` puts them) and its
    Dockerfiles fail nothing; the patched render of the chart fails exactly what the chart alone fails."""
    files = []
    for folder in kustomizations():
        if folder.name == "example-hami":
            continue
        objects = kustomize(folder)
        for o in objects:
            o["metadata"].setdefault("namespace", "hami-system")
        files.append(tmp_path / f"{folder.name}.yaml")
        files[-1].write_text(yaml.safe_dump_all(objects))
    h = helm_home("helm3")
    (tmp_path / "chart.yaml").write_text(yaml.safe_dump_all(h.template("hami", "kube-system", patched=False)))
    (tmp_path / "patched.yaml").write_text(yaml.safe_dump_all(h.template("hami", "kube-system")))
    dockerfiles = [ROOT / f"Dockerfile.{n}" for n in ("init", "sidecar", "npd")]
    paths = [*files, tmp_path / "chart.yaml", tmp_path / "patched.yaml", *dockerfiles]
    result = run(
        [
            tool("checkov"),
            "--skip-download",
            "--framework",
            "kubernetes",
            "dockerfile",
            "-o",
            "json",
            *[a for p in paths for a in ("-f", str(p))],
        ],
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
        timeout=300,
    )
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    failed: dict[str, set[tuple[str, str]]] = {}
    passed = 0
    for r in reports:
        passed += len(r["results"]["passed_checks"])
        for c in r["results"]["failed_checks"]:
            failed.setdefault(Path(c["file_path"]).name, set()).add((c["check_id"], c["resource"]))
    assert passed
    assert failed.get("chart.yaml")  # HAMi's privileged plugin fails checks: the comparison means something
    assert failed.pop("patched.yaml", set()) == failed.pop("chart.yaml")
    assert failed == {}


def test_every_checkov_skip_is_justified() -> None:
    for path in [
        ROOT / "Dockerfile.init",
        ROOT / "Dockerfile.sidecar",
        ROOT / "Dockerfile.npd",
    ]:
        for line in path.read_text().splitlines():
            if "checkov" in line and "skip" in line and "CKV" in line:
                reason = line.split("CKV", 1)[1].split("=" if "checkov.io" in line else ":", 1)[1]
                assert len(reason.strip()) > 20, line


def test_metrics_the_rules_use_exist_and_pass_promtool(tmp_path: Path) -> None:
    """A running sidecar's /metrics passes `promtool check metrics` and has every series the rules use
    (the recovery's, which exist only with --recover-unhealthy-after, too)."""

    script = (
        "import asyncio, aiohttp, os, socket, sys, tempfile\n"
        "from sidecar.config import AUTO_DEVICES, Settings\nfrom sidecar.cli import serve\n"
        "from testing import FakeKubelet, FakeDevicePlugin, free_port\n"
        "from sidecar.kube.access import ApiAccess\n"
        "async def main():\n"
        "    d = tempfile.mkdtemp(prefix='hg-'); dp = d + '/dp'; os.mkdir(dp)\n"
        "    s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "    st = Settings(device_plugin_dir=dp, pod_resources_socket=d+'/pr.sock', host='127.0.0.1',\n"
        "                  port=port, expect_devices=AUTO_DEVICES, device_glob=d + '/nvidia[0-9]*',\n"
        "                  probe_interval=1, probe_timeout=0.5, node_name='n', recover_unhealthy_after=600,\n"
        "                  hami_api=ApiAccess(f'https://127.0.0.1:{free_port()}'))  # nobody: no evidence\n"
        "    stop = asyncio.Event()\n"
        "    async with FakeKubelet(dp, d+'/pr.sock', dial_timeout=1) as k, FakeDevicePlugin(dp) as p:\n"
        "        t = asyncio.ensure_future(serve(st, stop))\n"
        "        await asyncio.sleep(0.5); await k.restart(); await asyncio.sleep(0.5)\n"
        "        async with aiohttp.ClientSession() as c, c.get(f'http://127.0.0.1:{port}/metrics') as r:\n"
        "            sys.stdout.write(await r.text())\n"
        "        stop.set(); await t\n"
        "asyncio.run(main())\n"
    )
    metrics = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    result = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=metrics,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", metrics, re.MULTILINE))
    rules = (MANIFESTS / "monitoring" / "prometheusrule.yaml").read_text()
    used = set(re.findall(r"(?<![:\w])(device_plugin_[a-z_]+)(?![:\w])", rules))
    assert used
    assert used <= names, used - names
    assert 'source="host"' in metrics


def test_the_stress_goal_is_the_sidecars_memory_limit() -> None:

    (ds,) = [o for o in kustomize(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    sidecar = by_name(ds["spec"]["template"]["spec"]["initContainers"])["hami-sidecar"]
    assert sidecar["resources"]["limits"]["memory"] == f"{MEMORY_LIMIT_MIB}Mi"


@pytest.mark.parametrize(
    "rendered",
    [
        "[1, 2",
        "kind: DaemonSet\nmetadata: {name: x, labels: {app.kubernetes.io/component: hami-device-plugin}}\n",
        "kind: DaemonSet\nmetadata: {name: x, labels: {app.kubernetes.io/component: hami-device-plugin}}\n"
        "spec: {template: {spec: {volumes: [{name: device-plugin, emptyDir: {}}], containers: []}}}\n",
        "kind: DaemonSet\nmetadata: {name: x, labels: {app.kubernetes.io/component: hami-device-plugin}}\n"
        "spec: {template: {spec: {volumes: [{name: device-plugin, hostPath: {path: /x}}], containers: 7}}}\n",
        # A DRA driver's kubelet plugin (tests/test_dra_manifests.py) not shaped as the charts' one.
        "kind: DaemonSet\nmetadata: {name: x-kubelet-plugin}\n"
        "spec: {template: {spec: {containers: [{name: gpus, command: [hami-kubelet-plugin]}]}}}\n",
        "kind: DaemonSet\nmetadata: {name: x-kubelet-plugin}\nspec: {template: {spec: {containers: "
        "[{name: gpus, args: [gpu-kubelet-plugin]}], volumes: [{name: plugins-registry, emptyDir: {}}]}}}\n",
    ],
)
def test_a_rendered_input_not_shaped_as_hamis_is_one_line(rendered: str) -> None:
    result = run([str(PATCH / "post-renderer.sh"), f"registry={REGISTRY}"], input=rendered, env=clean_env())
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("hami-guard post-renderer: ")


def test_network_policy_admits_prometheus_on_the_sidecar_and_keeps_hamis_nodeport_open() -> None:
    """9395 from Prometheus' namespace only; 9394 from anywhere, as HAMi's monitor Service (NodePort 31992
    to 9394) intends; it selects the device-plugin pods of any release."""
    (policy,) = kustomize(MANIFESTS / "network-policy")
    spec = policy["spec"]
    assert "namespace" not in policy["metadata"]
    for case in ("hami", "gpu", "fullnameOverride"):
        release, namespace, values, _, _ = CASES[case]
        (ds,) = [
            o for o in helm_home("helm3").template(release, namespace, *values) if o["kind"] == "DaemonSet"
        ]
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    rules = {tuple(p["port"] for p in r["ports"]): r for r in spec["ingress"]}
    assert set(rules) == {(9395,), (9394,)}
    assert rules[(9395,)]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert "from" not in rules[(9394,)]
    (service,) = [o for o in helm_home("helm3").template("hami", "kube-system") if o["kind"] == "Service"]
    (port,) = service["spec"]["ports"]
    assert (port["nodePort"], port["targetPort"]) == (31992, 9394)


@pytest.mark.parametrize("case", ["ascend", "amd", "dcu", "biren"])
def test_each_vendors_network_policy_admits_prometheus_to_its_sidecar_and_keeps_its_ports_open(
    case: str,
) -> None:
    """manifests/network-policy/vendors/<vendor> (make profiles): it selects the vendor's pods as its chart
    renders them, admits Prometheus' namespace to the port the post-renderer gives the sidecar there, and
    leaves every port of the vendor's own containers open; DCU's pods are on the host's network, outside
    every NetworkPolicy: it has none."""
    v = VENDORS[case]
    template = the_daemonset(docs(vendor_render("helm3", case)), case)["spec"]["template"]
    pod = template["spec"]
    folder = MANIFESTS / "network-policy" / "vendors" / v.vendor
    if pod.get("hostNetwork"):
        assert not folder.exists()
        return
    (policy,) = kustomize(folder)
    assert policy["metadata"]["name"] == f"hami-guard-{v.vendor}" and "namespace" not in policy["metadata"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    sidecar = by_name(pod["initContainers"])["hami-sidecar"]["ports"][0]["containerPort"]
    own = tuple(p["containerPort"] for c in pod["containers"] for p in c.get("ports", []))
    rules = {tuple(p["port"] for p in r["ports"]): r for r in spec["ingress"]}
    assert set(rules) == {(sidecar,), own} - {()}
    assert rules[(sidecar,)]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert (sidecar, own) == ((9396, (9395,)) if v.vendor == "ascend" else (9395, ()))
    if own:
        assert "from" not in rules[own]


@pytest.mark.parametrize("vendor", ["nvidia", "ascend", "amd", "dcu", "biren"])
def test_each_vendors_cluster_rule_selects_the_nodes_its_chart_runs_on(vendor: str) -> None:
    """The profile's node label ([chart] node_label, the cluster rule's nodes) is in the nodeSelector of the
    vendor's DaemonSet as its chart fixture renders it (AMD's chart applies it with node_selector_enabled);
    the rule selects it under kube-state-metrics' name of the label."""
    chart, args = {
        "nvidia": ("hami-chart", ()),
        "ascend": ("ascend-chart", ()),
        "amd": ("amd-chart", ("--set", "node_selector_enabled=true")),
        "dcu": ("dcu-chart", ()),
        "biren": ("biren-chart", ()),
    }[vendor]
    result = helm_home("helm3")("template", "x", str(FIXTURES / chart), *args)
    assert result.returncode == 0, result.stderr
    (ds,) = [o for o in docs(result.stdout) if o["kind"] == "DaemonSet"]
    profile = named(vendor)
    assert profile
    key, _, value = profile.chart.node_label.partition("=")
    assert ds["spec"]["template"]["spec"]["nodeSelector"][key] == value
    (rule,) = [
        r
        for r in shipped_rules()
        if r.get("alert") == monitoring_vendors.ALERT and r["labels"]["vendor"] == vendor
    ]
    assert f"kube_node_labels{{{monitoring_vendors.node_label(key)}={json.dumps(value)}}}" in rule["expr"]
    if vendor == DEFAULT.name:  # the default vendor's rule comes first
        assert rule == next(r for r in shipped_rules() if r.get("alert") == monitoring_vendors.ALERT)


def test_readme_kustomization_is_the_examples() -> None:
    """The README's kustomization for the kustomize route is manifests/example-hami's (the tested one)."""
    (block,) = re.findall(r"```yaml\n(.*?)```", doc_section("README.md", INSTALL), re.DOTALL)
    shown = yaml.safe_load(block)
    example = yaml.safe_load((MANIFESTS / "example-hami" / "kustomization.yaml").read_text())
    assert shown["resources"] == example["resources"]
    assert shown["images"] == example["images"]
    assert [Path(c).name for c in shown["components"]] == [Path(c).name for c in example["components"]]


def test_hamis_release_reaches_the_sidecar_from_the_chart_or_the_setting() -> None:
    """HAMI_GUARD_HAMI_VERSION: the setting, or with `chart` the DaemonSet's app.kubernetes.io/version label
    (Helm's from the chart's appVersion); absent by default (unknown: the sidecar keeps the stuck-cache
    rule), as on the kustomize route."""
    assert "HAMI_GUARD_HAMI_VERSION" not in sidecar_env(post_rendered())
    assert sidecar_env(post_rendered("hami-version=chart"))["HAMI_GUARD_HAMI_VERSION"] == "2.10.0"
    assert sidecar_env(post_rendered("hami-version=v2.10.1"))["HAMI_GUARD_HAMI_VERSION"] == "v2.10.1"
    read = parse_settings([], environ={"HAMI_GUARD_HAMI_VERSION": "v2.10.0"})
    assert read.hami_version == "v2.10.0"
