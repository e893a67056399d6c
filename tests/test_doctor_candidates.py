"""hami-doctor --plugin-candidates: on the node, which of several resources this node's plugin serves (one
DaemonSet of Ascend's plugin over nodes of several chips, each serving its own `huawei.com/<commonWord>`
on `<commonWord>.sock`), judged from what the host shows, then that one diagnosed as with --plugin.

Real processes and sockets: hami-doctor is a process (tests/test_doctor.py's `Doctor`), the kubelet and
the plugins are the simulator's (gRPC on Unix sockets in a temporary device-plugins folder), look-alikes
are real sockets (a listener's, a dead one's) and symbolic links.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from doctor.candidates import judge, look_socket
from doctor.settings import parse_settings
from doctor.types import CandidateSocket
from hami_guard.flags import PluginSpec
from testing import FakeDevicePlugin, FakeKubelet
from tests.conftest import require_tool, wait_for
from tests.test_doctor import Doctor, doctor, row, verdicts
from tests.test_monitoring import ASCEND_CHIPS

__all__ = ["doctor"]  # the fixture, imported for the tests below

REPO = Path(__file__).resolve().parents[1]
NPD = REPO / "manifests" / "npd"
OURS = PluginSpec("huawei.com/Ascend310P", "Ascend310P.sock")
OTHER = PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock")
CANDIDATES = ("--vendor", "ascend", "--plugin-candidates", "huawei.com/Ascend910B3=Ascend910B3.sock",
              "--plugin-candidates", "huawei.com/Ascend310P=Ascend310P.sock")  # fmt: skip
NPUS = ("npu0", "npu1")  # as many as the fixture's host device nodes (its --expect-devices auto)

pytestmark = pytest.mark.usefixtures("process_table")


@pytest.fixture
async def kubelet(dp_dir: str, short_tmp: str) -> AsyncIterator[FakeKubelet]:
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as k:
        yield k


@contextlib.asynccontextmanager
async def plugin(kubelet: FakeKubelet, spec: PluginSpec) -> AsyncIterator[FakeDevicePlugin]:
    """This node's plugin serving `spec`, registered, its devices listed by the kubelet."""
    async with FakeDevicePlugin(kubelet.dir, spec.resource, spec.socket, NPUS) as p:
        await wait_for(lambda: kubelet.healthy_devices(spec.resource))
        yield p


@contextlib.contextmanager
def listener(path: str) -> Iterator[socket.socket]:
    """A socket listening at `path` (a process's that is no device plugin)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    try:
        yield s
    finally:
        s.close()


def dead_socket(path: str) -> None:
    """A socket file nothing listens on: bound, then closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)


def mentions(doc: dict[str, object], text: str) -> list[str]:
    """The rows (other than plugin-candidates) any of whose evidence or fixes say `text`."""
    causes = doc["causes"]
    assert isinstance(causes, list)
    return [
        c["id"]
        for c in causes
        if c["id"] != "plugin-candidates" and any(text in line for line in c["evidence"] + c["fix"])
    ]


# --- the command line ------------------------------------------------------------------------------------


def test_candidates_parse_as_the_sidecars_and_never_with_plugin() -> None:
    s = parse_settings(list(CANDIDATES), environ={})
    assert (s.vendor, s.plugins, s.plugin_candidates) == ("ascend", (), (OTHER, OURS))
    both = "huawei.com/Ascend910B3=Ascend910B3.sock, huawei.com/Ascend310P=Ascend310P.sock"
    env = {"HAMI_GUARD_PLUGIN_CANDIDATES": both}
    assert parse_settings([], environ=env).plugin_candidates == (OTHER, OURS)  # the vendor: theirs
    judged = s.judging((OURS,))
    assert (judged.plugins, judged.plugin_candidates) == ((OURS,), ())
    with pytest.raises(ValueError, match="not among the candidates"):
        s.judging((PluginSpec("nvidia.com/gpu", "nvidia-gpu.sock"),))


def test_candidates_with_plugin_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*CANDIDATES, "--plugin", "huawei.com/Ascend310P=Ascend310P.sock"]
    with pytest.raises(SystemExit) as e:
        parse_settings(argv, environ={})
    assert e.value.code == 2
    assert "--plugin-candidates with --plugin" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "doctor", "--npd", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout.startswith("hami-doctor: usage error: --plugin-candidates with --plugin")


# --- what is served: real sockets -----------------------------------------------------------------------


def test_a_link_or_a_dead_socket_is_not_served(short_tmp: str) -> None:
    live = os.path.join(short_tmp, "live.sock")
    with listener(live):
        assert look_socket(live)[0] == "served"
        link = os.path.join(short_tmp, "link.sock")
        os.symlink(live, link)
        assert look_socket(link)[0] == "link"
    dead = os.path.join(short_tmp, "dead.sock")
    dead_socket(dead)
    assert look_socket(dead)[0] == "dead"
    Path(short_tmp, "file.sock").touch()
    assert look_socket(os.path.join(short_tmp, "file.sock"))[0] == "other"
    assert look_socket(os.path.join(short_tmp, "none.sock"))[0] == "absent"


def test_records_decide_only_when_nothing_is_served() -> None:
    absent = CandidateSocket(OTHER, "absent", "")
    listed = CandidateSocket(OURS, "dead", "", listed=2)
    assert judge([absent, listed]).judged == (OURS,)
    assert judge([absent, listed]).decided == "recorded"
    # Two named by the checkpoint: it does not tell which one is this node's.
    both = [
        CandidateSocket(OTHER, "absent", "", checkpointed=True),
        CandidateSocket(OURS, "absent", "", checkpointed=True),
    ]
    assert (judge(both).judged, judge(both).decided) == ((), "none")
    # pod-resources (live) before the checkpoint (history).
    mixed = [
        CandidateSocket(OTHER, "absent", "", checkpointed=True),
        CandidateSocket(OURS, "absent", "", listed=1, checkpointed=True),
    ]
    assert judge(mixed).judged == (OURS,)
    served = [CandidateSocket(OTHER, "absent", "", listed=2), CandidateSocket(OURS, "served", "")]
    assert (judge(served).judged, judge(served).decided) == ((OURS,), "served")


# --- the doctor on a node --------------------------------------------------------------------------------


async def test_the_one_served_is_judged_and_the_other_never_reported_missing(
    doctor: Doctor, kubelet: FakeKubelet
) -> None:
    async with plugin(kubelet, OURS):
        code, doc = await doctor.report(*CANDIDATES)
        npd, line = await doctor.run(*CANDIDATES, "--npd")
    assert (code, doc["most_likely"]) == (0, None), verdicts(doc)
    candidates = row(doc, "plugin-candidates")
    assert candidates["verdict"] == "ok"
    assert candidates["evidence"][0] == "judged huawei.com/Ascend310P: the one candidate served on this node"
    assert any(
        e.startswith("huawei.com/Ascend910B3: Ascend910B3.sock does not exist")
        for e in candidates["evidence"]
    )
    assert "Ascend310P.sock" in " ".join(row(doc, "plugin-not-serving")["evidence"])
    assert mentions(doc, "Ascend910B3") == []  # no row but the candidates' names the other chip
    assert (npd, line.strip()) == (0, "hami-doctor: the device plugin is registered")


async def test_the_variable_gives_the_candidates_too(doctor: Doctor, kubelet: FakeKubelet) -> None:
    env = {"HAMI_GUARD_PLUGIN_CANDIDATES": f"{OTHER.resource}={OTHER.socket},{OURS.resource}={OURS.socket}"}
    async with plugin(kubelet, OURS):
        code, doc = await doctor.report("--vendor", "ascend", env=env)
    assert code == 0, verdicts(doc)
    assert row(doc, "plugin-candidates")["evidence"][0].startswith("judged huawei.com/Ascend310P:")


async def test_none_served_is_one_problem_row_and_npd_nonok(doctor: Doctor, kubelet: FakeKubelet) -> None:
    code, doc = await doctor.report(*CANDIDATES)
    assert (code, doc["most_likely"]) == (1, "plugin-candidates"), verdicts(doc)
    problems = [c for c, v in verdicts(doc).items() if v == "problem"]
    assert problems == ["plugin-candidates"]
    r = row(doc, "plugin-candidates")
    assert r["evidence"][0] == "no plugin serving any of huawei.com/Ascend910B3, huawei.com/Ascend310P"
    assert any("get pods" in f for f in r["fix"])
    # The plugins' rows judge nothing: not "ok".
    assert verdicts(doc)["plugin-not-serving"] == "unknown"
    npd, out = await doctor.run(*CANDIDATES, "--npd")
    (line,) = out.splitlines()
    assert npd == 1
    assert line.startswith("plugin candidates: no plugin serving any of huawei.com/Ascend910B3")


async def test_a_symlinked_or_dead_look_alike_is_not_served(
    doctor: Doctor, kubelet: FakeKubelet, short_tmp: str
) -> None:
    """The other chip's socket path holds a link to a live listener, or a dead socket file: neither is
    served, so nothing is judged without this node's plugin, and only this node's with it."""
    look_alike = os.path.join(doctor.dir, OTHER.socket)
    with listener(os.path.join(short_tmp, "elsewhere.sock")) as live:
        os.symlink(live.getsockname(), look_alike)
        code, doc = await doctor.report(*CANDIDATES)
        assert (code, doc["most_likely"]) == (1, "plugin-candidates"), verdicts(doc)
        assert "symbolic link, not followed" in " ".join(row(doc, "plugin-candidates")["evidence"])
    os.unlink(look_alike)
    dead_socket(look_alike)
    code, doc = await doctor.report(*CANDIDATES)
    assert (code, doc["most_likely"]) == (1, "plugin-candidates"), verdicts(doc)
    assert "nothing listens on" in " ".join(row(doc, "plugin-candidates")["evidence"])
    async with plugin(kubelet, OURS):
        code, doc = await doctor.report(*CANDIDATES)
        assert code == 0, verdicts(doc)
        assert row(doc, "plugin-candidates")["evidence"][0].startswith("judged huawei.com/Ascend310P:")
        assert mentions(doc, "Ascend910B3") == []
        os.unlink(look_alike)
        with listener(os.path.join(short_tmp, "elsewhere-2.sock")) as live:
            os.symlink(live.getsockname(), look_alike)
            code, doc = await doctor.report(*CANDIDATES)
    assert code == 0, verdicts(doc)
    assert row(doc, "plugin-candidates")["evidence"][0].startswith("judged huawei.com/Ascend310P:")
    assert mentions(doc, "Ascend910B3") == []


async def test_several_served_are_each_judged(doctor: Doctor, kubelet: FakeKubelet) -> None:
    async with plugin(kubelet, OURS), plugin(kubelet, OTHER):
        code, doc = await doctor.report(*CANDIDATES)
    assert code == 0, verdicts(doc)
    r = row(doc, "plugin-candidates")
    assert r["verdict"] == "unknown"
    assert r["evidence"][0].startswith(
        "several candidates are served (huawei.com/Ascend910B3, huawei.com/Ascend310P)"
    )
    serving = " ".join(row(doc, "plugin-not-serving")["evidence"])
    assert "Ascend310P.sock" in serving and "Ascend910B3.sock" in serving


async def test_a_dead_plugin_the_kubelet_recorded_is_judged(doctor: Doctor, kubelet: FakeKubelet) -> None:
    """This node's plugin died (its socket gone): the kubelet's records name its resource, so that one is
    judged, and its own row says it does not serve."""
    async with plugin(kubelet, OURS) as p:
        await p.crash(remove_socket=True)
        code, doc = await doctor.report(*CANDIDATES)
    assert (code, doc["most_likely"]) == (1, "plugin-not-serving"), verdicts(doc)
    r = row(doc, "plugin-candidates")
    assert (r["verdict"], r["evidence"][0]) == (
        "ok",
        "none is served now; the kubelet's records name huawei.com/Ascend310P on this node: judged (its rows "
        "below say why it is not served)",
    )
    assert mentions(doc, "Ascend910B3") == []


# --- node-problem-detector's Ascend rule (manifests/npd/ascend) -------------------------------------------


def ascend_rule() -> dict[str, object]:
    config = json.loads((NPD / "ascend" / "hami-guard-monitor.json").read_text())
    (rule,) = config["rules"]
    assert isinstance(rule, dict)
    return rule


def test_the_ascend_rule_passes_the_charts_chips_as_candidates() -> None:
    rule = ascend_rule()
    args = rule["args"]
    assert isinstance(args, list)
    s = parse_settings(args, environ={})
    assert s.npd and s.vendor == "ascend" and not s.plugins
    assert s.plugin_candidates == tuple(PluginSpec(f"huawei.com/{w}", f"{w}.sock") for w in ASCEND_CHIPS)
    main = json.loads((NPD / "hami-guard-monitor.json").read_text())
    ascend = json.loads((NPD / "ascend" / "hami-guard-monitor.json").read_text())
    assert {k: v for k, v in ascend.items() if k != "rules"} == {
        k: v for k, v in main.items() if k != "rules"
    }
    (theirs,) = main["rules"]
    assert {k: v for k, v in rule.items() if k != "args"} == {k: v for k, v in theirs.items() if k != "args"}


def test_the_ascend_component_replaces_the_rule(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        # kustomize takes relative paths only
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(NPD, tmp_path)],
                "components": [os.path.relpath(NPD / "ascend", tmp_path)],
            }
        )
    )
    kubectl = require_tool("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    (cm,) = list(yaml.safe_load_all(done.stdout))
    assert cm["metadata"]["name"] == "hami-guard-npd"
    assert json.loads(cm["data"]["hami-guard-monitor.json"])["rules"][0] == ascend_rule()


async def test_the_ascend_rule_on_a_node_of_one_chip(doctor: Doctor, kubelet: FakeKubelet) -> None:
    """The rule's arguments as NPD runs them, on a 310P node: OK; on a node whose plugin serves nothing,
    NonOK naming the candidates."""
    args = ascend_rule()["args"]
    assert isinstance(args, list)
    code, out = await doctor.run(*args)
    assert code == 1 and out.startswith(
        "plugin candidates: no plugin serving any of huawei.com/Ascend910A"
    ), out
    async with plugin(kubelet, OURS):
        code, out = await doctor.run(*args)
    assert (code, out.strip()) == (0, "hami-doctor: the device plugin is registered")
