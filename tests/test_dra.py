"""sidecar.dra.verdicts's judgement on its own: evidence in, verdicts out, on a clock the test moves.

The same rules run against the kubelet's real DRA manager in tests/test_realdra.py and
tests/e2e/test_dra*.py; here each rule is pinned, including the ones the fixture cannot stage
quickly (the 150 s grace, the restart budget).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace

import grpc
import pytest

from sidecar.config import parse_settings
from sidecar.dra import probes as draprobes
from sidecar.dra import slices as draslices
from sidecar.dra import spec as draspec
from sidecar.dra.spec import DEFAULT_GRACE, DraSpec, dra_spec
from sidecar.dra.verdicts import KUBELET_RETRY_CAP, RESTART_BUDGET, DraJudge, Evidence, Info
from sidecar.health import HealthState, Status

DRIVER = "gpu.example.com"
SERVICE = "/var/lib/kubelet/plugins/gpu.example.com/dra.sock"
OK_INFO = Info("ok", "", "DRAPlugin", DRIVER, SERVICE, ("v1.DRAPlugin",))
HELD = Evidence(OK_INFO, (1, 10, 0), SERVICE, (1, 20, 0), True, (1, 30, 0), 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def judge(clock: Clock) -> DraJudge:
    return DraJudge((DRIVER,), DEFAULT_GRACE, clock)


def test_held_is_registered(judge: DraJudge) -> None:
    j = judge.judge(DRIVER, HELD)
    assert j.plugin.status is Status.OK and j.registered.status is Status.OK
    assert "1 connection to" in j.registered.reason


def test_not_held_is_pending_for_the_grace_then_fails_liveness(judge: DraJudge, clock: Clock) -> None:
    ev = replace(HELD, connections=0)
    assert judge.judge(DRIVER, ev).registered.status is Status.PENDING
    clock.now += DEFAULT_GRACE - 1
    assert judge.judge(DRIVER, ev).registered.status is Status.PENDING
    clock.now += 1
    j = judge.judge(DRIVER, ev)
    assert j.registered.live_failed and "not registered" in j.registered.reason


def test_the_grace_covers_the_kubelets_longest_retry() -> None:

    assert DEFAULT_GRACE > KUBELET_RETRY_CAP


def test_a_lost_connection_starts_the_grace_again(judge: DraJudge, clock: Clock) -> None:
    judge.judge(DRIVER, HELD)
    clock.now += 1000
    j = judge.judge(DRIVER, replace(HELD, connections=0))
    assert j.registered.status is Status.PENDING, "a drop is not at once a restart's remedy"
    clock.now += DEFAULT_GRACE
    assert judge.judge(DRIVER, replace(HELD, connections=0)).registered.live_failed


def test_kubelet_down_is_readiness_only_and_a_new_kubelet_restarts_the_grace(
    judge: DraJudge, clock: Clock
) -> None:
    judge.judge(DRIVER, HELD)
    down = replace(HELD, kubelet_up=False, connections=0)
    clock.now += 10 * DEFAULT_GRACE
    j = judge.judge(DRIVER, down)
    assert j.registered.status is Status.FAILED and not j.registered.restarts
    clock.now += 10
    back = replace(HELD, kubelet_id=(1, 31, 0), connections=0)
    assert judge.judge(DRIVER, back).registered.status is Status.PENDING


def test_unseen_connections_are_readiness_only(judge: DraJudge, clock: Clock) -> None:
    clock.now += 10 * DEFAULT_GRACE
    j = judge.judge(DRIVER, replace(HELD, connections=None, connections_why="no hostNetwork"))
    assert j.registered.status is Status.FAILED and not j.registered.restarts
    assert "no hostNetwork" in j.registered.reason


def test_missing_service_socket_fails_after_the_grace(judge: DraJudge, clock: Clock) -> None:
    ev = replace(HELD, service_id=None, connections=0)
    assert judge.judge(DRIVER, ev).registered.status is Status.PENDING
    clock.now += DEFAULT_GRACE
    j = judge.judge(DRIVER, ev)
    assert j.registered.live_failed and "does not exist" in j.registered.reason


def test_another_drivers_socket_is_a_setting_not_a_restart(judge: DraJudge) -> None:
    j = judge.judge(DRIVER, replace(HELD, info=replace(OK_INFO, name="other.example.com"), connections=0))
    assert j.plugin.status is Status.FAILED and not j.plugin.restarts
    assert not j.registered.live_failed


def test_hung_after_two_timeouts_in_a_row(judge: DraJudge) -> None:
    judge.judge(DRIVER, HELD)
    timeout = replace(HELD, info=Info("timeout", "no answer within 2s"))
    assert judge.judge(DRIVER, timeout).plugin.status is Status.PENDING
    j = judge.judge(DRIVER, timeout)
    assert j.plugin.live_failed and "hung" in j.plugin.reason
    # The kubelet still holds it: registered, and the liveness failure is the hang's.
    assert j.registered.status is Status.OK
    assert judge.judge(DRIVER, HELD).plugin.status is Status.OK


def test_a_silent_dra_service_is_pending_then_hung_after_the_grace(judge: DraJudge, clock: Clock) -> None:
    """GetInfo answers, the DRA service does not: readiness at once, liveness only once the silence
    lasted the grace and more than one round saw it."""
    judge.judge(DRIVER, HELD)
    silent = replace(HELD, service_silent_since=clock.now, service_reason="waits")
    j = judge.judge(DRIVER, silent)
    assert j.plugin.status is Status.PENDING and not j.plugin.live_failed, j
    assert j.registered.status is Status.OK  # the kubelet holds it: its truth, not this check's
    clock.now += DEFAULT_GRACE
    j = judge.judge(DRIVER, silent)
    assert j.plugin.live_failed and "hung DRA service" in j.plugin.reason, j
    assert judge.judge(DRIVER, HELD).plugin.status is Status.OK  # an answer ends it


def test_one_round_after_a_jump_is_not_a_hang(judge: DraJudge, clock: Clock) -> None:
    """A call in flight when the clock jumps past the grace: one round's reading is not a hang."""
    judge.judge(DRIVER, HELD)
    since = clock.now
    clock.now += DEFAULT_GRACE + 1
    j = judge.judge(DRIVER, replace(HELD, service_silent_since=since))
    assert j.plugin.status is Status.PENDING, j
    assert judge.judge(DRIVER, HELD).plugin.status is Status.OK
    j = judge.judge(DRIVER, replace(HELD, service_silent_since=since))
    assert j.plugin.status is Status.PENDING, j  # the count starts again after an answer


def test_a_silent_service_without_a_visible_connection_defers_registration(
    judge: DraJudge, clock: Clock
) -> None:
    """A stalled service socket: the kubelet's connection waits in its backlog, invisible in the socket
    table; registration is not judged while the service is silent (no liveness from it)."""
    silent = replace(HELD, connections=0, service_silent_since=clock.now)
    for _ in range(3):
        clock.now += DEFAULT_GRACE
        j = judge.judge(DRIVER, silent)
        assert not j.registered.live_failed, j
    assert j.plugin.live_failed, j


def test_not_answering_at_start_is_pending_then_fails(judge: DraJudge, clock: Clock) -> None:
    ev = replace(HELD, info=Info("absent", "no socket"), registration_id=None, connections=0)
    j = judge.judge(DRIVER, ev)
    assert j.plugin.status is Status.PENDING and not j.registered.live_failed
    clock.now += DEFAULT_GRACE
    j = judge.judge(DRIVER, ev)
    assert j.plugin.live_failed
    assert j.registered.status is Status.FAILED and not j.registered.restarts  # the plugin check's to say


def test_a_stale_socket_fails_at_once_and_a_new_one_gets_the_grace(judge: DraJudge, clock: Clock) -> None:
    judge.judge(DRIVER, HELD)
    stale = replace(HELD, info=Info("refused", "nothing listens"), connections=0)
    assert judge.judge(DRIVER, stale).plugin.live_failed
    clock.now += 5
    refused = Info("refused", "nothing listens")
    starting = replace(HELD, info=refused, registration_id=(1, 11, 0), connections=0)
    assert judge.judge(DRIVER, starting).plugin.status is Status.PENDING


def test_an_orderly_stop_gives_the_next_instance_the_grace(judge: DraJudge, clock: Clock) -> None:
    judge.judge(DRIVER, HELD)
    clock.now += 1000
    gone = replace(
        HELD, info=Info("absent", "no socket"), registration_id=None, service_id=None, connections=0
    )
    j = judge.judge(DRIVER, gone)
    assert j.plugin.status is Status.PENDING and j.registered.status is Status.PENDING
    clock.now += DEFAULT_GRACE
    assert judge.judge(DRIVER, gone).plugin.live_failed


def test_restart_budget(judge: DraJudge, clock: Clock) -> None:
    unheld = replace(HELD, connections=0)

    def instance(n: int) -> bool:
        """A new driver instance that does not get registered: does it fail liveness after the grace?"""
        ev = replace(unheld, registration_id=(1, 100 + n, 0))
        assert judge.judge(DRIVER, ev).registered.status is Status.PENDING
        clock.now += DEFAULT_GRACE
        return judge.judge(DRIVER, ev).registered.live_failed

    for n in range(RESTART_BUDGET):
        assert instance(n), n
        assert judge.restarts_in_vain(DRIVER) == n
    assert not instance(RESTART_BUDGET)
    j = judge.judge(DRIVER, replace(unheld, registration_id=(1, 100 + RESTART_BUDGET, 0)))
    assert j.registered.status is Status.FAILED and "restart budget spent" in j.registered.reason
    # Registered again: the budget is back.
    back = replace(HELD, registration_id=(1, 100 + RESTART_BUDGET, 0))
    assert judge.judge(DRIVER, back).restarts_in_vain == 0


def test_a_new_kubelet_keeps_a_drivers_spent_restart_budget(judge: DraJudge, clock: Clock) -> None:
    """The new kubelet registers the driver itself from plugins_registry: a new grace, but what kept the
    last kubelet from it (a refusal, a folder it does not use) a driver restart does not mend."""
    unheld = replace(HELD, connections=0)
    for n in range(RESTART_BUDGET + 1):
        last = replace(unheld, registration_id=(1, 100 + n, 0))
        judge.judge(DRIVER, last)
        clock.now += DEFAULT_GRACE
        j = judge.judge(DRIVER, last)
    assert not j.registered.live_failed and "restart budget spent" in j.registered.reason, j
    new_kubelet = replace(last, kubelet_id=(1, 31, 0))
    j = judge.judge(DRIVER, new_kubelet)
    assert j.registered.status is Status.PENDING and j.restarts_in_vain == RESTART_BUDGET, j
    clock.now += DEFAULT_GRACE
    j = judge.judge(DRIVER, new_kubelet)
    assert not j.registered.live_failed and "restart budget spent" in j.registered.reason, j


def test_a_socket_bound_again_on_its_path_is_another_file(short_tmp: str) -> None:
    """A driver (or the kubelet) restarted between two rounds removes its socket and binds it again:
    ext4 hands the freed inode number straight back, so (st_dev, st_ino) alone would call it the same
    socket, and the new instance would get no grace and cost no restart from the budget."""
    path = os.path.join(short_tmp, "gpu.example.com-reg.sock")
    ids, inodes = [], []
    for _ in range(2):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
            ids.append(draprobes.socket_file(path))
            inodes.append(os.stat(path).st_ino)
        os.unlink(path)
        time.sleep(0.01)  # a restart takes longer than the clock's tick
    assert None not in ids
    assert ids[0] != ids[1], f"the same socket by identity; inode numbers {inodes}"


def test_healthstate_takes_the_verdict_whole(clock: Clock) -> None:
    state = HealthState(grace=1.0, clock=clock)
    state.add("dra-registered:x")
    state.assign("dra-registered:x", Status.PENDING, "waiting")
    clock.now += 100
    state.refresh()
    state.reset(["dra-registered:x"])
    assert state.checks["dra-registered:x"].status is Status.PENDING, "its own grace, not the state's"
    state.assign("dra-registered:x", Status.FAILED, "no", restarts=True)
    assert not state.healthy()
    state.assign("dra-registered:x", Status.FAILED, "kubelet down", restarts=False)
    assert state.healthy() and not state.all_ok()
    state.assign("dra-registered:x", Status.OK, "held")
    assert state.healthy() and state.all_ok()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("gpu.nvidia.com", "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"),
        ("gpu.nvidia.com=x.sock", "/var/lib/kubelet/plugins_registry/x.sock"),
        ("gpu.nvidia.com=/r/x.sock", "/r/x.sock"),
    ],
)
def test_dra_spec(value: str, expected: str) -> None:
    assert dra_spec(value).registration == expected


@pytest.mark.parametrize("value", ["", "=x.sock", "a/b=x", "a b", "a=x\0y"])
def test_dra_spec_rejects(value: str) -> None:
    with pytest.raises(ValueError, match=r"expected NAME|no NUL"):
        dra_spec(value)


def test_settings_dra_only_and_mixed() -> None:
    s = parse_settings(["--dra-driver", "a.io", "--dra-service", "a.io=/s/dra.sock", "--dra-grace", "200"])
    assert s.plugins == () and s.dra_grace == 200
    assert s.dra_drivers == (
        DraSpec("a.io", "/var/lib/kubelet/plugins_registry/a.io-reg.sock", "/s/dra.sock"),
    )
    s = parse_settings(["--dra-driver", "a.io", "--plugin", "nvidia.com/gpu=nvidia-gpu.sock"])
    assert [p.resource for p in s.plugins] == ["nvidia.com/gpu"]
    env = parse_settings([], {"HAMI_GUARD_DRA_DRIVER": "a.io,b.io=b.sock"})
    assert [d.name for d in env.dra_drivers] == ["a.io", "b.io"]
    for bad in (["--dra-driver", "a.io", "--dra-driver", "a.io"], ["--dra-service", "x.io=/s"]):
        with pytest.raises(SystemExit):
            parse_settings(bad)


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (b"\xff\xff\xff", "error"),  # not a PluginInfo
        (b"", "ok"),  # an empty PluginInfo: no type, no name
    ],
)
async def test_a_hostile_getinfo_answer_is_a_reading_not_an_exception(
    short_tmp: str, answer: bytes, kind: str
) -> None:
    """A registration socket serving raw bytes as GetInfo's answer, over real gRPC."""
    path = os.path.join(short_tmp, "evil-reg.sock")

    async def get_info(_request: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler(
        "pluginregistration.Registration", {"GetInfo": grpc.unary_unary_rpc_method_handler(get_info)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        info = await draprobes.get_info(path, 1.0)
    finally:
        await server.stop(None)
    assert info.kind == kind, info
    j = DraJudge((DRIVER,), DEFAULT_GRACE, Clock()).judge(DRIVER, replace(HELD, info=info, connections=0))
    if kind == "ok":  # an empty answer names no driver: a setting to look at, not a restart
        assert j.plugin.status is Status.FAILED and not j.plugin.restarts


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"[]",
        b'{"items": 3}',
        b'{"items": [null, 1, "x", {"spec": []}, {"spec": {"driver": 7, "nodeName": "n"}}]}',
        b"[" * 100000,
        b"\xff\xfe",
    ],
)
def test_resourceslice_parsing_is_total(body: bytes) -> None:
    got = draslices.parse_slices(body, "n")
    assert got.by_driver is None or got.by_driver == {}, got


def test_resourceslices_of_the_node_by_driver() -> None:
    item = {"spec": {"driver": DRIVER, "nodeName": "n", "devices": [{}, {}]}}
    doc = {
        "items": [
            item,
            item,
            {"spec": {"driver": DRIVER, "nodeName": "other", "devices": [{}]}},
            {"metadata": {"deletionTimestamp": "x"}, "spec": {"driver": DRIVER, "nodeName": "n"}},
            {"spec": {"driver": "b.example.com", "nodeName": "n", "devices": "bad"}},
        ]
    }
    got = draslices.parse_slices(json.dumps(doc).encode(), "n")
    assert got.of(DRIVER) == (2, 4) and got.of("b.example.com") == (1, 0) and got.of("c") == (0, 0)


def test_resourceslices_are_asked_only_when_configured() -> None:
    base = ["--dra-driver", DRIVER]
    assert parse_settings(base, {}).dra_api is None
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert parse_settings(base, env).dra_api is None  # in a Pod, but not asked for
    api = parse_settings([*base, "--dra-resourceslices"], env).dra_api
    assert api is not None and api.server == "https://10.96.0.1:443"
    assert draspec.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}) == (
        "https://[fd00::1]:443"
    )
    for bad in ([], ["--kube-api-server", "http://10.0.0.1:8080"]):
        with pytest.raises(SystemExit):
            parse_settings([*base, "--dra-resourceslices", *bad], {})


async def test_service_probe_readings_over_real_sockets(short_tmp: str) -> None:
    """A listener that never accepts is silent; a server that answers anything (here: no such
    service) answers; no socket is no reading; one call in flight at most."""
    clock = Clock()
    method = draprobes.prepare_path(("v1.DRAPlugin",))
    quiet = os.path.join(short_tmp, "quiet.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(quiet)
    listener.listen(16)  # the kernel completes each connect; nothing reads
    probe = draprobes.ServiceProbe(clock, deadline=30.0)
    try:
        since, why = await probe.read(quiet, method, 0.3)
        assert since == clock.now, why
        task = probe.task
        clock.now += 5
        since, why = await probe.read(quiet, method, 0.3)
        assert since == 100.0 and probe.task is task, why  # the same call, still waiting
    finally:
        probe.close()
        listener.close()
    answering = os.path.join(short_tmp, "answering.sock")
    server = grpc.aio.server()
    server.add_insecure_port(f"unix:{answering}")
    await server.start()
    try:
        since, why = await draprobes.ServiceProbe(clock).read(answering, method, 2.0)
        assert since is None and "UNIMPLEMENTED" in why, why
    finally:
        await server.stop(None)
    since, why = await draprobes.ServiceProbe(clock).read(os.path.join(short_tmp, "none.sock"), method, 0.3)
    assert since is None and "does not exist" in why
    assert draprobes.prepare_path(("v1beta1.DRAPlugin",)).endswith("v1beta1.DRAPlugin/NodePrepareResources")
    assert draprobes.prepare_path(("v1.DRAResourceHealth",)) == ""
