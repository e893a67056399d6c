"""HAMi's own registration on its own: the annotation parsers, the `hami:` verdicts on a clock the test
moves, and the settings. The same rules run against a real kube-apiserver with HAMi-shaped writers in
tests/e2e/test_hami_registration.py; here each rule is pinned, the slow ones (HAMi's 30 s loop, the
60 s handshake, the restart budget) included.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from sidecar.config import HAMI_HANDSHAKE, HAMI_REGISTER, parse_settings, read_settings
from sidecar.deviceplugin.naming import physical_devices
from sidecar.hami import annotation as anno
from sidecar.hami.verdicts import (
    CODES,
    HANDSHAKE_EXPIRY,
    RESTART_BUDGET,
    SCHEDULER_TICK,
    HamiEvidence,
    HamiJudge,
    HamiKeys,
)
from sidecar.health import Status
from sidecar.kube.access import KubeconfigError, from_kubeconfig
from sidecar.server.metrics import HAMI_CODES

R = "nvidia.com/gpu"
KEYS = HamiKeys(R, HAMI_REGISTER, HAMI_HANDSHAKE)
G1 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
G2 = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
REPAIR = 60.0


def register(*gpus: tuple[str, bool]) -> str:
    """HAMi's MarshalNodeDevices as Go writes it: omitempty (index 0 and health false are left out)."""
    out = []
    for i, (uuid, healthy) in enumerate(gpus):
        d: dict[str, object] = {
            "id": uuid,
            "count": 10,
            "devmem": 81920,
            "devcore": 100,
            "type": "NVIDIA-A100",
        }
        if i:
            d["index"] = i
        if healthy:
            d["health"] = True
        d["mode"] = "hami-core"
        out.append(d)
    return json.dumps(out, separators=(",", ":"))


def node(
    annotations: dict[str, str] | None = None, allocatable: int | None = 2, boot: str = "b1"
) -> anno.NodeView:
    return anno.NodeView(
        "node-1",
        annotations if annotations is not None else {},
        {} if allocatable is None else {R: allocatable},
        boot,
    )


def splits(*uuids: str, n: int = 3) -> frozenset[str]:
    return frozenset(f"{u}-{i}" for u in uuids for i in range(n))


HS = "Requesting_2026-01-01 00:00:00"
ANNOTATIONS = {HAMI_REGISTER: register((G1, True), (G2, True)), HAMI_HANDSHAKE: HS}
HS = "Requesting_2026-01-01 00:00:00"
ANNOTATIONS = {HAMI_REGISTER: register((G1, True), (G2, True)), HAMI_HANDSHAKE: HS}
HEALTHY = HamiEvidence(
    node=node(ANNOTATIONS),
    boot_id="b1",
    kubelet=splits(G1, G2),
    plugin_ok=True,
    registered_ok=True,
    plugin_id=("sock", 1),
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def judge(clock: Clock) -> HamiJudge:
    return HamiJudge((KEYS,), "node-1", REPAIR, clock)


# -- the parsers ---------------------------------------------------------------------------------------
def test_register_decodes_as_hamis_scheduler_does() -> None:
    r = anno.parse_register(register((G1, True), (G2, False)))
    assert r.gpus is not None and [g.id for g in r.gpus] == [G1, G2]
    assert r.healthy == {G1} and r.ids == {G1, G2}
    assert r.gpus[0].index == 0 and r.gpus[1].index == 1 and r.gpus[0].count == 10
    assert anno.parse_register("null").gpus == ()
    assert anno.parse_register("[]").gpus == ()


@pytest.mark.parametrize(
    "value",
    [
        "",
        "{",
        "{}",
        "NaN",
        '[{"id": 5}]',
        '[{"id": "x", "health": "true"}]',
        '[{"id": "x", "count": 1.5}]',
        '[{"id": "x", "devmem": 4294967296}]',
        '[{"id": "x", "index": -1}]',
        "[1]",
        "[" * 100000,
    ],
)
def test_a_value_go_cannot_decode_is_unparsable(value: str) -> None:
    r = anno.parse_register(value)
    assert r.gpus is None and r.why


def test_a_value_past_the_sidecars_bound_names_the_bound_as_its_own() -> None:
    """Past 1 MiB the value is not decoded: the bound is the sidecar's, not something HAMi refuses."""
    r = anno.parse_register('[{"id": "GPU-x"}' + ", null" * (anno.MAX_VALUE // 6) + "]")
    assert r.gpus is None
    assert r.why == "over hami-guard's own 1 MiB bound: not decoded"


def test_handshakes_of_every_release() -> None:
    assert anno.parse_handshake(None).state == "absent"
    h = anno.parse_handshake("Requesting_2026-12-05 07:00:00")
    assert h.state == "requesting" and h.stamp is not None and h.stamp.hour == 7
    assert anno.parse_handshake("Deleted_2025-01-02 03:04:05").state == "deleted"
    old = anno.parse_handshake("Deleted_2024.01.02 00:00:00")  # up to v2.4
    assert old.state == "deleted" and old.stamp is not None and old.stamp.year == 2024
    assert anno.parse_handshake("Deleted").stamp is None
    assert anno.parse_handshake("something").state == "other"


def test_gpu_of_folds_hamis_splits_only() -> None:
    assert anno.gpu_of(G1) == G1
    assert anno.gpu_of(f"{G1}-7") == G1
    assert anno.gpu_of("MIG-1234") is None
    assert anno.gpu_of("gpu-0") is None
    assert anno.gpu_of(f"{G1}::2") is None
    # the same fold the devices check counts with
    assert physical_devices(splits(G1, G2)) == {G1, G2}


def test_node_is_read_totally() -> None:
    body = {
        "kind": "Node",
        "metadata": {"name": "node-1", "annotations": {HAMI_REGISTER: "[]", "other": "x", "n": 5}},
        "status": {"allocatable": {R: "4", "memory": "10Gi", "x.io/y": "1k"}, "nodeInfo": {"bootID": "b1"}},
    }
    n = anno.parse_node(json.dumps(body).encode(), [HAMI_REGISTER, "n"])
    assert isinstance(n, anno.NodeView)
    assert n.annotations == {HAMI_REGISTER: "[]"} and n.boot_id == "b1"
    assert n.allocatable[R] == 4 and n.allocatable["x.io/y"] is None
    for bad in (b"", b"[]", b'{"kind": "Pod"}', b"\xff", b"1e999999"):
        assert isinstance(anno.parse_node(bad, []), str | anno.NodeView)
    assert isinstance(anno.parse_node(b"x" * (anno.MAX_NODE + 1), []), str)


# -- the verdicts --------------------------------------------------------------------------------------
def test_the_annotation_lists_what_the_kubelet_lists(judge: HamiJudge) -> None:
    v = judge.judge(R, HEALTHY)
    assert v.status is Status.OK and v.code == "ok" and v.gpus == 2
    assert "the 2 healthy GPU(s) the kubelet lists" in v.reason


def test_no_reading_is_no_evidence_never_a_failure(judge: HamiJudge) -> None:
    for why in (
        "the API server answered 403: ...",
        "no ServiceAccount token (...)",
        "did not answer within 2s",
    ):
        v = judge.judge(R, replace(HEALTHY, node=None, why=why))
        assert v.status is Status.OK and v.code == "no_evidence" and not v.restarts
        assert v.reason == f"no evidence: {why}" and v.gpus is None


def test_a_wrong_node_name_is_readiness_only(judge: HamiJudge) -> None:
    v = judge.judge(R, replace(HEALTHY, node=None, not_found=True, why="404"))
    assert v.status is Status.FAILED and v.code == "wrong_node" and not v.restarts
    v = judge.judge(R, replace(HEALTHY, boot_id="another"))
    assert v.status is Status.FAILED and v.code == "wrong_node" and "boot ID" in v.reason and not v.restarts


@pytest.mark.parametrize(
    ("annotations", "kubelet", "code", "words"),
    [
        ({HAMI_HANDSHAKE: HS}, splits(G1, G2), "missing", "is absent"),
        (
            {HAMI_REGISTER: "{broken", HAMI_HANDSHAKE: HS},
            splits(G1, G2),
            "unparsable",
            "does not decode",
        ),
        (
            {HAMI_REGISTER: register((G1, True)), HAMI_HANDSHAKE: HS},
            splits(G1, G2),
            "mismatched",
            f"does not list: {G2}",
        ),
        (
            {HAMI_REGISTER: register((G1, True), (G2, False)), HAMI_HANDSHAKE: HS},
            splits(G1, G2),
            "mismatched",
            "marks unhealthy",
        ),
        (
            {HAMI_REGISTER: register((G1, True), (G2, True)), HAMI_HANDSHAKE: HS},
            splits(G1),
            "mismatched",
            "does not list healthy",
        ),
    ],
)
def test_a_difference_outlasting_hamis_loop_fails_liveness(  # noqa: PLR0917 (the table's columns)
    judge: HamiJudge,
    clock: Clock,
    annotations: dict[str, str],
    kubelet: frozenset[str],
    code: str,
    words: str,
) -> None:
    ev = replace(HEALTHY, node=node(annotations), kubelet=kubelet)
    first = judge.judge(R, ev)
    assert first.status is Status.OK and first.code == "repairing" and words in first.reason
    clock.now += REPAIR - 1
    assert judge.judge(R, ev).code == "repairing"
    clock.now += 1
    v = judge.judge(R, ev)
    assert v.status is Status.FAILED and v.code == code and v.restarts and v.live_failed
    assert "until the plugin restarts" in v.reason


def test_without_hamis_scheduler_the_annotation_decides_nothing(judge: HamiJudge, clock: Clock) -> None:
    # A plugin that is not HAMi's writes no annotation; a node no HAMi scheduler selects has no handshake.
    ev = replace(HEALTHY, node=node({}))
    for _ in range(3):
        v = judge.judge(R, ev)
        assert v.status is Status.OK and v.code == "no_evidence" and "has not handshaken" in v.reason
        clock.now += 10 * REPAIR
    # once the scheduler stamps the node, HAMi's loop is waited for from then on
    assert judge.judge(R, replace(ev, node=node({HAMI_HANDSHAKE: HS}))).code == "repairing"


def test_hamis_own_repair_within_its_loop_fails_nothing(judge: HamiJudge, clock: Clock) -> None:
    stale = replace(
        HEALTHY,
        node=node({**ANNOTATIONS, HAMI_REGISTER: register((G1, True), (G2, True))}),
        kubelet=splits(G1),
    )
    assert judge.judge(R, stale).code == "repairing"
    clock.now += 30
    fixed = replace(stale, node=node({**ANNOTATIONS, HAMI_REGISTER: register((G1, True), (G2, False))}))
    assert judge.judge(R, fixed).code == "ok"
    clock.now += REPAIR
    assert judge.judge(R, stale).code == "repairing"  # a new difference gets the loop again


def test_not_judged_while_the_plugin_does_not_serve_or_register(judge: HamiJudge, clock: Clock) -> None:
    missing = replace(HEALTHY, node=node({HAMI_HANDSHAKE: HS}))
    for ev in (replace(missing, plugin_ok=False), replace(missing, registered_ok=False)):
        clock.now += 10 * REPAIR
        v = judge.judge(R, ev)
        assert v.status is Status.OK and v.code == "no_evidence" and "not judged" in v.reason
    # and the wait starts only once both pass
    assert judge.judge(R, missing).code == "repairing"


def test_a_plugin_restart_gets_hamis_loop_and_the_budget_bounds_restarts(
    judge: HamiJudge, clock: Clock
) -> None:
    ev = replace(HEALTHY, node=node({HAMI_HANDSHAKE: HS}))
    for restart in range(RESTART_BUDGET + 1):
        ev = replace(ev, plugin_id=("sock", restart))
        assert judge.judge(R, ev).code == "repairing", restart  # the new plugin's loop is waited for
        clock.now += REPAIR
        v = judge.judge(R, ev)
        assert v.status is Status.FAILED and v.code == "missing"
        assert judge.restarts_in_vain(R) == restart
        if restart < RESTART_BUDGET:
            assert v.restarts and not v.budget_spent
        else:
            assert not v.restarts and v.budget_spent and "restart budget spent" in v.reason
    # registration seen whole again restores the budget
    assert judge.judge(R, HEALTHY).code == "ok" and judge.restarts_in_vain(R) == 0


def test_the_kubelets_devices_unknown_judges_presence_only(judge: HamiJudge, clock: Clock) -> None:
    ev = replace(HEALTHY, kubelet=None, kubelet_why="pod-resources socket not mounted")
    v = judge.judge(R, ev)
    assert v.code == "ok" and "cannot be read (pod-resources socket not mounted)" in v.reason
    gone = replace(ev, node=node({HAMI_HANDSHAKE: HS}))
    judge.judge(R, gone)
    clock.now += REPAIR
    assert judge.judge(R, gone).code == "missing"


def test_mig_and_other_ids_are_not_compared(judge: HamiJudge) -> None:
    ev = replace(HEALTHY, kubelet=frozenset({"MIG-abc", "MIG-def"}))
    v = judge.judge(R, ev)
    assert v.code == "ok" and "not compared" in v.reason


def test_a_deleted_handshake_that_stays_is_readiness_only(judge: HamiJudge, clock: Clock) -> None:
    ev = replace(HEALTHY, node=node({**ANNOTATIONS, HAMI_HANDSHAKE: "Deleted_2025-01-02 03:04:05"}))
    assert judge.judge(R, ev).code == "ok"  # a current scheduler replaces it within its tick
    clock.now += HANDSHAKE_EXPIRY + SCHEDULER_TICK
    v = judge.judge(R, ev)
    assert v.status is Status.FAILED and v.code == "handshake_deleted" and not v.restarts
    assert f"kubectl annotate node node-1 {HAMI_HANDSHAKE}-" in v.reason


def test_an_expired_request_with_no_allocatable_is_readiness_only(judge: HamiJudge, clock: Clock) -> None:
    annotations = ANNOTATIONS
    for alloc in (0, None):
        ev = replace(HEALTHY, node=node(annotations, allocatable=alloc))
        judge.judge(R, ev)
        clock.now += HANDSHAKE_EXPIRY
        v = judge.judge(R, ev)
        assert v.status is Status.FAILED and v.code == "handshake_expired" and not v.restarts
    # the same stamp with the GPUs allocatable is HAMi's steady state
    assert judge.judge(R, HEALTHY).code == "ok"


def test_the_codes_are_the_metrics() -> None:
    assert CODES == HAMI_CODES


# -- the settings --------------------------------------------------------------------------------------
def test_on_by_default_in_a_pod_off_by_flag_or_variable() -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "NODE_NAME": "node-1"}
    s = parse_settings([], pod)
    assert s.hami_api is not None and s.hami_api.server == "https://10.96.0.1:443"
    assert s.hami_keys() == ((R, HAMI_REGISTER),)
    assert parse_settings(["--no-hami-registration"], pod).hami_api is None
    assert parse_settings([], {**pod, "HAMI_GUARD_HAMI_REGISTRATION": "false"}).hami_api is None
    assert parse_settings([], {}).hami_api is None  # outside a Pod: no API server known
    other = parse_settings(["--plugin", "example.com/dev=dev.sock"], pod)
    assert other.hami_keys() == ()
    given = parse_settings(
        [
            "--plugin",
            "example.com/dev=dev.sock",
            "--hami-annotation",
            "example.com/dev=hami.io/node-x-register",
        ],
        pod,
    )
    assert given.hami_keys() == (("example.com/dev", "hami.io/node-x-register"),)


def test_bad_hami_settings_are_usage_errors() -> None:
    for argv in (
        ["--hami-annotation", "nvidia.com/other=k"],
        ["--hami-annotation", "x"],
        ["--hami-repair", "0"],
    ):
        assert not hasattr(read_settings(argv, {}), "plugins"), argv


def test_kubeconfig_routes(tmp_path: pytest.TempPathFactory) -> None:
    d = str(tmp_path)
    doc = {
        "clusters": [
            {"name": "c", "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority": "ca.crt"}}
        ],
        "users": [{"name": "u", "user": {"client-certificate": "/pki/c.pem", "client-key": "/pki/c.pem"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = os.path.join(d, "kubeconfig")
    with open(path, "w") as f:
        json.dump(doc, f)
    a = from_kubeconfig(path)
    assert a.server == "https://127.0.0.1:6443" and a.ca_file == os.path.join(d, "ca.crt")
    assert a.cert_file == "/pki/c.pem" and a.token_file == ""
    yaml_path = os.path.join(d, "kubeconfig.yaml")
    with open(yaml_path, "w") as f:
        f.write(
            "apiVersion: v1\nclusters:\n- name: c\n  cluster:\n    server: https://h:1\n"
            "users:\n- name: u\n  user:\n    token: t\n"
            "contexts:\n- name: x\n  context: {cluster: c, user: u}\n"
            "current-context: x\n"
        )
    assert from_kubeconfig(yaml_path).token == "t"
    for bad in (
        {},
        {**doc, "current-context": "nope"},
        {**doc, "users": [{"name": "u", "user": {"exec": {}}}]},
    ):
        with open(path, "w") as f:
            json.dump(bad, f)
        with pytest.raises(KubeconfigError):
            from_kubeconfig(path)
    with pytest.raises(KubeconfigError):
        from_kubeconfig(os.path.join(d, "absent"))
