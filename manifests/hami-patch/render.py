"""Helm post-renderer: hami-guard's patches applied to a rendered chart, with their settings.

Reads the rendered manifests on stdin and writes them on stdout with, through `kubectl kustomize`:

- every DaemonSet of a HAMi device plugin (one a vendor profile's [chart] selector labels, on the
  DaemonSet or on its pods; `selector=` and `vendor=` name one) patched with patch.yaml beside this
  file, made the vendor's (the plugin's container, HAMI_GUARD_VENDOR, a port none of the pod's
  containers has), then adapted to the chart: the resource and its socket from the device config the
  plugin reads (the profile's config_volume and resource_value), the kubelet's folders beside the
  plugin's device-plugins folder;
- every DaemonSet whose containers run a DRA driver's kubelet plugin (DRA_BINARIES: the profiles'
  [dra]; `dra-driver=` names others) patched with dra.yaml, then adapted: the drivers of its
  containers, the plugin folders the chart mounts, and on each driver container the device plugins'
  probes asking only about its own driver;
- the settings, each `KEY=VALUE` as an argument (helm --post-renderer-args) or HAMI_GUARD_<KEY>
  in the environment (an argument wins): see SETTINGS.

`render.py components FOLDER` writes instead the kustomize component of each vendor but the default
one, FOLDER/<vendor>/ (manifests/hami-patch/vendors, `make profiles`); with `vendor=` or `selector=`,
the one component they name, to FOLDER.

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
NAMES: dict[str, dict[str, Any]] = {
    name: p for name, p in json.loads((HERE / "profiles.json").read_text())["profiles"].items()
}
PROFILE = PROFILES[0]
DEFAULT_VENDOR = next(name for name, p in NAMES.items() if p is PROFILE or p["default"])
NAME = "{name}"  # in a profile's socket: the resource's name
HOST_DEV = "/host/dev"  # where patch.yaml mounts the host's /dev in the sidecar (HAMI_GUARD_HOST_DEV)
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"  # the folder every plugin serves in, in its container
PLACEHOLDER_REGISTRY = "registry.invalid"
VERSION = "0.1.0"
PORT = 9395  # patch.yaml's port: hami-sidecar's, unless a container of the pod has it
DEFAULT_RESOURCE: str = PROFILE["resources"]["default"]
# The kubelet plugins of the DRA drivers' charts, by the program their container runs: the driver's name.
DRA_BINARIES: dict[str, str] = {program: driver for p in PROFILES for program, driver in p["dra"].items()}
READINESS = "/readyz?exclude=kubelet&exclude=checkpoint&exclude=devices&exclude=hami&exclude=recover"

# key: (default, what it sets). None: required.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "registry": (None, "where both hami-guard images are, e.g. registry.example.org/platform"),
    "tag": (VERSION, "the images' tag"),
    "vendor": (
        "",
        f"the device plugin's vendor profile, one of {', '.join(sorted(NAMES))}; default: the one whose "
        "chart's label the DaemonSet carries",
    ),
    "selector": (
        "",
        "KEY=VALUE: the label of the device plugin's DaemonSet, or of its pods, to patch; default: the "
        "vendor profiles' (with neither vendor= nor a profile's label: a vendor without a profile, plugin= "
        "required)",
    ),
    "container": (
        "",
        f"the plugin's container; default: the vendor's, else the one that serves in {DEVICE_PLUGINS}",
    ),
    "port": ("", f"hami-sidecar's port; default {PORT}, else the next one no container of the pod has"),
    "plugin": (
        "",
        "RESOURCE=SOCKET[,...]; default: read from the vendor's device config, else the vendor's; where each "
        "node serves its own hardware's and the config names several, the sidecar learns which one",
    ),
    "expect-devices": (
        "",
        "N, auto, or none (no devices check); default: auto where the vendor profile names device nodes "
        "(or device-glob= does), else at least one",
    ),
    "device-glob": (
        "",
        f"the host's device nodes as the sidecar sees /dev ({HOST_DEV}); default: the vendor's",
    ),
    "hami-version": (
        "",
        "HAMi's release, e.g. v2.10.0 (the sidecar's stuck-cache rule follows it); `chart`: the "
        "DaemonSet's app.kubernetes.io/version label (Helm's, from the chart's appVersion); default unknown "
        "(the kustomize route cannot read the label: the same render either way)",
    ),
    "registration-grace": ("45", "seconds a plugin may take to register"),
    "probe-interval": ("10", "seconds between the sidecar's probe rounds"),
    "probe-timeout": ("2", "seconds one gRPC probe may take"),
    "liveness-period": ("2", "the plugin's livenessProbe periodSeconds"),
    "liveness-failures": ("2", "the plugin's livenessProbe failureThreshold"),
    "sidecar": (
        "native",
        "native (an init container with restartPolicy Always, Kubernetes >= 1.29) or container",
    ),
    "liveness": (
        "",
        "exec (an unreachable sidecar is no verdict; needs bash in the plugin's image) or http (httpGet "
        "/healthz); default: exec where the vendor's image has bash, else http",
    ),
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
PLUGIN = r"[a-z0-9.-]+/[A-Za-z0-9._-]+=[A-Za-z0-9._-]+"  # RESOURCE=SOCKET, as the sidecar reads it
LABEL = r"([a-z0-9.-]+/)?[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?=[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?"


class Refused(Exception):
    """One line for the operator; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def settings(argv: Sequence[str], environ: Mapping[str, str], *, registry: bool = True) -> dict[str, str]:
    """The settings of `argv` (KEY=VALUE) over the environment's, checked; `registry`: required."""
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
    values.setdefault("registry", "")
    if registry and not values["registry"]:
        raise Refused(
            "set the registry that holds hami-sidecar and hami-initcheck: "
            "--post-renderer-args registry=<host[/path]> (or HAMI_GUARD_REGISTRY)",
            2,
        )
    checks = {
        "registry": r"([a-z0-9]([a-z0-9.:-]*[a-z0-9])?(/[a-z0-9._-]+)*)?",
        "tag": r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}",
        "vendor": "|".join(["", *map(re.escape, NAMES)]),
        "selector": f"({LABEL})?",
        "container": r"([a-z0-9]([a-z0-9-]*[a-z0-9])?)?",
        "port": r"([1-9][0-9]{0,4})?",
        "plugin": f"({PLUGIN}(,|$))*",
        "expect-devices": r"|auto|none|[1-9][0-9]{0,3}",
        "device-glob": r"(/\S*)?",
        "registration-grace": r"[0-9]+(\.[0-9]+)?",
        "probe-interval": r"[0-9]+(\.[0-9]+)?",
        "probe-timeout": r"[0-9]+(\.[0-9]+)?",
        "liveness-period": r"[1-9][0-9]{0,2}",
        "liveness-failures": r"[1-9][0-9]?",
        "sidecar": r"native|container",
        "liveness": r"|exec|http",
        "dra-driver": r"([a-z0-9-]+=[a-z0-9.-]+(=[A-Za-z0-9._/-]+)?(,|$))*",
        "dra-grace": r"[0-9]+(\.[0-9]+)?",
    }
    for key, pattern in checks.items():
        if not re.fullmatch(pattern, values[key]):
            raise Refused(f"{key}={values[key]!r} is not valid: {SETTINGS[key][1]}", 2)
    after = duration(values["recover-unhealthy-after"])
    port = int(values["port"] or PORT)
    if after is None or after > MAX_RECOVER_AFTER or port > 65535:
        key = "port" if port > 65535 else "recover-unhealthy-after"
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


# --- the vendors' device-plugin DaemonSets --------------------------------------------------------------


def generic(s: Mapping[str, str]) -> dict[str, Any]:
    """A vendor without a profile, from the settings alone (selector=, container=, plugin=, device-glob=)."""
    return {
        "name": "",
        "resources": {"default": "", "socket": "", "per_node": True},
        "devices": {"glob": ""},
        "chart": {
            "selector": s["selector"],
            "container": s["container"],
            "config_volume": "",
            "resource_value": "",
            "node_config": "",
            "ports": [],
            "bash": True,
            "daemonset": "",
        },
    }


def candidates(s: Mapping[str, str]) -> list[dict[str, Any]]:
    """The profiles a DaemonSet may be the plugin of: vendor='s, or every one; with selector=, that label."""
    chosen = (
        [dict(NAMES[s["vendor"]], name=s["vendor"])]
        if s["vendor"]
        else [dict(p, name=n) for n, p in sorted(NAMES.items(), key=lambda i: not i[1]["default"])]
    )
    if not s["selector"]:
        return chosen
    same = [p for p in chosen if p["chart"]["selector"] == s["selector"]]
    picked = copy.deepcopy(same or ([chosen[0]] if s["vendor"] else [generic(s)]))
    for p in picked:
        p["chart"]["selector"] = s["selector"]
    return picked


def labels_of(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The DaemonSet's own labels and its pods'."""
    meta = obj.get("metadata") or {}
    pods = (((obj.get("spec") or {}).get("template") or {}).get("metadata")) or {}
    return [meta.get("labels") or {}, pods.get("labels") or {}]


def profile_of(obj: Mapping[str, Any], s: Mapping[str, str]) -> dict[str, Any] | None:
    """The vendor profile whose device-plugin DaemonSet `obj` is (labelled, or its pods, with its
    [chart] selector)."""
    if obj.get("kind") != "DaemonSet":
        return None
    for p in candidates(s):
        key, _, value = p["chart"]["selector"].partition("=")
        if any(labels.get(key) == value for labels in labels_of(obj)):
            return p
    return None


def by_name(items: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {str(i.get("name")): i for i in items or [] if isinstance(i, Mapping)}


def pod_of(ds: Mapping[str, Any]) -> dict[str, Any]:
    pod = ((ds.get("spec") or {}).get("template") or {}).get("spec")
    if not isinstance(pod, dict):
        raise Refused(f"DaemonSet {ds['metadata'].get('name')}: no pod template")
    return pod


def plugin_container(ds: Mapping[str, Any], profile: Mapping[str, Any]) -> str:
    """The plugin's container: the profile's (or container='s), else the one that mounts a folder at the
    kubelet's device-plugins path, the one device plugins serve in."""
    containers = by_name(pod_of(ds).get("containers"))
    named = profile["chart"]["container"]
    if named in containers:
        return str(named)
    serving = [n for n, c in containers.items() if plugins_volume(c) is not None]
    if len(serving) != 1:
        raise Refused(
            f"DaemonSet {ds['metadata'].get('name')}: no container {named or '(none named)'}, and "
            f"{len(serving)} containers mount {DEVICE_PLUGINS}: name the plugin's with container="
        )
    return serving[0]


def plugins_volume(container: Mapping[str, Any]) -> str | None:
    """The volume a container mounts at the kubelet's device-plugins folder."""
    for m in container.get("volumeMounts") or []:
        if str(m.get("mountPath", "")).rstrip("/") == DEVICE_PLUGINS:
            return str(m.get("name"))
    return None


def plugins_dir(ds: Mapping[str, Any], container: str) -> str:
    """The host's device-plugins folder the plugin's container serves in (its hostPath)."""
    pod = pod_of(ds)
    volume = plugins_volume(by_name(pod.get("containers"))[container])
    path = ((by_name(pod.get("volumes")).get(volume or "") or {}).get("hostPath") or {}).get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise Refused(
            f"DaemonSet {ds['metadata'].get('name')}: container {container} mounts no hostPath volume at "
            f"{DEVICE_PLUGINS}"
        )
    return path


def sidecar_port(ds: Mapping[str, Any], profile: Mapping[str, Any], s: Mapping[str, str]) -> int:
    """port=, else PORT or the next one none of the pod's containers (nor the vendor's) listens on."""
    if s["port"]:
        return int(s["port"])
    pod = pod_of(ds)
    used = {int(p) for p in profile["chart"]["ports"]}
    for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]:
        for port in c.get("ports") or []:
            used.update(int(port[k]) for k in ("containerPort", "hostPort") if isinstance(port.get(k), int))
    return next(p for p in range(PORT, 65536) if p not in used)


def liveness_kind(profile: Mapping[str, Any], s: Mapping[str, str]) -> str:
    return s["liveness"] or ("exec" if profile["chart"]["bash"] else "http")


def vendor_patch(profile: Mapping[str, Any], container: str, port: int, liveness: str) -> dict[str, Any]:
    """patch.yaml made this vendor's: its plugin's container, HAMI_GUARD_VENDOR (not the default's),
    without HAMi's node configuration where the plugin reads none, on `port`, the liveness `liveness`."""
    patch: dict[str, Any] = yaml.safe_load((HERE / "patch.yaml").read_text())
    pod = patch["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"])["hami-sidecar"]
    plugin = pod["containers"][0]
    plugin["name"] = container
    if profile["name"] and profile["name"] != DEFAULT_VENDOR:
        sidecar["env"].insert(0, {"name": "HAMI_GUARD_VENDOR", "value": profile["name"]})
    if not profile["chart"]["node_config"]:
        sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["name"] != "deviceconfig"]
    if not profile["devices"]["glob"]:  # no device nodes to count: at least one healthy device (absent)
        sidecar["env"] = [e for e in sidecar["env"] if e["name"] != "HAMI_GUARD_EXPECT_DEVICES"]
    if port != PORT:
        sidecar["env"].append({"name": "HAMI_GUARD_LISTEN", "value": f"0.0.0.0:{port}"})
        sidecar["ports"][0]["containerPort"] = port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            (sidecar[probe].get("tcpSocket") or sidecar[probe].get("httpGet"))["port"] = port
        plugin["readinessProbe"]["httpGet"]["port"] = port
    set_liveness(plugin["livenessProbe"], liveness, port, "/healthz")
    return patch


def set_liveness(live: dict[str, Any], kind: str, port: int, path: str) -> None:
    """patch.yaml's livenessProbe (in place), asking `path` on `port`: exec or http."""
    if kind == "http":
        live.pop("exec", None)
        live["httpGet"] = {"path": path, "port": port}
        live["timeoutSeconds"] = 2
    else:
        command = live["exec"]["command"]
        command[-1] = command[-1].replace("GET /healthz ", f"GET {path} ")
        command[-1] = command[-1].replace(f"/dev/tcp/127.0.0.1/{PORT}", f"/dev/tcp/127.0.0.1/{port}")


def chart_resources(
    ds: Mapping[str, Any], objects: Sequence[Mapping[str, Any]], p: Mapping[str, Any]
) -> list[str]:
    """The resources of the device config the plugin reads: the profile's resource_value in its
    config_volume's device-config.yaml ([] where the profile has none, or the chart sets none)."""
    chart = p["chart"]
    volume = by_name(pod_of(ds).get("volumes")).get(chart["config_volume"]) or {}
    name = (volume.get("configMap") or {}).get("name")
    namespace = ds["metadata"].get("namespace")
    for o in objects:
        meta = o.get("metadata") or {}
        if not chart["resource_value"] or o.get("kind") != "ConfigMap":
            continue
        if meta.get("name") == name and meta.get("namespace") == namespace:
            try:
                found = [yaml.safe_load((o.get("data") or {}).get("device-config.yaml", "")) or {}]
            except yaml.YAMLError:
                return []
            for key in chart["resource_value"].split("."):
                found = [
                    v.get(key)
                    for item in found
                    for v in (item if isinstance(item, list) else [item])
                    if isinstance(v, dict)
                ]
            flat = [v for item in found for v in (item if isinstance(item, list) else [item])]
            return [v for v in flat if isinstance(v, str) and "/" in v]
    return []


def chart_plugins(
    ds: Mapping[str, Any], objects: Sequence[Mapping[str, Any]], p: Mapping[str, Any]
) -> tuple[str, str]:
    """(plugins, candidates), each RESOURCE=SOCKET[,...], from the device config the plugin reads. Plugins
    "": the vendor's default (the sidecar's own). Where each node registers its own hardware's resource and
    the chart names several, they are the candidates instead: the sidecar learns which one this node's
    plugin serves (it cannot where the pod shares the host's network: refused then, as with none read)."""
    name = ds["metadata"].get("name")
    if not p["name"]:
        raise Refused(f"DaemonSet {name}: a vendor without a profile: set plugin=")
    resources = chart_resources(ds, objects, p)
    r = p["resources"]
    pairs = [f"{x}={r['socket'].replace(NAME, x.rsplit('/', 1)[1])}" for x in resources]
    if r["per_node"] and len(resources) != 1:
        shown = ", ".join(resources) or "none read"
        if resources and pod_of(ds).get("hostNetwork") is not True:
            if bad := [x for x in pairs if not re.fullmatch(PLUGIN, x)]:
                raise Refused(f"DaemonSet {name}: the chart's device config names {bad[0]!r}: set plugin=")
            return "", ",".join(dict.fromkeys(pairs))
        why = "with hostNetwork, the sidecar cannot tell which one this node's serves; " if resources else ""
        raise Refused(
            f"DaemonSet {name}: each node's plugin registers the resource of its own hardware (the chart's: "
            f"{shown}): {why}set plugin=RESOURCE=SOCKET for the nodes it runs on"
        )
    if not resources or resources == [r["default"]]:
        return "", ""
    return ",".join(pairs), ""


def hami_version(ds: Mapping[str, Any]) -> str:
    """HAMi's release as the chart labels the DaemonSet (app.kubernetes.io/version, from its appVersion);
    "" when it does not, or the label is not a version."""
    labels = (ds.get("metadata") or {}).get("labels") or {}
    v = labels.get("app.kubernetes.io/version", "")
    ok = isinstance(v, str) and 0 < len(v) <= 64 and all(c.isalnum() or c in ".-+" for c in v)
    return v if ok else ""


def adapt(
    ds: dict[str, Any], original: Mapping[str, Any], s: Mapping[str, str], want: Mapping[str, Any]
) -> None:
    """Apply the settings to one patched DaemonSet (in place); `want`: its vendor's choices (profile,
    plugins, container)."""
    pod = ds["spec"]["template"]["spec"]
    profile = want["profile"]
    plugin_dir = plugins_dir(original, want["container"])
    volumes = by_name(pod["volumes"])
    kubelet_dir = posixpath.dirname(plugin_dir.rstrip("/"))
    volumes["hami-guard-device-plugins"]["hostPath"]["path"] = plugin_dir
    volumes["hami-guard-pod-resources"]["hostPath"]["path"] = posixpath.join(kubelet_dir, "pod-resources")

    inits = by_name(pod.get("initContainers"))
    sidecar = inits["hami-sidecar"]
    for c in (inits["hami-initcheck"], sidecar):
        set_image(c, s)
    if "deviceconfig" not in by_name(original["spec"]["template"]["spec"].get("volumes")):
        sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["name"] != "deviceconfig"]
    glob = s["device-glob"]
    expect = s["expect-devices"] or ("auto" if glob or profile["devices"]["glob"] else "")
    env = {
        "HAMI_GUARD_REGISTRATION_GRACE": s["registration-grace"],
        "HAMI_GUARD_PROBE_INTERVAL": s["probe-interval"],
        "HAMI_GUARD_PROBE_TIMEOUT": s["probe-timeout"],
        # none: no devices check, which the sidecar spells 0; "": absent, at least one healthy device
        "HAMI_GUARD_EXPECT_DEVICES": "0" if expect == "none" else expect,
    }
    kept = [e for e in sidecar["env"] if e["name"] not in env or env[e["name"]]]
    for e in kept:
        if e["name"] in env:
            e["value"] = env[e["name"]]
    extra = {
        "HAMI_GUARD_PLUGIN": want["plugins"],
        "HAMI_GUARD_PLUGIN_CANDIDATES": want["candidates"],
        "HAMI_GUARD_DEVICE_GLOB": glob,
        "HAMI_GUARD_RECOVER_UNHEALTHY_AFTER": s["recover-unhealthy-after"]
        if duration(s["recover-unhealthy-after"])
        else "",
        "HAMI_GUARD_HAMI_VERSION": hami_version(original)
        if s["hami-version"] == "chart"
        else s["hami-version"],
    }
    kept += [{"name": k, "value": v} for k, v in extra.items() if v]  # the sidecar's defaults otherwise
    sidecar["env"] = kept

    plugin = by_name(pod["containers"])[want["container"]]
    live = plugin["livenessProbe"]
    live["periodSeconds"] = int(s["liveness-period"])
    live["failureThreshold"] = int(s["liveness-failures"])
    place_sidecar(pod, sidecar, s)


def set_image(c: dict[str, Any], s: Mapping[str, str]) -> None:
    name = c["image"].rsplit("/", 1)[1].split(":", 1)[0]
    c["image"] = f"{s['registry']}/{name}:{s['tag']}"


def place_sidecar(pod: dict[str, Any], sidecar: dict[str, Any], s: Mapping[str, str]) -> None:
    if s["sidecar"] == "container":  # before Kubernetes 1.29: a plain container beside the plugin
        pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "hami-sidecar"]
        del sidecar["restartPolicy"]
        pod["containers"].append(sidecar)


def vendor_choices(
    ds: Mapping[str, Any], objects: Sequence[Mapping[str, Any]], s: Mapping[str, str]
) -> dict[str, Any]:
    """What one device-plugin DaemonSet is given: its profile, container, port, liveness and plugins."""
    profile = profile_of(ds, s)
    assert profile is not None
    container = plugin_container(ds, profile)
    plugins, candidates = (s["plugin"], "") if s["plugin"] else chart_plugins(ds, objects, profile)
    port = sidecar_port(ds, profile, s)
    return {
        "profile": profile,
        "container": container,
        "port": port,
        "plugins": plugins,
        "candidates": candidates,
        "patch": vendor_patch(profile, container, port, liveness_kind(profile, s)),
    }


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
    if ds.get("kind") != "DaemonSet" or profile_of(ds, s) is not None:
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
    # After the chart's init containers (a driver's chart may wait for the driver's files in one):
    # started last, just before the drivers.
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
        live["periodSeconds"] = int(s["liveness-period"])
        live["failureThreshold"] = int(s["liveness-failures"])
        set_liveness(live, s["liveness"] or "exec", PORT, "/healthz" + (f"?{others}" if others else ""))
        ready = copy.deepcopy(template["readinessProbe"])
        gate = "/readyz?exclude=kubelet&exclude=checkpoint"  # the rollout gate, as for the device plugins
        ready["httpGet"]["path"] = gate + (f"&{others}" if others else "")
        containers[name]["livenessProbe"] = live
        containers[name]["readinessProbe"] = ready
    place_sidecar(pod, sidecar, s)


def component(patches: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """A kustomize Component: each (patch file, target)."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "patches": [{"path": path, "target": dict(target)} for path, target in patches],
    }


def target_of(o: Mapping[str, Any]) -> dict[str, str]:
    """A kustomize target that is exactly this DaemonSet (names are anchored regular expressions)."""
    meta = o.get("metadata") or {}
    found = {"kind": "DaemonSet", "name": re.escape(str(meta.get("name")))}
    if meta.get("namespace"):
        found["namespace"] = re.escape(str(meta["namespace"]))
    return found


def render(text: str, s: Mapping[str, str]) -> str:
    objects = load(text)
    targets = [o for o in objects if profile_of(o, s) is not None]
    dra = {id(o): d for o in objects if (d := dra_drivers(o, s))}
    if not targets and not dra:
        labels = " or ".join(dict.fromkeys(p["chart"]["selector"] for p in candidates(s)))
        raise Refused(
            f"no DaemonSet labelled {labels} (or with pods so labelled) and no DRA kubelet plugin "
            "in the rendered chart: nothing patched (is devicePlugin.enabled false, or is this not HAMi's "
            "chart, a vendor's device-plugin chart nor a DRA driver's? selector=KEY=VALUE names a device "
            "plugin's, dra-driver=CONTAINER=DRIVER a kubelet plugin)"
        )
    named = set(named_drivers(s))
    if unknown := named - {c for d in dra.values() for c in d}:
        raise Refused(f"dra-driver: no DaemonSet has a container named {', '.join(sorted(unknown))}", 2)
    wants = {key(o): vendor_choices(o, objects, s) for o in targets}
    for o in targets:
        plugins_dir(o, wants[key(o)]["container"])
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise Refused("kubectl is not on PATH (its built-in kustomize applies the patch)")
    drivers = {key(o): dra[id(o)] for o in objects if id(o) in dra}
    with tempfile.TemporaryDirectory(prefix="hami-guard-") as tmp:
        work = Path(tmp)
        (work / "rendered.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        components = []
        if targets:  # each device plugin's DaemonSet, its vendor's patch
            (work / "hami-patch").mkdir()
            patches = []
            for i, o in enumerate(targets):
                (work / "hami-patch" / f"patch-{i}.yaml").write_text(yaml.safe_dump(wants[key(o)]["patch"]))
                patches.append((f"patch-{i}.yaml", target_of(o)))
            (work / "hami-patch" / "kustomization.yaml").write_text(yaml.safe_dump(component(patches)))
            components.append("hami-patch")
        if drivers:  # dra.yaml on exactly these DaemonSets
            (work / "dra").mkdir()
            shutil.copy(HERE / "dra.yaml", work / "dra" / "dra.yaml")
            dra_patches = [("dra.yaml", target_of(chart)) for chart in objects if key(chart) in drivers]
            (work / "dra" / "kustomization.yaml").write_text(yaml.safe_dump(component(dra_patches)))
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

    chart = {key(o): o for o in objects}
    done = 0
    for ds in patched:
        if key(ds) in wants:
            adapt(ds, copy.deepcopy(chart[key(ds)]), s, wants[key(ds)])
            done += 1
        elif key(ds) in drivers:
            adapt_dra(ds, copy.deepcopy(chart[key(ds)]), s, drivers[key(ds)])
            done += 1
    if done != len(targets) + len(drivers):
        raise Refused(f"patched {done} of {len(targets) + len(drivers)} DaemonSets")
    return yaml.safe_dump_all(patched, sort_keys=False)


# --- the vendors' kustomize components ---------------------------------------------------------------

COMPONENT_NOTE = """\
# hami-guard's kustomize component for {vendor}'s device plugin: patch.yaml beside it is
# manifests/hami-patch/patch.yaml made that vendor's (its plugin's container, HAMI_GUARD_VENDOR, the
# sidecar's port, the liveness its image can run). Written by `make profiles` (render.py components);
# edit the profile (hami_guard/profiles/{name}.toml) or patch.yaml, not this. Set the images in your
# kustomization as for HAMi's component (README.md#install-on-a-cluster); another label: render.py
# components DIR vendor={name} selector=KEY=VALUE.
"""


def write_component(folder: Path, profile: Mapping[str, Any], s: Mapping[str, str]) -> None:
    """The kustomize component of one vendor (with the settings' selector, port and liveness) in `folder`:
    its DaemonSet by the label where the profile's labels the DaemonSet, else by its name."""
    chart = profile["chart"]
    target: dict[str, str] = {"kind": "DaemonSet"}
    if chart["daemonset"] and not s["selector"]:
        target["name"] = re.escape(chart["daemonset"])
    else:
        target["labelSelector"] = chart["selector"]
    port = int(s["port"] or profile_port(profile))
    patch = vendor_patch(profile, s["container"] or chart["container"], port, liveness_kind(profile, s))
    vendor = profile.get("vendor", profile["name"])
    folder.mkdir(parents=True, exist_ok=True)
    note = COMPONENT_NOTE.format(vendor=vendor, name=profile["name"])
    (folder / "kustomization.yaml").write_text(note + yaml.safe_dump(component([("patch.yaml", target)])))
    (folder / "patch.yaml").write_text(note + yaml.safe_dump(patch, sort_keys=False))


def profile_port(profile: Mapping[str, Any]) -> int:
    """PORT, or the next one the vendor's own containers leave free."""
    return next(p for p in range(PORT, 65536) if p not in set(profile["chart"]["ports"]))


def components(argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """`components FOLDER [KEY=VALUE...]`: every vendor's component but the default's, FOLDER/<vendor>;
    with vendor= or selector=, that one, in FOLDER."""
    if not argv or "=" in argv[0]:
        raise Refused(
            "components: expected a folder, then vendor=, selector=, container=, port=, liveness=", 2
        )
    folder, s = Path(argv[0]), settings(argv[1:], environ, registry=False)
    if s["vendor"] or s["selector"]:
        picked = candidates(s)
        if len(picked) != 1 or (not picked[0]["name"] and not s["container"]):
            raise Refused("components: vendor= (with selector=), or selector= and container=, name one", 2)
        write_component(folder, picked[0], s)
        return
    for name, p in sorted(NAMES.items()):
        if name != DEFAULT_VENDOR:
            write_component(folder / name, dict(p, name=name), s)


def key(o: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    meta = o.get("metadata") or {}
    return (o.get("kind", ""), meta.get("namespace"), meta.get("name"))


def main(argv: Sequence[str]) -> int:
    try:
        if argv[:1] == ["components"]:
            components(argv[1:], os.environ)
            return 0
        s = settings(argv, os.environ)
        sys.stdout.write(render(sys.stdin.read(), s))
    except Refused as e:
        print(f"hami-guard post-renderer: {e}", file=sys.stderr)
        return e.code
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        # A DaemonSet with the label but not a device plugin's shape (a field missing, of another type).
        print(f"hami-guard post-renderer: the DaemonSet is not shaped as expected: {e!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
