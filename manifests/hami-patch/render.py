"""Helm post-renderer: hami-guard's component applied to HAMi's rendered chart, with its settings.

Reads the rendered manifests on stdin and writes them on stdout with every DaemonSet labelled
app.kubernetes.io/component=hami-device-plugin patched (kustomization.yaml and patch.yaml beside
this file, through `kubectl kustomize`), then adapted to the chart it was given and to the settings:

- the resource and its socket from the device config HAMi's plugin reads (its `device-config`
  ConfigMap: nvidia.resourceCountName; HAMi names the socket nvidia-<name>.sock);
- the pod-resources folder beside HAMi's devicePlugin.pluginPath;
- the settings, each `KEY=VALUE` as an argument (helm --post-renderer-args) or HAMI_GUARD_<KEY>
  in the environment (an argument wins): see SETTINGS.

Exits 1 with one line on stderr when nothing was patched or an input cannot be used, 2 for a bad
setting. Needs python3 with PyYAML and kubectl on PATH.
"""

from __future__ import annotations

import copy
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
COMPONENT_LABEL = ("app.kubernetes.io/component", "hami-device-plugin")
PLACEHOLDER_REGISTRY = "registry.invalid"
VERSION = "0.1.0"
PORT = 9395
DEFAULT_RESOURCE = "nvidia.com/gpu"

# key: (default, what it sets). None: required.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "registry": (None, "where both hami-guard images are, e.g. registry.example.org/platform"),
    "tag": (VERSION, "the images' tag"),
    "plugin": ("", "RESOURCE=SOCKET[,...]; default: read from HAMi's device config"),
    "expect-devices": ("auto", "N, auto, or none (no devices check)"),
    "device-glob": ("/host/dev/nvidia[0-9]*", "the host's GPU device nodes, as the sidecar sees /dev"),
    "registration-grace": ("45", "seconds a plugin may take to register"),
    "probe-interval": ("10", "seconds between the sidecar's probe rounds"),
    "probe-timeout": ("2", "seconds one gRPC probe may take"),
    "liveness-period": ("5", "the plugin's livenessProbe periodSeconds"),
    "liveness-failures": ("3", "the plugin's livenessProbe failureThreshold"),
    "sidecar": (
        "native",
        "native (an init container with restartPolicy Always, Kubernetes >= 1.29) or container",
    ),
    "liveness": ("exec", "exec (an unreachable sidecar is no verdict) or http (httpGet /healthz)"),
}


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
    }
    for key, pattern in checks.items():
        if not re.fullmatch(pattern, values[key]):
            raise Refused(f"{key}={values[key]!r} is not valid: {SETTINGS[key][1]}", 2)
    return values


def load(text: str) -> list[dict[str, Any]]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise Refused(f"the rendered manifests are not YAML: {str(e).splitlines()[0]}") from e
    return [d for d in docs if isinstance(d, dict)]


def is_target(obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return obj.get("kind") == "DaemonSet" and labels.get(COMPONENT_LABEL[0]) == COMPONENT_LABEL[1]


def by_name(items: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {str(i.get("name")): i for i in items or [] if isinstance(i, Mapping)}


def chart_plugins(ds: Mapping[str, Any], objects: Sequence[Mapping[str, Any]]) -> str:
    """RESOURCE=SOCKET from the device config HAMi's plugin reads, or the default."""
    volume = by_name(ds["spec"]["template"]["spec"].get("volumes")).get("device-config") or {}
    name = (volume.get("configMap") or {}).get("name")
    namespace = ds["metadata"].get("namespace")
    resource = DEFAULT_RESOURCE
    for o in objects:
        meta = o.get("metadata") or {}
        if o.get("kind") == "ConfigMap" and meta.get("name") == name and meta.get("namespace") == namespace:
            try:
                config = yaml.safe_load((o.get("data") or {}).get("device-config.yaml", "")) or {}
                found = (config.get("nvidia") or {}).get("resourceCountName")
            except (yaml.YAMLError, AttributeError):
                found = None
            if isinstance(found, str) and "/" in found:
                resource = found
    return f"{resource}=nvidia-{resource.rsplit('/', 1)[1]}.sock"


def readiness_path(plugins: str) -> str:
    excluded = ["kubelet", "checkpoint"] + [f"devices:{p.split('=', 1)[0]}" for p in plugins.split(",")]
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
        name = c["image"].rsplit("/", 1)[1].split(":", 1)[0]
        c["image"] = f"{s['registry']}/{name}:{s['tag']}"
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
    sidecar["env"] = kept

    containers = by_name(pod["containers"])
    plugin = containers["device-plugin"]
    live = plugin["livenessProbe"]
    live["periodSeconds"] = int(s["liveness-period"])
    live["failureThreshold"] = int(s["liveness-failures"])
    if s["liveness"] == "http":
        del live["exec"]
        live["httpGet"] = {"path": "/healthz", "port": PORT}
        live["timeoutSeconds"] = 2
    plugin["readinessProbe"]["httpGet"]["path"] = readiness_path(plugins)

    if s["sidecar"] == "container":  # before Kubernetes 1.29: a plain container beside the plugin
        pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "hami-sidecar"]
        del sidecar["restartPolicy"]
        pod["containers"].append(sidecar)


def render(text: str, s: Mapping[str, str]) -> str:
    objects = load(text)
    targets = [o for o in objects if is_target(o)]
    if not targets:
        raise Refused(
            "no DaemonSet labelled app.kubernetes.io/component=hami-device-plugin in the rendered chart: "
            "nothing patched (is devicePlugin.enabled false, or is this not HAMi's chart?)"
        )
    for ds in targets:
        volumes = by_name(((ds.get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes"))
        if "device-plugin" not in volumes:
            raise Refused(f"DaemonSet {ds['metadata'].get('name')}: no volume named device-plugin (HAMi's)")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise Refused("kubectl is not on PATH (its built-in kustomize applies the patch)")
    with tempfile.TemporaryDirectory(prefix="hami-guard-") as tmp:
        work = Path(tmp)
        (work / "rendered.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        (work / "hami-patch").mkdir()
        for name in ("kustomization.yaml", "patch.yaml"):
            shutil.copy(HERE / name, work / "hami-patch" / name)
        (work / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            "resources: [rendered.yaml]\ncomponents: [hami-patch]\n"
        )
        built = subprocess.run([kubectl, "kustomize", str(work)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        lines = built.stderr.strip().splitlines() or ["no message"]
        raise Refused(f"kubectl kustomize failed: {lines[-1]}")
    patched = load(built.stdout)

    def key(o: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
        meta = o.get("metadata") or {}
        return (o.get("kind", ""), meta.get("namespace"), meta.get("name"))

    originals = {key(o): o for o in targets}
    done = 0
    for ds in patched:
        if key(ds) in originals:
            original = originals[key(ds)]
            plugins = s["plugin"] or chart_plugins(original, objects)
            adapt(ds, copy.deepcopy(original), s, plugins)
            done += 1
    if done != len(targets):
        raise Refused(f"patched {done} of {len(targets)} hami-device-plugin DaemonSets")
    return yaml.safe_dump_all(patched, sort_keys=False)


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
