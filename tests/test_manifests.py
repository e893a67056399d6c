"""manifests/ and the Dockerfiles, checked by the tools operators use: kubectl kustomize,
kubernetes-validate, promtool and checkov (installed by `make test` and `.ci/run`)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
TOOLS = ROOT / ".venv-tools" / "bin"
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")  # the oldest and a recent supported release
CRD_KINDS = {"PodMonitor", "PrometheusRule"}  # not in the Kubernetes schemas; promtool checks the rules
RUNBOOK = "https://github.com/hami-guard/hami-guard/blob/main/README.md"  # every alert's runbook_url


def tool(name: str) -> str:
    local = TOOLS / name
    return str(local) if local.exists() else require_tool(name)


def kustomizations() -> list[Path]:
    found = []
    for k in sorted(MANIFESTS.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(k.parent)
    return found


def build(folder: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_every_kustomization_is_found() -> None:
    names = {p.name for p in kustomizations()}
    assert names == {"example-hami", "standalone", "monitoring", "npd"}


@pytest.mark.parametrize("folder", kustomizations(), ids=lambda p: p.name)
def test_kustomization_builds_and_validates_strictly(folder: Path, tmp_path: Path) -> None:
    objects = build(folder)
    assert objects
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    if not core:
        return
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(core))
    for version in KUBERNETES_VERSIONS:
        result = subprocess.run(
            [tool("kubernetes-validate"), "--strict", "--no-warn", "-k", version, str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed for resource") == len(core)


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The validator really is strict: the same DaemonSet with one unknown field fails."""
    (ds,) = [o for o in build(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(ds))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[-1], str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "periodSecond" in result.stdout + result.stderr


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in items}


def test_patch_adds_exactly_hami_guard_and_keeps_everything_else() -> None:
    (original,) = yaml.safe_load_all((MANIFESTS / "example-hami" / "hami-device-plugin.yaml").read_text())
    (patched,) = [o for o in build(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    spec, pod = patched["spec"]["template"]["spec"], original["spec"]["template"]["spec"]

    init = by_name(spec["initContainers"])
    assert list(init) == ["hami-initcheck"]
    assert init["hami-initcheck"]["args"] == ["--wait", "60"]

    containers = by_name(spec["containers"])
    assert set(containers) == {"device-plugin", "vgpu-monitor", "hami-sidecar"}
    plugin = copy.deepcopy(containers["device-plugin"])
    probe = plugin.pop("livenessProbe")
    readiness = plugin.pop("readinessProbe")
    assert plugin == by_name(pod["containers"])["device-plugin"]  # nothing else of HAMi's changed
    assert containers["vgpu-monitor"] == by_name(pod["containers"])["vgpu-monitor"]
    assert probe["httpGet"] == {"path": "/healthz", "port": 9395}
    # Readiness is the whole truth: not ready for a kubelet fault, a lost GPU, a pending registration.
    assert readiness["httpGet"] == {"path": "/readyz", "port": 9395}
    # The sidecar's own probes depend on the sidecar alone.
    for kind in ("livenessProbe", "readinessProbe"):
        assert containers["hami-sidecar"][kind]["httpGet"]["path"] == "/sidecarz"
    # Restarted about a minute after losing its registration: grace + period x threshold.
    sidecar = containers["hami-sidecar"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    grace = float(env["HAMI_GUARD_REGISTRATION_GRACE"])
    assert grace > 30  # HAMi retries a failed Register after 30 s: a healthy plugin is never restarted
    assert 45 <= grace + probe["periodSeconds"] * probe["failureThreshold"] <= 75
    assert probe["timeoutSeconds"] >= 1
    assert probe["successThreshold"] == 1

    mounts = by_name(sidecar["volumeMounts"])
    assert mounts["hami-guard-device-plugins"]["readOnly"] is True
    assert mounts["hami-guard-device-plugins"]["mountPath"] == "/var/lib/kubelet/device-plugins"
    assert mounts["hami-guard-pod-resources"]["readOnly"] is True
    for c in (sidecar, init["hami-initcheck"]):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert set(c["resources"]) == {"requests", "limits"}
    assert "add" not in sidecar["securityContext"]["capabilities"]
    # Only what reading the kubelet's sockets from /proc/<pid>/fd needs.
    assert init["hami-initcheck"]["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    assert sidecar["ports"][0]["containerPort"] == 9395

    volumes = by_name(spec["volumes"])
    added = set(volumes) - set(by_name(pod["volumes"]))
    assert added == {"hami-guard-device-plugins", "hami-guard-pod-resources", "hami-guard-host-dev"}
    for name, volume in by_name(pod["volumes"]).items():
        assert volumes[name] == volume

    # Everything outside the pod's containers and volumes is HAMi's, unchanged.
    def rest(ds: dict[str, Any]) -> dict[str, Any]:
        ds = copy.deepcopy(ds)
        for key in ("initContainers", "containers", "volumes"):
            ds["spec"]["template"]["spec"].pop(key, None)
        return ds

    assert rest(patched) == rest(original)


def test_post_renderer_applies_the_patch_to_chart_output() -> None:
    require_tool("kubectl")
    rendered = (MANIFESTS / "example-hami" / "hami-device-plugin.yaml").read_text()
    other = "---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hami-scheduler-config\ndata: {}\n"
    result = subprocess.run(
        [str(MANIFESTS / "hami-patch" / "post-renderer.sh")],
        input=rendered + other,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    objects = {o["kind"]: o for o in yaml.safe_load_all(result.stdout) if o}
    assert set(objects) == {"DaemonSet", "ConfigMap"}
    (ds,) = [o for o in build(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    assert objects["DaemonSet"] == ds


def test_standalone_example_is_the_patched_daemonset() -> None:
    """The standalone file is HAMi's DaemonSet with the patch applied, plus what it needs around it."""
    (patched,) = [o for o in build(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    standalone = {o["kind"]: o for o in build(MANIFESTS / "standalone")}
    assert standalone["DaemonSet"] == patched
    assert set(standalone) == {"DaemonSet", "ServiceAccount", "NetworkPolicy"}


def rule_groups(tmp_path: Path) -> Path:
    doc = yaml.safe_load((MANIFESTS / "monitoring" / "prometheusrule.yaml").read_text())
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(doc["spec"]))
    return path


def shipped_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MANIFESTS / "monitoring" / "prometheusrule.yaml").read_text())
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def readme_anchors() -> set[str]:
    """The anchors GitHub makes of README.md's headings, and its explicit <a id="...">s."""
    import re

    text = (ROOT / "README.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
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
    assert len(shipped_rules()) == 9


def test_every_alert_names_its_node_and_links_its_fix_in_the_readme() -> None:
    """summary, description and a runbook_url into README.md#monitoring; `node` in every aggregation."""
    import re

    anchors = readme_anchors()
    alerts = [r for r in shipped_rules() if "alert" in r]
    assert alerts
    for rule in alerts:
        notes = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(notes), rule["alert"]
        assert "$labels.node" in notes["summary"], rule["alert"]
        url, _, anchor = notes["runbook_url"].partition("#")
        assert url == RUNBOOK, rule["alert"]
        # A per-check link (HamiDevicePluginCheckFailing) names every check the rule can report.
        wanted = (
            [
                anchor.replace("{{ $labels.check }}", c)
                for c in ("plugin", "registered", "devices", "checkpoint")
            ]
            if "{{" in anchor
            else [anchor]
        )
        for a in wanted:
            assert a in anchors, f"{rule['alert']}: README.md has no #{a}"
        assert rule["labels"]["severity"] in {"warning", "critical"}
    for rule in shipped_rules():
        for by in re.findall(r"\bby \(([^)]*)\)", rule["expr"]):
            assert "node" in [label.strip() for label in by.split(",")], (
                rule.get("alert", rule.get("record")),
                by,
            )


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


def test_checkov_passes_on_manifests_and_dockerfiles(tmp_path: Path) -> None:
    built = []
    for folder in kustomizations():
        path = tmp_path / f"{folder.name}.yaml"
        path.write_text(yaml.safe_dump_all(build(folder)))
        built += ["-f", str(path)]
    result = subprocess.run(
        [
            tool("checkov"),
            "--quiet",
            "--compact",
            "--skip-download",
            "--framework",
            "kubernetes",
            "dockerfile",
            *built,
            "-f",
            str(ROOT / "Dockerfile.init"),
            "-f",
            str(ROOT / "Dockerfile.sidecar"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Failed checks: 0" in result.stdout
    assert "Passed checks:" in result.stdout


def test_every_checkov_skip_is_justified() -> None:
    for path in [
        MANIFESTS / "example-hami" / "hami-device-plugin.yaml",
        ROOT / "Dockerfile.init",
        ROOT / "Dockerfile.sidecar",
    ]:
        for line in path.read_text().splitlines():
            if "checkov" in line and "skip" in line and "CKV" in line:
                reason = line.split("CKV", 1)[1].split("=" if "checkov.io" in line else ":", 1)[1]
                assert len(reason.strip()) > 20, line


def test_metrics_the_rules_use_exist_and_pass_promtool(tmp_path: Path) -> None:
    """A running sidecar's /metrics passes `promtool check metrics` and has every series the rules use."""
    import re

    script = (
        "import asyncio, aiohttp, os, socket, sys, tempfile\n"
        "from sidecar.config import Settings\nfrom sidecar.cli import serve\n"
        "from sidecar.testing import FakeKubelet, FakeDevicePlugin\n"
        "async def main():\n"
        "    d = tempfile.mkdtemp(prefix='hg-'); dp = d + '/dp'; os.mkdir(dp)\n"
        "    s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "    st = Settings(device_plugin_dir=dp, pod_resources_socket=d+'/pr.sock', host='127.0.0.1',\n"
        "                  port=port, expect_devices=-1, device_glob=d + '/nvidia[0-9]*',\n"
        "                  probe_interval=1, probe_timeout=0.5)\n"
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


def test_network_policy_admits_the_prometheus_namespace_only() -> None:
    """Ingress to the plugin's pods: Prometheus' namespace on the metrics ports; the kubelet's probes
    come from the node, which NetworkPolicy does not filter (README.md, "Who reaches the port")."""
    objects = build(MANIFESTS / "standalone")
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    spec = policy["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert sorted(p["port"] for p in rule["ports"]) == [9394, 9395]
    # Helm users apply it alone by this label; nothing else in the file carries it.
    assert [
        o["kind"] for o in objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of")
    ] == ["NetworkPolicy"]


def test_the_stress_goal_is_the_sidecars_memory_limit() -> None:
    from bench.stress import MEMORY_LIMIT_MIB

    (ds,) = [o for o in build(MANIFESTS / "example-hami") if o["kind"] == "DaemonSet"]
    sidecar = by_name(ds["spec"]["template"]["spec"]["containers"])["hami-sidecar"]
    assert sidecar["resources"]["limits"]["memory"] == f"{MEMORY_LIMIT_MIB}Mi"
