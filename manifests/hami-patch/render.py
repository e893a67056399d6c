"""Helm post-renderer: hami-guard's patches applied to a rendered chart, with their settings.

Reads the rendered manifests on stdin and writes them on stdout with, through `kubectl kustomize`:

- every DaemonSet with the label of HAMi's device plugin (a vendor profile's [chart] selector) patched
  with patch.yaml beside this file, then adapted to the chart: the resource and its socket from the
  device config HAMi's plugin reads (its `device-config` ConfigMap, at the profile's resource_value;
  the socket the profile's for that resource), the pod-resources folder beside HAMi's
  devicePlugin.pluginPath;
- every DaemonSet whose containers run a DRA driver's kubelet plugin (DRA_BINARIES: the profiles'
  [dra]; `dra-driver=` names others) patched with dra.yaml, then adapted: the drivers of its
  containers, the plugin folders the chart mounts, and on each driver container the device plugins'
  probes asking only about its own driver;
- the settings, each `KEY=VALUE` as an argument (helm --post-renderer-args) or HAMI_GUARD_<KEY>
  in the environment (an argument wins): see SETTINGS.

What it knows of each vendor is profiles.json beside it: hami-guard's vendor profiles
(hami_guard/profiles), copied by `make profiles` because this script cannot import the package.

Exits 1 with one line on stderr when nothing was patched or an input cannot be used, 2 for a bad
setting. Needs python3 with PyYAML and kubectl on PATH.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
# The vendor profiles (hami_guard/profiles, copied by `make profiles`), the default one first.
PROFILES: list[dict[str, Any]] = sorted(
    json.loads((HERE / "profiles.json").read_text())["profiles"].values(), key=lambda p: not p["default"]
)
PROFILE = PROFILES[0]
NAME = "{name}"  # in a profile's socket: the resource's name
HOST_DEV = "/host"  # where patch.yaml mounts the host's /dev in the sidecar: the glob is under it
PLACEHOLDER_REGISTRY = "registry.invalid"
VERSION = "0.1.0"
PORT = 9395
DEFAULT_RESOURCE: str = PROFILE["resources"]["default"]
DEVICE_GLOB: str = HOST_DEV + PROFILE["devices"]["glob"]
# The kubelet plugins of the DRA drivers' charts, by the program their container runs: the driver's name.
DRA_BINARIES: dict[str, str] = {program: driver for p in PROFILES for program, driver in p["dra"].items()}

# key: (default, what it sets). None: required.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "registry": (None, "where both hami-guard images are, e.g. registry.example.org/platform"),
    "tag": (VERSION, "the images' tag"),
    "plugin": ("", "RESOURCE=SOCKET[,...]; default: read from HAMi's device config"),
    "expect-devices": ("auto", "N, auto, or none (no devices check)"),
    "device-glob": (DEVICE_GLOB, "the host's GPU device nodes, as the sidecar sees /dev"),
    "registration-grace": ("45", "seconds a plugin may take to register"),
    "probe-interval": ("10", "seconds between the sidecar's probe rounds"),
    "probe-timeout": ("2", "seconds one gRPC probe may take"),
    "liveness-period": ("2", "the plugin's livenessProbe periodSeconds"),
    "liveness-failures": ("2", "the plugin's livenessProbe failureThreshold"),
    "sidecar": (
        "native",
        "native (an init container with restartPolicy Always, Kubernetes >= 1.29) or container",
    ),
    "liveness": ("exec", "exec (an unreachable sidecar is no verdict) or http (httpGet /healthz)"),
    "dra-driver": (
        "",
        "CONTAINER=DRIVER[=SOCKET][,...]: a DRA kubelet plugin's container, its driver and registration "
        "socket; default: the drivers of the kubelet plugins the containers run",
    ),
    "dra-grace": ("150", "seconds a DRA driver may stay unregistered"),
    "recover-unhealthy-after": (
        "0",
        "a duration (90s, 10m, 1h; at most 30d): GPUs HAMi marked unhealthy that long get one plugin "
        "restart, which re-reads them; 0: off",
    ),
}
# The sidecar's --recover-unhealthy-after: its units and its bound (sidecar/config.py).
DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_RECOVER_AFTER = 30 * 86400.0


class Refused(Exception):
    """One line for the operator; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def settings(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for key, (default, _) in SETTINGS.items():
        env = environ.get("HAMI_GUARD_" + key.upper().replace("-", "_"))
        if env is not None:
            values[key] = env
        elif default is not None:
            values[key] = default
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in SETTINGS:
            raise Refused(f"unknown setting {arg!r}: expected KEY=VALUE, KEY one of {', '.join(SETTINGS)}", 2)
        values[key] = value
    if not values.get("registry"):
        raise Refused(
            "set the registry that holds hami-sidecar and hami-initcheck: "
            "--post-renderer-args registry=<host[/path]> (or HAMI_GUARD_REGISTRY)",
            2,
        )
    checks = {
        "registry": r"[a-z0-9]([a-z0-9.:-]*[a-z0-9])?(/[a-z0-9._-]+)*",
        "tag": r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}",
        "plugin": r"([a-z0-9.-]+/[A-Za-z0-9._-]+=[A-Za-z0-9._-]+(,|$))*",
        "expect-devices": r"auto|none|[1-9][0-9]{0,3}",
        "device-glob": r"/\S*",
        "registration-grace": r"[0-9]+(\.[0-9]+)?",
        "probe-interval": r"[0-9]+(\.[0-9]+)?",
        "probe-timeout": r"[0-9]+(\.[0-9]+)?",
        "liveness-period": r"[1-9][0-9]{0,2}",
        "liveness-failures": r"[1-9][0-9]?",
        "sidecar": r"native|container",
        "liveness": r"exec|http",
        "dra-driver": r"([a-z0-9-]+=[a-z0-9.-]+(=[A-Za-z0-9._/-]+)?(,|$))*",
        "dra-grace": r"[0-9]+(\.[0-9]+)?",
    }
    for key, pattern in checks.items():
        if not re.fullmatch(pattern, values[key]):
            raise Refused(f"{key}={values[key]!r} is not valid: {SETTINGS[key][1]}", 2)
    after = duration(values["recover-unhealthy-after"])
    if after is None or after > MAX_RECOVER_AFTER:
        key = "recover-unhealthy-after"
        raise Refused(f"{key}={values[key]!r} is not valid: {SETTINGS[key][1]}", 2)
    return values


def duration(value: str) -> float | None:
    """Seconds of a duration as the sidecar reads it (90, 90s, 10m, 1h, 1d); None for any other form."""
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)", value)
    return float(found.group(1)) * DURATION_UNITS[found.group(2)] if found else None


def load(text: str) -> list[dict[str, Any]]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise Refused(f"the rendered manifests are not YAML: {str(e).splitlines()[0]}") from e
    return [d for d in docs if isinstance(d, dict)]


def profile_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The vendor profile whose device-plugin DaemonSet `obj` is (labelled with its [chart] selector)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for p in PROFILES:
        key, _, value = p["chart"]["selector"].partition("=")
        if obj.get("kind") == "DaemonSet" and labels.get(key) == value:
            return p
    return None


def is_target(obj: Mapping[str, Any]) -> bool:
    return profile_of(obj) is not None


def by_name(items: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {str(i.get("name")): i for i in items or [] if isinstance(i, Mapping)}


def chart_plugins(ds: Mapping[str, Any], objects: Sequence[Mapping[str, Any]]) -> str:
    """RESOURCE=SOCKET from the device config HAMi's plugin reads, or the default (of the DaemonSet's
    vendor profile)."""
    profile = profile_of(ds) or PROFILE
    volume = by_name(ds["spec"]["template"]["spec"].get("volumes")).get("device-config") or {}
    name = (volume.get("configMap") or {}).get("name")
    namespace = ds["metadata"].get("namespace")
    resource: str = profile["resources"]["default"]
    for o in objects:
        meta = o.get("metadata") or {}
        if o.get("kind") == "ConfigMap" and meta.get("name") == name and meta.get("namespace") == namespace:
            try:
                found = yaml.safe_load((o.get("data") or {}).get("device-config.yaml", "")) or {}
                for key in profile["chart"]["resource_value"].split("."):
                    found = (found or {}).get(key)
            except (yaml.YAMLError, AttributeError):
                found = None
            if isinstance(found, str) and "/" in found:
                resource = found
    socket = profile["resources"]["socket"].replace(NAME, resource.rsplit("/", 1)[1])
    return f"{resource}={socket}"


def readiness_path(plugins: str) -> str:
    resources = [p.split("=", 1)[0] for p in plugins.split(",")]
    # The rollout gate: serving and registration only; devices (and their recovery, a GPU really
    # unhealthy) and HAMi's scheduler view are the node's.
    kinds = ("devices", "hami", "recover")
    excluded = ["kubelet", "checkpoint"] + [f"{kind}:{r}" for r in resources for kind in kinds]
    return "/readyz?" + "&".join(f"exclude={e}" for e in excluded)


def adapt(ds: dict[str, Any], original: Mapping[str, Any], s: Mapping[str, str], plugins: str) -> None:
    """Apply the settings to one patched DaemonSet (in place)."""
    pod = ds["spec"]["template"]["spec"]
    hami_volumes = by_name(original["spec"]["template"]["spec"].get("volumes"))
    plugin_dir = (hami_volumes["device-plugin"].get("hostPath") or {}).get("path")
    if not plugin_dir:
        raise Refused(f"DaemonSet {ds['metadata']['name']}: HAMi's device-plugin volume is not a hostPath")
    volumes = by_name(pod["volumes"])
    pod_resources = posixpath.join(posixpath.dirname(plugin_dir.rstrip("/")), "pod-resources")
    volumes["hami-guard-pod-resources"]["hostPath"]["path"] = pod_resources

    inits = by_name(pod.get("initContainers"))
    sidecar = inits["hami-sidecar"]
    for c in (inits["hami-initcheck"], sidecar):
        set_image(c, s)
    if "deviceconfig" not in hami_volumes:  # HAMi's node configuration: not in every chart version
        sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["name"] != "deviceconfig"]
    env = {
        "HAMI_GUARD_REGISTRATION_GRACE": s["registration-grace"],
        "HAMI_GUARD_PROBE_INTERVAL": s["probe-interval"],
        "HAMI_GUARD_PROBE_TIMEOUT": s["probe-timeout"],
        "HAMI_GUARD_PLUGIN": plugins,
        "HAMI_GUARD_EXPECT_DEVICES": s["expect-devices"],
        "HAMI_GUARD_DEVICE_GLOB": s["device-glob"],
    }
    kept = []
    for e in sidecar["env"]:
        if e["name"] in env:
            # none: no devices check, which the sidecar spells 0 (absent, it wants one healthy device)
            none = e["name"] == "HAMI_GUARD_EXPECT_DEVICES" and env[e["name"]] == "none"
            e["value"] = "0" if none else env[e["name"]]
        kept.append(e)
    if duration(s["recover-unhealthy-after"]):  # off (0) is the sidecar's default: no variable then
        kept.append({"name": "HAMI_GUARD_RECOVER_UNHEALTHY_AFTER", "value": s["recover-unhealthy-after"]})
    sidecar["env"] = kept

    containers = by_name(pod["containers"])
    plugin = containers["device-plugin"]
    set_liveness(plugin["livenessProbe"], s, "/healthz")
    plugin["readinessProbe"]["httpGet"]["path"] = readiness_path(plugins)
    place_sidecar(pod, sidecar, s)


def set_image(c: dict[str, Any], s: Mapping[str, str]) -> None:
    name = c["image"].rsplit("/", 1)[1].split(":", 1)[0]
    c["image"] = f"{s['registry']}/{name}:{s['tag']}"


def set_liveness(live: dict[str, Any], s: Mapping[str, str], path: str) -> None:
    """patch.yaml's livenessProbe (in place), asking `path`, with the settings."""
    live["periodSeconds"] = int(s["liveness-period"])
    live["failureThreshold"] = int(s["liveness-failures"])
    if s["liveness"] == "http":
        del live["exec"]
        live["httpGet"] = {"path": path, "port": PORT}
        live["timeoutSeconds"] = 2
    else:
        command = live["exec"]["command"]
        command[-1] = command[-1].replace("GET /healthz ", f"GET {path} ")


def place_sidecar(pod: dict[str, Any], sidecar: dict[str, Any], s: Mapping[str, str]) -> None:
    if s["sidecar"] == "container":  # before Kubernetes 1.29: a plain container beside the plugin
        pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "hami-sidecar"]
        del sidecar["restartPolicy"]
        pod["containers"].append(sidecar)


# --- DRA drivers' kubelet plugins --------------------------------------------------------------------


def words(c: Mapping[str, Any]) -> list[str]:
    """The words of a container's command and args (a shell script's too), as program names."""
    parts = [*(c.get("command") or []), *(c.get("args") or [])]
    return [posixpath.basename(w) for p in parts if isinstance(p, str) for w in p.split()]


def named_drivers(s: Mapping[str, str]) -> dict[str, str]:
    """The `dra-driver` setting: {container: DRIVER[=SOCKET]}."""
    return dict(item.split("=", 1) for item in s["dra-driver"].split(",") if item)


def dra_drivers(ds: Mapping[str, Any], s: Mapping[str, str]) -> dict[str, str]:
    """{container: DRIVER[=SOCKET]}: the DaemonSet's containers `dra-driver` names, and those that run a
    kubelet plugin of DRA_BINARIES. Empty: not a DRA driver's kubelet plugin."""
    if ds.get("kind") != "DaemonSet" or is_target(ds):
        return {}
    pod = ((ds.get("spec") or {}).get("template") or {}).get("spec") or {}
    named = named_drivers(s)
    found = {}
    for name, c in by_name(pod.get("containers") if isinstance(pod, Mapping) else None).items():
        known = [DRA_BINARIES[w] for w in words(c) if w in DRA_BINARIES]
        if name in named or known:
            found[name] = named.get(name) or known[0]
    return found


DRA_CHECKS = ("dra-plugin", "dra-registered")


def others_excluded(drivers: Mapping[str, str], mine: str) -> str:
    """`exclude=` of every check of the other containers' drivers: a container's probes ask about its
    own driver only, so that one driver's failure never restarts another's container."""
    return "&".join(
        f"exclude={kind}:{driver.split('=', 1)[0]}"
        for container, driver in drivers.items()
        if container != mine
        for kind in DRA_CHECKS
    )


def adapt_dra(
    ds: dict[str, Any], original: Mapping[str, Any], s: Mapping[str, str], drivers: Mapping[str, str]
) -> None:
    """Apply the settings to one patched kubelet-plugin DaemonSet (in place)."""
    pod = ds["spec"]["template"]["spec"]
    chart_volumes = by_name(original["spec"]["template"]["spec"].get("volumes"))
    folders: dict[str, str] = {}
    for volume in ("plugins-registry", "plugins"):
        path = ((chart_volumes.get(volume) or {}).get("hostPath") or {}).get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise Refused(f"DaemonSet {ds['metadata']['name']}: no hostPath volume {volume} (the kubelet's)")
        folders[volume] = path
    sidecar = by_name(pod["initContainers"])["hami-sidecar"]
    # After the chart's init containers (NVIDIA's waits for the driver's files): started last, just
    # before the drivers.
    pod["initContainers"] = [c for c in pod["initContainers"] if c is not sidecar] + [sidecar]
    set_image(sidecar, s)
    for m in sidecar["volumeMounts"]:
        m["mountPath"] = folders.get(m["name"], m["mountPath"])
    kubelet_dir = posixpath.dirname(folders["plugins"].rstrip("/"))
    by_name(pod["volumes"])["hami-guard-device-plugins"]["hostPath"]["path"] = kubelet_dir + "/device-plugins"
    env = {
        "HAMI_GUARD_DRA_DRIVER": ",".join(drivers.values()),
        "HAMI_GUARD_DRA_REGISTRY_DIR": folders["plugins-registry"],
        "HAMI_GUARD_DRA_GRACE": s["dra-grace"],
        "HAMI_GUARD_PROBE_INTERVAL": s["probe-interval"],
        "HAMI_GUARD_PROBE_TIMEOUT": s["probe-timeout"],
    }
    for e in sidecar["env"]:
        e["value"] = env.get(e["name"], e.get("value"))

    # Each driver container: the device plugins' probes (patch.yaml), about its own driver; the chart's
    # livenessProbe (a self-probe) is replaced, its startupProbe kept.
    patch = yaml.safe_load((HERE / "patch.yaml").read_text())
    template = by_name(patch["spec"]["template"]["spec"]["containers"])["device-plugin"]
    containers = by_name(pod["containers"])
    for name in drivers:
        others = others_excluded(drivers, name)
        live = copy.deepcopy(template["livenessProbe"])
        set_liveness(live, s, "/healthz" + (f"?{others}" if others else ""))
        ready = copy.deepcopy(template["readinessProbe"])
        gate = "/readyz?exclude=kubelet&exclude=checkpoint"  # the rollout gate, as for the device plugins
        ready["httpGet"]["path"] = gate + (f"&{others}" if others else "")
        containers[name]["livenessProbe"] = live
        containers[name]["readinessProbe"] = ready
    place_sidecar(pod, sidecar, s)


def render(text: str, s: Mapping[str, str]) -> str:
    objects = load(text)
    targets = [o for o in objects if is_target(o)]
    dra = {id(o): d for o in objects if (d := dra_drivers(o, s))}
    if not targets and not dra:
        labels = " or ".join(p["chart"]["selector"] for p in PROFILES)
        raise Refused(
            f"no DaemonSet labelled {labels} and no DRA kubelet plugin "
            "in the rendered chart: nothing patched (is devicePlugin.enabled false, or is this not HAMi's "
            "chart nor a DRA driver's? dra-driver=CONTAINER=DRIVER names a kubelet plugin)"
        )
    named = set(named_drivers(s))
    if unknown := named - {c for d in dra.values() for c in d}:
        raise Refused(f"dra-driver: no DaemonSet has a container named {', '.join(sorted(unknown))}", 2)
    for ds in targets:
        volumes = by_name(((ds.get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes"))
        if "device-plugin" not in volumes:
            raise Refused(f"DaemonSet {ds['metadata'].get('name')}: no volume named device-plugin (HAMi's)")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise Refused("kubectl is not on PATH (its built-in kustomize applies the patch)")
    drivers = {key(o): dra[id(o)] for o in objects if id(o) in dra}
    with tempfile.TemporaryDirectory(prefix="hami-guard-") as tmp:
        work = Path(tmp)
        (work / "rendered.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        (work / "hami-patch").mkdir()
        shutil.copy(HERE / "patch.yaml", work / "hami-patch" / "patch.yaml")
        # kustomization.yaml's component, targeted at the profiles' labels (that file names the default's).
        labelled = [{"kind": "DaemonSet", "labelSelector": p["chart"]["selector"]} for p in PROFILES]
        hami = {
            "apiVersion": "kustomize.config.k8s.io/v1alpha1",
            "kind": "Component",
            "patches": [{"path": "patch.yaml", "target": target} for target in labelled],
        }
        (work / "hami-patch" / "kustomization.yaml").write_text(yaml.safe_dump(hami))
        components = ["hami-patch"]
        if drivers:  # dra.yaml on exactly these DaemonSets (names are anchored regular expressions)
            (work / "dra").mkdir()
            shutil.copy(HERE / "dra.yaml", work / "dra" / "dra.yaml")
            patches = [
                {"path": "dra.yaml", "target": {"kind": "DaemonSet", "name": re.escape(str(name))}}
                for _, _, name in drivers
            ]
            component = {
                "apiVersion": "kustomize.config.k8s.io/v1alpha1",
                "kind": "Component",
                "patches": patches,
            }
            (work / "dra" / "kustomization.yaml").write_text(yaml.safe_dump(component))
            components.append("dra")
        (work / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [rendered.yaml]\ncomponents: [{', '.join(components)}]\n"
        )
        built = subprocess.run([kubectl, "kustomize", str(work)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        lines = built.stderr.strip().splitlines() or ["no message"]
        raise Refused(f"kubectl kustomize failed: {lines[-1]}")
    patched = load(built.stdout)

    originals = {key(o): o for o in targets}
    chart = {key(o): o for o in objects}
    done = 0
    for ds in patched:
        if key(ds) in originals:
            original = originals[key(ds)]
            plugins = s["plugin"] or chart_plugins(original, objects)
            adapt(ds, copy.deepcopy(original), s, plugins)
            done += 1
        elif key(ds) in drivers:
            adapt_dra(ds, copy.deepcopy(chart[key(ds)]), s, drivers[key(ds)])
            done += 1
    if done != len(targets) + len(drivers):
        raise Refused(f"patched {done} of {len(targets) + len(drivers)} DaemonSets")
    return yaml.safe_dump_all(patched, sort_keys=False)


def key(o: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    meta = o.get("metadata") or {}
    return (o.get("kind", ""), meta.get("namespace"), meta.get("name"))


def main(argv: Sequence[str]) -> int:
    try:
        s = settings(argv, os.environ)
        sys.stdout.write(render(sys.stdin.read(), s))
    except Refused as e:
        print(f"hami-guard post-renderer: {e}", file=sys.stderr)
        return e.code
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # A DaemonSet with the label but not HAMi's shape (a field missing, of another type).
        print(f"hami-guard post-renderer: the DaemonSet is not shaped as HAMi's: {e!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
