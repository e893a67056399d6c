"""The vendors' parts of manifests/monitoring and manifests/network-policy, written from the vendor profiles
(hami_guard/profiles): `make profiles` runs it (`python -m manifests.monitoring.vendors`), and
tests/test_monitoring.py checks that what is committed is its output.

- prometheusrule.yaml: the regions between `# >>> generated: <region>` and `# <<< generated: <region>`,
  the rest of the file is written by hand. `cluster`: the runbook's cluster rule on kube-state-metrics,
  one rule per profile with a node label (`[chart] node_label`, `[resources] capacity`); `unrecoverable`:
  the alert whose fix names each vendor's own command (`[devices] inspect`).
- manifests/network-policy/network-policy.yaml: the default profile's NetworkPolicy; and
  manifests/network-policy/vendors/<vendor>/, one kustomization per other vendor whose pod is not on the
  host's network (`[chart] selector`, `ports`, `host_network`, and the sidecar's port, `free_port`).

kube-state-metrics' names are its own (v2.18.0, internal/store/utils.go): a resource in
kube_node_status_capacity is `SanitizeLabelName`d (every character but a letter, a digit and `_` made
`_`, the case kept: `huawei_com_Ascend910B3`); a node label in kube_node_labels is `label_` and the key
sanitized, then snake-cased and lowercased (`labelName`: `birentech.com` is `label_birentech_com`), and
is there only when --metric-labels-allowlist=nodes=[...] names the key.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from hami_guard.profiles import DEFAULT, NAME, PROFILES, VendorProfile

ROOT = Path(__file__).resolve().parent.parent.parent
RULES = Path("manifests/monitoring/prometheusrule.yaml")
POLICY = Path("manifests/network-policy/network-policy.yaml")
VENDOR_POLICIES = Path("manifests/network-policy/vendors")
ALERT = "HamiGPUNodeWithoutGPUCapacity"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # every namespace has it
PROMETHEUS_NAMESPACE = "monitoring"  # the namespace the policies admit to the sidecar's port: yours to set
BEGIN = "# >>> generated: "
END = "# <<< generated: "


# -- kube-state-metrics' names ---------------------------------------------------------------------------
def node_label(key: str) -> str:
    """kube-state-metrics' name of the node label `key` in kube_node_labels (labelName, toSnakeCase)."""
    sanitized = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return "label_" + re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", sanitized).lower()


def selected(profile: VendorProfile) -> str:
    """The PromQL selector of the nodes the vendor's chart picks: `label_gpu="on"`."""
    key, _, value = profile.chart.node_label.partition("=")
    return f"{node_label(key)}={json.dumps(value)}"


def capacity(profiles: Iterable[VendorProfile]) -> str:
    """The capacity of the profiles' resources, per node (kube-state-metrics' names, unit integer)."""
    expression = "|".join(p.resources.capacity for p in profiles)
    return f'max by (node) (kube_node_status_capacity{{resource=~{json.dumps(expression)}, unit="integer"}})'


def owned(profile: VendorProfile) -> str:
    """A Go (RE2) expression of the profile's resources, as the alerts' `resource` label holds them."""
    head, _, tail = profile.resources.pattern.partition(NAME)
    return f"^{re.escape(head)}(?:{profile.resources.name}){re.escape(tail)}$"


def resource_text(profile: VendorProfile) -> str:
    """The resource in prose: the chart's default, or its pattern where each node registers its own."""
    return (
        profile.shown(profile.resources.pattern) if profile.resources.per_node else profile.resources.default
    )


def resource_note(profile: VendorProfile) -> str:
    """What the prose adds where each node registers the resource of its own device."""
    if not profile.resources.per_node:
        return ""
    return f" (such as {profile.resources.default}: each node registers its own device's)"


def watched() -> tuple[VendorProfile, ...]:
    """The profiles the cluster rule has a rule for: those whose chart picks its nodes by a label."""
    return tuple(p for p in PROFILES if p.chart.node_label)


# -- prometheusrule.yaml's generated regions -------------------------------------------------------------
def command(text: str) -> str:
    """A profile's command as alert text: never a template of its own."""
    if "{{" in text or "}}" in text:
        raise ValueError(f"a command in an alert's text cannot hold {{{{ or }}}}: {text!r}")
    return text


def cluster_rule(profile: VendorProfile, others: tuple[VendorProfile, ...]) -> str:
    label, resource = profile.chart.node_label, resource_text(profile)
    node = "{{ $labels.node }}"
    summary = f"{profile.vendor} node {node} is Ready and schedulable but has no {resource} capacity"
    lines = [
        f"# {profile.vendor}: nodes labelled {label}, resources {resource}.",
        f"- alert: {ALERT}",
        "  expr: |",
        '    max by (node) (kube_node_status_condition{condition="Ready", status="true"}) == 1',
        "    and on (node) max by (node) (kube_node_spec_unschedulable) == 0",
        f"    and on (node) max by (node) (kube_node_labels{{{selected(profile)}}})",
        f"    unless on (node) {capacity([profile])} > 0",
    ]
    if others:
        lines.append(f"    unless on (node) {capacity(others)} > 0")
    lines += [
        "  for: 15m",
        "  labels:",
        "    severity: critical",
        f"    vendor: {profile.name}",
        "  annotations:",
        f"    summary: {json.dumps(summary)}",
        "    description: >-",
        f"      {{{{ $labels.node }}}} carries {label}, the label {profile.vendor}'s device-plugin DaemonSet",
        "      selects its nodes by, is Ready and not cordoned, yet for 15 minutes its status has listed no",
        f"      {resource}{resource_note(profile)}, nor any other vendor's devices: the",
        "      device plugin never registered there, or lost its registration, and Pods cannot get its",
        "      devices. Whether or not hami-guard runs there. Look at kubectl describe node, the plugin's",
        f"      pod on the node, and on the node itself: {command(profile.devices.check)}.",
        '    runbook_url: "docs/runbook.md#hamigpunodewithoutgpucapacity"',
    ]
    return "\n".join(lines) + "\n"


def cluster_group() -> str:
    profiles = watched()
    head = f"""\
# The runbook's detection rule, on kube-state-metrics alone: it fires for a node where the sidecar
# never started. One rule per vendor profile, `vendor` its name: a Ready, schedulable node that carries
# the label the vendor's chart selects its nodes by ([chart] node_label) lists no capacity of the
# vendor's resources ([resources] capacity: kube-state-metrics' sanitized names, unit integer; a resource
# the kubelet dropped reads 0 or is absent), nor of another vendor's (a node that serves another vendor's
# devices is that vendor's, whatever label it carries too). kube_node_labels has a label only when
# kube-state-metrics runs with --metric-labels-allowlist=nodes=[{",".join(label_keys())}]
# (docs/deploy.md#monitoring): a rule whose label is not allowed selects no node, and never fires.
- name: hami-guard.cluster
  rules:
"""
    rules = [cluster_rule(p, tuple(q for q in profiles if q is not p)) for p in profiles]
    return head + "".join(_indent(r, 4) for r in rules)


def label_keys() -> list[str]:
    """The node label keys kube-state-metrics must allow (--metric-labels-allowlist=nodes=[...])."""
    return list(dict.fromkeys(p.chart.node_label.partition("=")[0] for p in watched()))


SUMMARY = (
    "{{ $value }} {{ $labels.resource }} GPU(s) on node {{ $labels.node }} failed again after a plugin "
    "restart re-read them"
)


def unrecoverable_rule() -> str:
    """HamiNodeGPUUnrecoverable: its fix names the command of the vendor whose resource it is."""
    commands = [
        f"{{{{ if match `{owned(p)}` $labels.resource }}}}{command(p.devices.inspect)}" for p in PROFILES
    ]
    chain = "\n      {{- else ".join(c.removeprefix("{{ ") for c in commands)
    return f"""\
- alert: HamiNodeGPUUnrecoverable
  expr: max by (namespace, pod, node, plugin, resource) (device_plugin_unhealthy_devices_unrecoverable) > 0
  for: 1m
  labels:
    severity: warning
  annotations:
    summary: "{SUMMARY}"
    description: >-
      HAMi's device plugin marked {{{{ $value }}}} {{{{ $labels.resource }}}} GPU(s) on {{{{ $labels.node }}}}
      unhealthy, hami-guard ({{{{ $labels.pod }}}}) had the plugin restarted to re-read them, and they
      failed again: not a transient fault but the device or its driver. No more restarts are asked
      for them, and Pods cannot get them. Drain the node, read what failed
      ({{{{ {chain}
      {{{{- else }}}}dmesg, and the vendor's own tool{{{{ end }}}}), then reset or replace the
      device. Which devices: the sidecar's /status (unhealthy_recovery) and hami-doctor.
    runbook_url: "docs/runbook.md#haminodegpuunrecoverable"
"""


REGIONS = {"unrecoverable": unrecoverable_rule, "cluster": cluster_group}


def _indent(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line if line.strip() else line for line in text.splitlines(keepends=True))


def rules(text: str) -> str:
    """prometheusrule.yaml with every generated region written afresh (the rest as it is)."""
    out: list[str] = []
    lines = iter(text.splitlines(keepends=True))
    for line in lines:
        out.append(line)
        if not line.lstrip().startswith(BEGIN):
            continue
        name = line.lstrip()[len(BEGIN) :].split()[0]
        if name not in REGIONS:
            raise ValueError(f"{RULES}: no region {name!r} (known: {', '.join(REGIONS)})")
        indent = len(line) - len(line.lstrip())
        out.append(_indent(REGIONS[name](), indent))
        for skipped in lines:
            if skipped.lstrip().startswith(END + name):
                out.append(skipped)
                break
        else:
            raise ValueError(f"{RULES}: region {name!r} has no end ({END}{name})")
    return "".join(out)


# -- the NetworkPolicies ---------------------------------------------------------------------------------
def policy(profile: VendorProfile) -> dict[str, object]:
    """Prometheus' namespace to the sidecar's port; the vendor's own containers' ports open, as its chart
    leaves them."""
    key, _, value = profile.chart.selector.partition("=")
    ingress: list[dict[str, object]] = [
        {
            "from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: PROMETHEUS_NAMESPACE}}}],
            "ports": [{"protocol": "TCP", "port": profile.free_port()}],
        }
    ]
    if profile.chart.ports:
        ingress.append({"ports": [{"protocol": "TCP", "port": p} for p in profile.chart.ports]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "hami-guard" if profile.default else f"hami-guard-{profile.name}",
            "labels": {"app.kubernetes.io/part-of": "hami-guard"},
        },
        "spec": {
            "podSelector": {"matchLabels": {key: value}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def policy_file(profile: VendorProfile) -> str:
    ports = ", ".join(map(str, profile.chart.ports))
    whose = profile.chart.ports_note or f"{profile.vendor}'s own containers'"
    own = (
        f"{ports} ({whose}): open, as its chart leaves them."
        if ports
        else f"no other port: {profile.vendor}'s containers listen on none."
    )
    own = "\n".join(textwrap.wrap(f"- {own}", 108, initial_indent="# ", subsequent_indent="#   "))
    folder = "manifests/network-policy" + ("" if profile.default else f"/vendors/{profile.name}")
    head = f"""\
# Who reaches {profile.vendor}'s device-plugin pods' ports (docs/deploy.md#who-reaches-the-port). Written by
# `make profiles` (manifests/monitoring/vendors.py) from hami_guard/profiles/{profile.name}.toml: edit that.
# Apply it where the plugin runs ({profile.chart.namespace} by default):
# kubectl apply -n {profile.chart.namespace} -k {folder}
# - {profile.free_port()} (hami-sidecar's /metrics): Prometheus' namespace only. Set the name below to
#   where your Prometheus runs (every namespace has the kubernetes.io/metadata.name label); add a
#   podSelector beside the namespaceSelector to admit its pods only. The sidecar on another port (the
#   post-renderer's port=): that port here too.
{own}
# It selects the plugin's pods by their label, {profile.chart.selector}.
# The kubelet probes from the node itself, and NetworkPolicy does not apply to a pod's own node, so no
# rule names the node. A pod with hostNetwork: true is outside every policy.
"""
    return head + yaml.safe_dump(policy(profile), sort_keys=False)


def vendor_kustomization(profile: VendorProfile) -> str:
    return f"""\
# {profile.vendor}'s NetworkPolicy (network-policy.yaml beside it). Written by `make profiles`
# (manifests/monitoring/vendors.py). No namespace here: apply it where the plugin runs,
# kubectl apply -n {profile.chart.namespace} -k manifests/network-policy/vendors/{profile.name}
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - network-policy.yaml
"""


def policies() -> dict[Path, str]:
    """Every NetworkPolicy file, by its path in the repository (the vendors' folders whole)."""
    out = {POLICY: policy_file(DEFAULT)}
    for p in PROFILES:
        if p.default or p.chart.host_network:
            continue
        out[VENDOR_POLICIES / p.name / "kustomization.yaml"] = vendor_kustomization(p)
        out[VENDOR_POLICIES / p.name / "network-policy.yaml"] = policy_file(p)
    return out


# -- writing -----------------------------------------------------------------------------------------------
def generated(root: Path) -> dict[Path, str]:
    """Every file this module writes under `root`, and its text."""
    return {RULES: rules((root / RULES).read_text()), **policies()}


def write(root: Path, files: Mapping[Path, str]) -> None:
    shutil.rmtree(root / VENDOR_POLICIES, ignore_errors=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else ROOT
    files = generated(root)
    write(root, files)
    print(f"wrote {len(files)} files under {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
