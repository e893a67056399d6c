"""The verdicts of sidecar.deviceplugin.verdicts as a table: observations in, checks out; no sockets,
no sleeps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import pytest

from hami_guard.flags import DeviceExpectation, Expect, PluginSpec
from sidecar.deviceplugin.budget import RESTART_BUDGET
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.evidence import (
    NEWEST,
    AfterDeletion,
    KubeletRules,
    PluginEvidence,
    RoundEvidence,
    Rules,
)
from sidecar.deviceplugin.naming import physical_devices
from sidecar.deviceplugin.probes import ProbeResult, Reading, SocketId
from sidecar.deviceplugin.sockets import EVENT_LAG
from sidecar.deviceplugin.verdicts import DevicePluginJudge
from sidecar.health import NO_RESTART, Check, Status
from sidecar.server.views import _line

GPU = "nvidia.com/gpu"
SOCK = "nvidia-gpu.sock"
K1, K2 = SocketId(1, 1_000), SocketId(2, 5_000)  # kubelet.sock before and after a restart
P1, P2, P3 = SocketId(11, 2_000), SocketId(12, 6_000), SocketId(13, 7_000)  # plugin sockets, in order
UUID0 = "GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f"
UUID1 = "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Published:
    """What the judge told the wiring."""

    attempts: int = 0
    successes: list[float] = field(default_factory=list)
    kubelet_restarts: int = 0
    restart_requests: int = 0
    budgets: list[bool] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    connections: int | None = None
    recoveries: list[tuple[str, int]] = field(default_factory=list)

    def attempt_opened(self, resource: str) -> None:
        self.attempts += 1

    def attempt_closed(self, resource: str, latency: float | None) -> None:
        if latency is not None:
            self.successes.append(latency)

    def kubelet_restarted(self) -> None:
        self.kubelet_restarts += 1

    def transition(self, check: Check, old: Status) -> None:
        pass

    def restart_requested(self, resource: str) -> None:
        self.restart_requests += 1

    def budget(self, resource: str, spent: bool) -> None:
        self.budgets.append(spent)

    def devices(self, resource: str, counts: Mapping[str, int]) -> None:
        self.counts = dict(counts)

    def connected(self, resource: str, count: int | None) -> None:
        self.connections = count

    def recovery(self, resource: str, event: str, count: int) -> None:
        self.recoveries.append((event, count))


def alive(identity: SocketId, verified: bool = True) -> ProbeResult:
    return ProbeResult("alive", "answered", 0.001, identity, verified)


def down(state: str, identity: SocketId | None = None) -> ProbeResult:
    return ProbeResult(state, f"{state} here", 0.001, identity)  # type: ignore[arg-type]


@dataclass
class Node:
    """One node's observations, changed step by step by a test."""

    kubelet: ProbeResult = field(default_factory=lambda: alive(K1))
    plugin: ProbeResult = field(default_factory=lambda: alive(P1))
    connections: int | None = 1
    checkpoint: Checkpoint | None = field(
        default_factory=lambda: Checkpoint({GPU: ("GPU-0", "GPU-1")}, 3_000)
    )
    checkpoint_error: str = ""
    pod_resources: dict[str, frozenset[str]] | None = None
    host: int | None = None
    connection_ids: frozenset[int] | None = None  # the kubelet's connections by inode, where told apart
    others: dict[str, SocketId] = field(default_factory=dict)  # other sockets served in the folder
    checkpoint_before: int | None = None  # the checkpoint's time read before the connections
    rules: KubeletRules = NEWEST

    def connect(self, *ids: int) -> None:
        self.connection_ids, self.connections = frozenset(ids), len(ids)

    def round(self) -> RoundEvidence:
        conns = Reading(self.connections) if self.connections is not None else Reading.failed("not visible")
        cp = (
            Reading(self.checkpoint) if self.checkpoint is not None else Reading.failed(self.checkpoint_error)
        )
        pr = Reading(self.pod_resources) if self.pod_resources is not None else Reading.failed("not mounted")
        return RoundEvidence(
            self.kubelet,
            {
                GPU: PluginEvidence(
                    self.plugin, self.plugin.identity, conns, connection_ids=self.connection_ids
                )
            },
            cp,
            pr,
            self.host,
            others=tuple(self.others.items()),
            checkpoint_before=self.checkpoint_before,
            kubelet_rules=self.rules,
        )


def make(grace: float = 60.0, **rules: object) -> tuple[DevicePluginJudge, Clock, Published]:
    clock, seen = Clock(), Published()
    base = Rules(plugins=(PluginSpec(GPU, SOCK),), grace=grace)
    return DevicePluginJudge(replace(base, **rules), seen, clock, clock), clock, seen  # type: ignore[arg-type]


def status(reg: DevicePluginJudge, name: str) -> tuple[str, bool]:
    """(state, whether it fails liveness)."""
    check = reg.state.checks[name]
    return check.status.value, check.live_failed


def reason(reg: DevicePluginJudge, name: str) -> str:
    return reg.state.checks[name].reason


def verdicts(reg: DevicePluginJudge) -> tuple[bool, bool]:
    """(liveness, readiness)."""
    return reg.state.healthy(), reg.state.all_ok()


# -- registration truth ---------------------------------------------------------------------


def test_a_held_plugin_is_registered_live_and_ready() -> None:
    reg, _, seen = make()
    reg.round(Node().round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert "the kubelet holds a connection to nvidia-gpu.sock" in reason(reg, f"registered:{GPU}")
    assert verdicts(reg) == (True, True)
    assert seen.connections == 1


@pytest.mark.parametrize(
    ("case", "checkpoint", "pod_resources"),
    [
        ("zero devices", Checkpoint({GPU: ()}, 3_000), {}),
        ("all unhealthy", Checkpoint({GPU: ()}, 3_000), {GPU: frozenset()}),
    ],
)
def test_zero_or_all_unhealthy_devices_while_held_is_registered(
    case: str, checkpoint: Checkpoint, pod_resources: dict[str, frozenset[str]]
) -> None:
    reg, _, _ = make()
    reg.round(Node(checkpoint=checkpoint, pod_resources=pod_resources).round())
    assert status(reg, f"registered:{GPU}") == ("ok", False), case
    assert verdicts(reg)[0] is True


def test_a_connection_without_a_device_list_recorded_since_the_socket_is_no_registration() -> None:
    """The real kubelet keeps the dial of a Register it refused (kubernetes PR 139338's state)."""
    reg, clock, _ = make(grace=10)
    node = Node(plugin=alive(P2))  # the checkpoint (3_000) predates this plugin socket (6_000)
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    assert "recorded no device list from it" in reason(reg, f"registered:{GPU}")
    clock.now += 10
    reg.refresh()
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    node.checkpoint = Checkpoint({GPU: ()}, 7_000)  # its first ListAndWatch answer, even with no device
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_a_drop_fails_liveness_once_confirmed_saying_the_kubelet_let_go() -> None:
    reg, clock, seen = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.connections = 0  # the kubelet closed its stream; both sockets stay, the plugin keeps serving
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)  # not yet: a kubelet on its way out does this
    assert reg.wake_at() == clock.now + 0.2
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "no longer connected to nvidia-gpu.sock" in reason(reg, f"registered:{GPU}")
    assert "never registered" not in reason(reg, f"registered:{GPU}")
    assert seen.restart_requests == 1
    node.connections = 1  # it came back (a plugin restart re-registered)
    reg.round(node.round())
    assert verdicts(reg) == (True, True)


# -- a connection is not a stream: newer evidence against a held connection --------------------------
def test_a_second_register_the_kubelet_recorded_moves_the_registration_to_its_connection() -> None:
    """Up to 1.36 a second Register on the same socket is accepted: the newest connection carries it."""
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)  # the second Register's dial
    clock.now += 0.01
    reg.round(node.round())
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 4_000)  # its first ListAndWatch answer
    clock.now += 0.5
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert reg.wake_at() is None


def test_the_end_of_the_first_stream_after_a_second_register_is_a_drop_a_restart_mends() -> None:
    """1.36: the first stream's end disconnects the client in the map (the second); the first's
    connection stays with no stream. The registration's own connection closed: a drop."""
    reg, clock, seen = make(drop_confirm=0.2)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 4_000)
    clock.now += 0.01
    reg.round(node.round())
    node.connect(101)  # the second connection closed; the first stays, streamless
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)  # confirmed once first
    assert reg.wake_at() == clock.now + 0.2
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "carried its registration" in reason(reg, f"registered:{GPU}")
    assert seen.restart_requests == 1
    assert reg.wake_at() is None  # confirmed: no busy wake-ups while it stays


def test_a_second_register_the_kubelet_never_recorded_was_refused_and_fails_readiness_only() -> None:
    """1.37: the second Register is refused ("device plugin already connected"), its dial kept, and the
    kubelet forgets the first stream's client too. The first stream still feeds the devices: registered,
    and `kubelet-client:` fails readiness; no plugin restart helps until the kubelet restarts."""
    reg, clock, seen = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)
    clock.now += 1
    reg.round(node.round())
    assert reg.wake_at() == clock.now + 2.0  # the refusal's bound, from the round that first saw it
    clock.now += 1.9
    reg.round(node.round())
    assert status(reg, f"kubelet-client:{GPU}") == ("ok", False)  # a loaded kubelet may record late
    clock.now += 0.1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    assert "refused that Register" in reason(reg, f"kubelet-client:{GPU}")
    assert verdicts(reg) == (True, False)
    assert seen.restart_requests == 0
    # The first stream still runs and pushes a health change: the write is that stream's, not the
    # refused connection's.
    node.checkpoint = Checkpoint({GPU: ("GPU-0",)}, 4_000)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    # The connections it left open close (grpc-go's idle timeout) while the kubelet keeps the endpoint
    # (pod-resources cannot be read here): the path is still refused, no restart.
    node.connect()
    for _ in range(2):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert "refused its later Register" in reason(reg, f"registered:{GPU}")
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    assert seen.restart_requests == 0
    # A kubelet restart is the remedy: a new pair, a new registration.
    node.kubelet, node.checkpoint = alive(K2), Checkpoint({GPU: ("GPU-0", "GPU-1")}, 8_000)
    node.connect(201)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert status(reg, f"kubelet-client:{GPU}") == ("ok", False)


UP_TO_136 = KubeletRules("v1.36.5", "the setting --kubelet-version", refuses_second_register=False)


@pytest.mark.parametrize(
    ("rules", "record_after", "refused"),
    [
        # Up to 1.36 the kubelet accepts a second Register on the path it holds: never a refusal, however
        # late (or never) its record comes.
        pytest.param(UP_TO_136, None, False, id="1.36, never recorded"),
        # 1.37 refuses it unless the old client was gone (its connection closed first): then a record
        # within the bound is an acceptance, however late on a loaded node.
        pytest.param(NEWEST, 1.5, False, id="1.37, the old connection closed, recorded late"),
        pytest.param(NEWEST, None, True, id="1.37, never recorded"),
    ],
)
def test_whether_a_second_register_was_refused_follows_the_kubelets_release_and_its_record(
    rules: KubeletRules, record_after: float | None, refused: bool
) -> None:
    reg, clock, seen = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(rules=rules)
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)
    for step in range(1, 31):
        clock.now += 0.1
        if record_after is not None and step == 3:
            node.connect(102)  # the old stream's end: 1.37 closes its connection, then frees the path
        if record_after is not None and abs(step * 0.1 - record_after) < 1e-9:
            node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 4_000)
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert status(reg, f"kubelet-client:{GPU}") == (("failed" if refused else "ok"), False)
    assert seen.restart_requests == 0
    assert reg.kubelet_rules == rules


def test_a_record_that_landed_before_the_round_that_first_saw_its_connection_counts() -> None:
    """A Register can land between one round's read of the connections and its read of the checkpoint:
    the next round sees the connection first, and the record is already in the checkpoint it read. The
    checkpoint's time read before the connections of the round that did not see it yet decides."""
    reg, clock, _ = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(checkpoint_before=3_000)
    node.connect(101)
    reg.round(node.round())
    # Round 2 read the connections (101 only), then the Register's record landed, then its checkpoint.
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 4_000)
    clock.now += 1
    reg.round(node.round())
    node.connect(102)  # the old connection closed first (1.37 accepts a second Register only then)
    node.checkpoint_before = 4_000
    for _ in range(5):
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"kubelet-client:{GPU}") == ("ok", False)
    assert status(reg, f"registered:{GPU}") == ("ok", False)


@pytest.mark.parametrize(
    ("rules", "pod_resources", "live"),
    [
        # 1.37's stale-endpoint trap: the earlier plugin's stream ended after the kubelet had dropped
        # its client, so the endpoint stays (pod-resources lists its devices healthy) and the new
        # plugin's Register is refused: only a kubelet restart mends it.
        pytest.param(NEWEST, {GPU: frozenset({"GPU-0", "GPU-1"})}, False, id="1.37, endpoint alive"),
        # Up to 1.36 the same evidence is a Register whose list has not come: after the grace, a plugin
        # restart is the remedy.
        pytest.param(UP_TO_136, {GPU: frozenset({"GPU-0", "GPU-1"})}, True, id="1.36"),
        # Nothing listed healthy: no endpoint keeps the path (a hung ListAndWatch), a restart mends it.
        pytest.param(NEWEST, {GPU: frozenset()}, True, id="1.37, no endpoint"),
    ],
)
def test_a_new_plugins_register_refused_for_a_stale_endpoint_never_fails_liveness(
    rules: KubeletRules, pod_resources: dict[str, frozenset[str]], live: bool
) -> None:
    reg, clock, seen = make(grace=5.0, drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(rules=rules, pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    node.connect(101)
    reg.round(node.round())
    # The plugin restarted (a new socket); the kubelet dialled it and recorded nothing since.
    node.plugin, node.pod_resources = alive(P2), pod_resources
    reg.plugin_socket_created(GPU, P2)
    node.connect(301)
    for _ in range(8):
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", live)
    assert seen.restart_requests == (1 if live else 0)
    assert status(reg, f"kubelet-client:{GPU}") == (("ok" if live else "failed"), False)
    if not live:
        assert "phantom capacity" in reason(reg, f"registered:{GPU}")
        assert "until the kubelet restarts" in reason(reg, f"kubelet-client:{GPU}")


def test_after_a_refusal_the_end_of_the_kept_stream_is_phantom_capacity_not_a_drop() -> None:
    """1.37: once refused, the kubelet has no client for the path, so the end of the stream it kept goes
    unnoticed: the endpoint stays with nothing behind it. Not registered, readiness only."""
    reg, clock, seen = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)
    for _ in range(3):
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    node.connect(102)  # the kept stream's connection closed; the refused dial stays
    for _ in range(3):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert "no stream behind them" in reason(reg, f"registered:{GPU}")
    assert seen.restart_requests == 0


def test_a_connection_gone_within_its_confirmation_is_no_refusal() -> None:
    """A connection that comes and goes between two rounds (a dial that lingered) decides nothing."""
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 103)
    clock.now += 0.1
    reg.round(node.round())
    node.connect(101)
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert reg.wake_at() is None


def test_an_unrecorded_connection_that_closes_ends_the_refusal() -> None:
    """The kubelet keeps a refused dial open; one that closes was something else (a probe's connection
    that lingered past the confirmation): the verdict goes with it."""
    reg, clock, _ = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 104)
    clock.now += 0.1
    reg.round(node.round())
    clock.now += 2.0
    reg.round(node.round())
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    node.connect(101)
    clock.now += 0.1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert status(reg, f"kubelet-client:{GPU}") == ("ok", False)


def test_pod_resources_empty_against_a_fresh_checkpoint_outranks_the_connection() -> None:
    """The kubelet marked the devices unhealthy itself (it does so only when it drops the plugin): the
    checkpoint written since the socket was created still records them healthy."""
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node(pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    reg.round(node.round())
    node.pod_resources = {}
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)  # the write may trail the live view
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "pod-resources lists no device" in reason(reg, f"registered:{GPU}")
    node.pod_resources = {GPU: frozenset({"GPU-0", "GPU-1"})}  # registered again
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_pod_resources_empty_with_the_checkpoint_rewritten_empty_is_the_plugins_own_report() -> None:
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node(pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    reg.round(node.round())
    node.pod_resources, node.checkpoint = {}, Checkpoint({GPU: ()}, 4_000)  # all unhealthy, reported
    for _ in range(3):
        clock.now += 0.5
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_a_checkpoint_rewritten_without_the_resource_outranks_the_connection() -> None:
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.checkpoint = Checkpoint({"other.com/dev": ("X",)}, 4_000)
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "no longer lists nvidia.com/gpu" in reason(reg, f"registered:{GPU}")


def test_a_connection_back_within_the_confirmation_is_no_drop() -> None:
    reg, clock, seen = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.connections = 0
    reg.round(node.round())
    node.connections = 1
    clock.now += 0.3
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert reg.wake_at() is None
    assert seen.restart_requests == 0


def test_a_lost_connection_with_a_new_kubelet_sock_is_a_restart_not_a_drop() -> None:
    reg, clock, _ = make(grace=10)
    node = Node()
    reg.round(node.round())
    node.kubelet, node.connections = alive(K2), 0
    clock.now += 5
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    assert reg.kubelet_restarts == 1


def test_never_held_fails_liveness_after_the_grace_when_the_kubelet_is_the_real_one() -> None:
    reg, clock, seen = make(grace=10)
    node = Node(connections=0, checkpoint=None, checkpoint_error="no checkpoint: none written")
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    clock.now += 10
    reg.refresh()
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "holds no connection" in reason(reg, f"registered:{GPU}")
    assert seen.restart_requests == 1


@pytest.mark.parametrize(
    "kubelet",
    [
        down("wrong-service", K1),
        alive(K1, verified=False),  # alive, service not verified
        down("timeout", K1),
    ],
    ids=["wrong service", "unverified", "hung"],
)
def test_a_kubelet_that_is_not_the_real_registration_service_never_restarts_the_plugin(
    kubelet: ProbeResult,
) -> None:
    reg, clock, seen = make(grace=1)
    node = Node(kubelet=kubelet, connections=0)
    for _ in range(3):
        reg.round(node.round())
        clock.now += 1
        reg.refresh()
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert verdicts(reg) == (True, False)
    assert seen.restart_requests == 0


def test_a_missing_kubelet_sock_for_three_graces_restarts_nothing() -> None:
    reg, clock, _ = make(grace=1)
    node = Node()
    reg.round(node.round())
    node.kubelet, node.connections = down("absent"), None
    for _ in range(3):
        clock.now += 1
        reg.round(node.round())
        reg.refresh()
    assert status(reg, "kubelet") == ("failed", False)
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert verdicts(reg) == (True, False)


# -- the restart budget ---------------------------------------------------------------------------


def test_the_restart_budget_stops_liveness_after_three_restarts_in_vain_but_not_for_a_crash() -> None:
    reg, clock, seen = make(grace=1)
    node = Node(connections=0, checkpoint=None, checkpoint_error="no checkpoint")
    reg.round(node.round())
    failures = 0
    for plugin in (P2, P3, SocketId(14, 8_000), SocketId(15, 9_000)):
        clock.now += 1.5
        reg.refresh()
        if not reg.state.healthy():
            failures += 1
        reg.plugin_socket_created(GPU, plugin)  # the kubelet restarted the plugin after the 503s
        node.plugin = alive(plugin)
        reg.round(node.round())
    clock.now += 1.5
    reg.refresh()
    assert failures == RESTART_BUDGET
    assert seen.restart_requests == RESTART_BUDGET
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert "restart budget spent" in reason(reg, f"registered:{GPU}")
    assert seen.budgets == [True]
    assert verdicts(reg) == (True, False)
    node.plugin = down("refused", node.plugin.identity)  # a crash still fails, once confirmed
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("ok", False)  # one failed probe is not yet a verdict
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    node.plugin, node.connections = alive(SocketId(16, 9_500)), 1
    reg.plugin_socket_created(GPU, node.plugin.identity)
    reg.round(node.round())  # registration seen again: the budget is restored
    assert seen.budgets == [True, False]
    assert reg.registration()[GPU]["restart_budget_spent"] is False


# -- restart or crash: a vanished plugin socket ------------------------------------------------------


@pytest.mark.parametrize(
    ("kubelet_now", "refuses", "verdict"),
    [
        (None, False, "restart"),  # kubelet.sock is gone: the cleanup runs before the new one listens
        (K1, True, "restart"),  # the old kubelet's file is left, dead
        (K2, False, "restart"),  # the new kubelet listens already
        (K1, False, "stopped"),  # the same kubelet.sock answers: the plugin went away
    ],
    ids=["kubelet.sock gone", "dead kubelet.sock", "new kubelet.sock", "same kubelet.sock"],
)
def test_a_vanished_plugin_socket_in_either_removal_order(
    kubelet_now: SocketId | None, refuses: bool, verdict: str
) -> None:
    reg, _, _ = make()
    reg.round(Node().round())
    reg.plugin_socket_deleted(GPU)
    seen = AfterDeletion(plugin=None, kubelet=kubelet_now, kubelet_refuses=refuses, listening=False)
    waits = reg.judge_vanished(GPU, seen, restart_window_over=False)
    assert waits is (verdict == "stopped")  # the plugin gets its restart window first
    if waits:
        reg.judge_vanished(GPU, seen, restart_window_over=True)
    expected = ("pending", False) if verdict == "restart" else ("failed", True)
    assert status(reg, f"plugin:{GPU}") == expected
    assert reg.kubelet_restarts == (verdict == "restart")


@pytest.mark.parametrize(
    ("listening", "expected"),
    [
        (True, ("pending", False)),  # its listener is there, unlinked: someone else removed the file
        (False, ("failed", True)),  # the listener closed with the file: the plugin stopped
        # Cannot be told (no sock_diag, or a listener never found): never a crash on that alone.
        (None, ("pending", False)),
    ],
)
def test_a_socket_removed_under_a_plugin_that_still_listens_is_no_crash_however_late_the_kubelet(
    listening: bool | None, expected: tuple[str, bool]
) -> None:
    """On a loaded node a kubelet restart's cleanup can remove the plugin's socket while kubelet.sock
    still looks like the old one: the listener the kernel still holds for the unlinked file says the
    plugin did not stop. Pending for the grace (a plugin restart serves the file again if no kubelet
    restart follows), never a crash verdict on a timing window."""
    reg, clock, _ = make(grace=5.0)
    node = Node()
    reg.round(node.round())
    reg.plugin_socket_deleted(GPU)
    seen = AfterDeletion(plugin=None, kubelet=K1, kubelet_refuses=False, listening=listening)
    if reg.judge_vanished(GPU, seen, restart_window_over=False):
        reg.judge_vanished(GPU, seen, restart_window_over=True)
    node.plugin = ProbeResult("absent", "no such file", 0.001, None)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == expected
    if listening is None:
        assert "cannot be told" in reason(reg, f"plugin:{GPU}")
    if listening is not False:
        assert "still listens" in reason(reg, f"plugin:{GPU}")
        clock.now += 5  # no kubelet restart came within the grace: the plugin's restart serves it again
        reg.round(node.round())
        assert status(reg, f"plugin:{GPU}") == ("failed", True)


def test_a_plugin_that_serves_a_new_socket_within_its_window_is_no_crash() -> None:
    """HAMi removes its socket and serves a new one on every kubelet.sock creation."""
    reg, _, seen = make()
    reg.round(Node().round())
    reg.plugin_socket_deleted(GPU)
    assert reg.judge_vanished(GPU, AfterDeletion(None, K1, False, listening=False), restart_window_over=False)
    reg.judge_vanished(GPU, AfterDeletion(P2, K1, False, listening=False), restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("pending", False)  # a new cycle: the next round probes it
    assert seen.attempts == 1


def test_a_probe_that_saw_the_new_kubelet_first_does_not_turn_the_cleanup_into_a_crash() -> None:
    reg, _, _ = make()
    node = Node()
    reg.round(node.round())
    node.kubelet = alive(K2)  # a round ran between the cleanup and the deletion's verdict
    node.plugin = down("absent")
    reg.plugin_socket_deleted(GPU)
    reg.round(node.round())
    assert not reg.judge_vanished(
        GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=False
    )
    assert status(reg, f"plugin:{GPU}") == ("pending", False)
    assert reg.kubelet_restarts == 1  # the probe counted it; the removal's verdict is the same restart


def test_a_plugin_socket_newer_than_the_answering_kubelet_sock_was_not_removed_by_it() -> None:
    reg, _, _ = make()
    node = Node(kubelet=alive(K2), plugin=alive(P2))  # P2 was created after K2 listened
    reg.round(node.round())
    reg.plugin_socket_deleted(GPU)
    assert reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=False)
    reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("failed", True)


def test_a_kubelet_restart_and_the_new_plugin_socket_are_one_attempt() -> None:
    reg, clock, seen = make()
    node = Node()
    reg.round(node.round())
    reg.kubelet_socket_event("deleted", None)
    reg.plugin_socket_created(GPU, P2)
    node.kubelet, node.plugin = alive(K2), alive(P2)
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 7_000)
    clock.now += 0.05
    reg.round(node.round())
    assert seen.attempts == 1
    assert seen.successes == [pytest.approx(0.05)]
    assert [a.outcome for a in reg.history] == ["registered"]


# -- evidence without the connection view ---------------------------------------------------------------


def test_pod_resources_decides_where_the_connection_cannot_be_seen() -> None:
    reg, _, _ = make()
    node = Node(connections=None, pod_resources={GPU: frozenset({"GPU-0"})})
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    node.pod_resources = {}  # the kubelet marked them unhealthy without a ListAndWatch answer: dropped
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert "it dropped the plugin" in reason(reg, f"registered:{GPU}")


def test_an_empty_fresh_checkpoint_alone_is_no_failure() -> None:
    reg, _, _ = make()
    reg.round(Node(connections=None, checkpoint=Checkpoint({GPU: ()}, 3_000)).round())
    assert status(reg, f"registered:{GPU}")[1] is False


def test_an_unreadable_checkpoint_is_lost_evidence_for_readiness_only() -> None:
    reg, _, _ = make()
    reg.round(Node(checkpoint=None, checkpoint_error="the checkpoint is 50 bytes, over the bound").round())
    assert status(reg, "checkpoint") == ("failed", False)
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert verdicts(reg) == (True, False)


# -- devices ----------------------------------------------------------------------------------------------


def test_physical_devices_fold_hami_splits_and_replicas_only() -> None:
    hami = [f"{UUID0}-{n}" for n in range(10)] + [f"{UUID1}-{n}" for n in range(10)]
    assert physical_devices(hami) == {UUID0, UUID1}
    assert physical_devices([f"{UUID0}::0", f"{UUID0}::1"]) == {UUID0}
    ascend = ["Ascend910B3-0", "Ascend910B3-1"]  # distinct devices that happen to end in -<n>
    assert physical_devices(ascend) == set(ascend)
    assert physical_devices(["MIG-1234", "GPU-0"]) == {"MIG-1234", "GPU-0"}


def test_losing_one_gpu_of_two_under_hami_fails_devices_for_readiness_only() -> None:
    reg, _, seen = make(expect_devices=DeviceExpectation.at_least(2))
    node = Node(pod_resources={GPU: frozenset(f"{u}-{n}" for u in (UUID0, UUID1) for n in range(10))})
    reg.round(node.round())
    assert status(reg, f"devices:{GPU}") == ("ok", False)
    node.pod_resources = {GPU: frozenset(f"{UUID0}-{n}" for n in range(10))}
    reg.round(node.round())
    assert status(reg, f"devices:{GPU}") == ("failed", False)
    assert "lists 1 healthy device(s) by pod-resources, 2 expected" in reason(reg, f"devices:{GPU}")
    assert seen.counts["pod_resources"] == 1
    assert verdicts(reg) == (True, False)


def test_a_stale_checkpoint_count_is_never_reported_after_a_kubelet_restart() -> None:
    reg, _, seen = make(expect_devices=DeviceExpectation.at_least(2))
    node = Node()
    reg.round(node.round())
    assert seen.counts == {"checkpoint": 2}
    node.kubelet = alive(K2)  # the checkpoint (mtime 3_000) predates the new kubelet.sock (5_000)
    reg.round(node.round())
    reg.round(node.round())
    assert "checkpoint" not in seen.counts
    assert status(reg, f"devices:{GPU}")[0] != "ok"


def test_a_round_begun_before_a_kubelet_restart_was_seen_is_dropped() -> None:
    """Its kubelet probe answered before the restart: applied after it, it would end the restart."""
    reg, _, seen = make()
    node = Node()
    reg.round(node.round())
    stale = replace(node.round(), generation=reg.generation)
    reg.plugin_socket_deleted(GPU)
    reg.judge_vanished(
        GPU, AfterDeletion(None, K1, kubelet_refuses=True, listening=False), restart_window_over=False
    )
    assert reg.kubelet_restarts == 1
    reg.round(stale)  # the in-flight round lands: ignored
    node.kubelet = alive(K2)  # the new kubelet answers: the same restart, not a second one
    reg.round(replace(node.round(), generation=reg.generation))
    assert reg.kubelet_restarts == 1
    assert seen.kubelet_restarts == 1


def test_another_plugin_owning_the_socket_never_restarts_ours_through_registered() -> None:
    reg, clock, seen = make(grace=1)
    node = Node(connections=1, plugin=alive(P2))  # connected, but nothing recorded since P2
    judge = PluginEvidence(node.plugin, P2, Reading(1), "elsewhere", "another device plugin serves it")
    for _ in range(3):
        reg.round(replace(node.round(), plugins={GPU: judge}))
        clock.now += 1
        reg.refresh()
    assert status(reg, f"plugin:{GPU}") == ("failed", False)
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert seen.restart_requests == 0


def test_a_held_pair_stays_accepted_whatever_the_file_times_say() -> None:
    """A clock stepped back makes the next checkpoint write look older than the plugin's socket."""
    reg, _, _ = make()
    node = Node()
    reg.round(node.round())
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 1_500)  # before P1 (2_000)
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_a_socket_recreated_with_the_same_identity_gets_its_grace_not_a_drop() -> None:
    reg, clock, _ = make(grace=10, drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    reg.plugin_socket_deleted(GPU)
    reg.plugin_socket_created(GPU, P1)  # inode and mtime repeat within one timestamp tick
    node.connections = 0
    for _ in range(3):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}")[0] == "pending"


def test_checks_never_reported_fail_liveness_only_for_the_plugin_itself() -> None:
    reg, clock, _ = make(grace=1, expect_devices=DeviceExpectation.at_least(2))
    clock.now += 2
    reg.refresh()
    failing = {name for name, c in reg.state.checks.items() if c.live_failed}
    assert failing == {f"plugin:{GPU}", f"registered:{GPU}"}


def test_the_spent_budget_is_announced_when_it_takes_effect() -> None:
    reg, clock, seen = make(grace=1)
    node = Node(connections=0, checkpoint=None, checkpoint_error="no checkpoint")
    reg.round(node.round())
    for plugin in (P2, P3, SocketId(14, 8_000)):
        clock.now += 1.5
        reg.refresh()
        reg.plugin_socket_created(GPU, plugin)
        node.plugin = alive(plugin)
        reg.round(node.round())
    assert seen.budgets == []  # the third restart is not judged yet: its cycle is in its grace
    clock.now += 1.5
    reg.refresh()
    assert seen.budgets == [True]


def test_one_failed_probe_of_an_answering_plugin_is_confirmed_before_liveness_fails() -> None:
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.plugin = down("timeout", P1)  # one stalled call
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("ok", False)
    assert reg.wake_at() == clock.now + 0.2
    node.plugin = alive(P1)  # it answers again: nothing happened
    clock.now += 0.2
    reg.round(node.round())
    assert reg.wake_at() is None
    node.plugin = down("timeout", P1)  # hung for good: two failed probes
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)


# -- devices: on for every registered resource ------------------------------------------------------


@pytest.mark.parametrize("listed", [frozenset(), frozenset({"GPU-0"})], ids=["zero", "one"])
def test_without_an_expectation_devices_wants_one_healthy_device_for_readiness_only(
    listed: frozenset[str],
) -> None:
    reg, clock, _ = make()
    reg.round(Node(pod_resources={GPU: listed}).round())
    clock.now += 61  # past the grace: a count may rise while the plugin's first list comes in
    reg.round(Node(pod_resources={GPU: listed}).round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    if listed:
        assert status(reg, f"devices:{GPU}") == ("ok", False)
        assert verdicts(reg) == (True, True)
    else:
        assert status(reg, f"devices:{GPU}") == ("failed", False)
        assert "lists 0 healthy device(s) by pod-resources, 1 expected" in reason(reg, f"devices:{GPU}")
        assert "--expect-devices 0 opts out" in reason(reg, f"devices:{GPU}")
        assert verdicts(reg) == (True, False)


def test_expect_devices_0_has_no_devices_check() -> None:
    reg, _, _ = make(expect_devices=DeviceExpectation(Expect.OFF))
    reg.round(Node(pod_resources={GPU: frozenset()}).round())
    assert f"devices:{GPU}" not in reg.state.checks
    assert verdicts(reg) == (True, True)


# -- the budget for a socket that never comes back ----------------------------------------------------

VGPU_SOCK = "nvidia-vgpu.sock"


def test_a_socket_served_under_another_name_is_named_and_spends_the_budget_in_three_restarts() -> None:
    reg, clock, seen = make(grace=1)
    node = Node(plugin=down("absent"), connections=0, checkpoint=None, checkpoint_error="no checkpoint")
    node.others = {VGPU_SOCK: SocketId(20, 1)}
    reg.round(node.round())
    clock.now += 1.5
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    why = reason(reg, f"plugin:{GPU}")
    assert "a device plugin serves nvidia-vgpu.sock in the folder instead" in why
    assert "resourceName nvidia.com/<name>: nvidia.com/vgpu" in why
    assert (
        "--plugin nvidia.com/vgpu=nvidia-vgpu.sock, or HAMI_GUARD_PLUGIN=nvidia.com/vgpu=nvidia-vgpu.sock"
        in why
    )
    assert seen.restart_requests == 1
    for n in range(1, RESTART_BUDGET + 1):
        assert not reg.state.healthy()
        node.others = {}  # the plugin's container stops: its socket goes
        reg.round(node.round())
        node.others = {VGPU_SOCK: SocketId(20 + n, 1 + n)}  # and its successor serves the same name
        reg.round(node.round())
        assert reg.registration()[GPU]["restarts_without_registration"] == n
    assert verdicts(reg) == (True, False)
    assert status(reg, f"plugin:{GPU}") == ("failed", False)
    assert reg.state.checks[f"plugin:{GPU}"].no_restart == (
        "restart budget spent: 3 plugin restarts did not bring nvidia-gpu.sock back"
    )
    assert seen.budgets == [True]
    assert reg.registration()[GPU]["socket_found_instead"] == VGPU_SOCK
    assert seen.restart_requests == RESTART_BUDGET
    # A kubelet restart does not mend a setting: the budget stays spent (a registration budget would not).
    node.kubelet = alive(K2)
    reg.round(node.round())
    clock.now += 1.5
    reg.round(node.round())
    assert verdicts(reg) == (True, False)
    assert seen.budgets == [True] and seen.restart_requests == RESTART_BUDGET


def test_another_socket_coming_and_going_spends_nothing_for_a_plugin_that_had_served() -> None:
    reg, clock, _ = make(grace=1)
    node = Node()
    reg.round(node.round())
    node.plugin, node.connections = down("absent"), 0
    reg.plugin_socket_deleted(GPU)  # it stopped: the same kubelet.sock answers
    reg.judge_vanished(GPU, AfterDeletion(None, K1, False, listening=False), restart_window_over=True)
    for n in range(RESTART_BUDGET + 2):
        node.others = {VGPU_SOCK: SocketId(30 + n, n)}
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    assert reg.registration()[GPU]["restarts_without_registration"] == 0


@pytest.mark.parametrize("identity", [P1, None], ids=["event on time", "event after the removal"])
def test_a_plugin_whose_own_socket_came_and_went_between_two_rounds_had_served(
    identity: SocketId | None,
) -> None:
    """Its socket created and removed before any probe caught it answering (a crash soon after start, a
    busy node): its own name was served, so another socket coming and going is no restart of it. Where
    the creation's event is handled after the removal, the file is gone: the event alone tells."""
    reg, clock, seen = make(grace=1)
    node = Node(plugin=down("absent"), connections=0)
    reg.round(node.round())  # started before the plugin: its socket is missing, within the grace
    reg.plugin_socket_created(GPU, identity)  # the event; no round probes it before it goes
    reg.plugin_socket_deleted(GPU)
    reg.judge_vanished(GPU, AfterDeletion(None, K1, False, listening=False), restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("failed", True)  # a crash: at once
    for n in range(RESTART_BUDGET + 2):
        node.others = {VGPU_SOCK: SocketId(30 + n, n)} if n % 2 == 0 else {}
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    assert "instead" not in reason(reg, f"plugin:{GPU}")
    assert reg.registration()[GPU]["restarts_without_registration"] == 0
    assert reg.registration()[GPU]["socket_found_instead"] is None
    assert seen.restart_requests == 0  # none asked for a socket never served


def test_a_missing_socket_with_nothing_else_in_the_folder_spends_nothing() -> None:
    reg, clock, _ = make(grace=1)
    node = Node(plugin=down("absent"), connections=0, checkpoint=None, checkpoint_error="no checkpoint")
    for _ in range(10):
        reg.round(node.round())
        clock.now += 1
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    assert "instead" not in reason(reg, f"plugin:{GPU}")
    assert reg.registration()[GPU]["restarts_without_registration"] == 0


# -- what each [!] line says, state by state --------------------------------------------------------


def _missed_kubelet_restart(reg: DevicePluginJudge, clock: Clock) -> None:
    """The kubelet restarted and removed the plugin's socket; the plugin never served a new one."""
    node = Node()
    reg.round(node.round())
    node.kubelet, node.plugin, node.connections = alive(K2), down("absent"), 0
    reg.round(node.round())
    clock.now += 61
    reg.round(node.round())


def _kubelet_restarting(reg: DevicePluginJudge, clock: Clock) -> None:
    node = Node()
    reg.round(node.round())
    node.kubelet, node.connections = down("absent"), None
    reg.round(node.round())
    clock.now += 61
    reg.round(node.round())


def _unverified_kubelet(reg: DevicePluginJudge, clock: Clock) -> None:
    node = Node(kubelet=alive(K1, verified=False), connections=0)
    reg.round(node.round())
    clock.now += 61
    reg.round(node.round())


def _another_plugin_owns_the_socket(reg: DevicePluginJudge, clock: Clock) -> None:
    obs = PluginEvidence(alive(P1), P1, Reading(0), "elsewhere", "another process listens")
    base = Node().round()
    reg.round(replace(base, plugins={GPU: obs}))
    clock.now += 61
    reg.round(replace(base, plugins={GPU: obs}))


def _budget_spent_never_registering(reg: DevicePluginJudge, clock: Clock) -> None:
    node = Node(connections=0, checkpoint=None, checkpoint_error="no checkpoint")
    reg.round(node.round())
    for plugin in (P2, P3, SocketId(14, 8_000), SocketId(15, 9_000)):
        clock.now += 61
        reg.refresh()
        reg.plugin_socket_created(GPU, plugin)
        node.plugin = alive(plugin)
        reg.round(node.round())
    clock.now += 61
    reg.round(node.round())


def _zero_devices(reg: DevicePluginJudge, clock: Clock) -> None:
    reg.round(Node(pod_resources={GPU: frozenset()}).round())
    clock.now += 61
    reg.round(Node(pod_resources={GPU: frozenset()}).round())


def _renamed(restarts: int) -> Callable[[DevicePluginJudge, Clock], None]:
    """The plugin serves nvidia-vgpu.sock, never its own socket; the kubelet restarted it `restarts` times."""

    def build(reg: DevicePluginJudge, clock: Clock) -> None:
        node = Node(plugin=down("absent"), connections=0, checkpoint=None, checkpoint_error="no checkpoint")
        node.others = {VGPU_SOCK: SocketId(20, 1)}
        reg.round(node.round())
        clock.now += 61
        reg.round(node.round())
        for n in range(1, restarts + 1):
            node.others = {VGPU_SOCK: SocketId(20 + n, 1 + n)}
            reg.round(node.round())

    return build


PLUGIN_ASKS = f"the plugin does not answer: plugin:{GPU} judges that, and the plugin restart it asks for"
OTHER_OWNER = "another device plugin owns the socket: a restart of this one would only fight it"
DEVICES = {
    f"devices:{GPU}": "readiness only: a lost or broken GPU is the node's; a device HAMi marked unhealthy "
    "on a transient fault comes back with a plugin restart: --recover-unhealthy-after"
}
STATES = {
    # state: ({the check: what its [!] line says after "no restart: "}, the checks failing liveness)
    "missed kubelet restart": ({f"registered:{GPU}": PLUGIN_ASKS, **DEVICES}, {f"plugin:{GPU}"}),
    "kubelet restarting": (
        {
            "kubelet": NO_RESTART,
            f"registered:{GPU}": "a kubelet restart: HAMi registers again by itself",
            **DEVICES,
        },
        set(),
    ),
    "unverified kubelet": (
        {f"registered:{GPU}": "the kubelet's socket is not the real registration service"},
        set(),
    ),
    "another plugin owns the socket": (
        {f"plugin:{GPU}": OTHER_OWNER, f"registered:{GPU}": OTHER_OWNER},  # the checkpoint lists two
        set(),
    ),
    "budget spent, never registering": (
        {f"registered:{GPU}": "restart budget spent: 3 plugin restarts did not register it", **DEVICES},
        set(),
    ),
    "zero devices": (DEVICES, set()),
    "renamed, within the budget": ({f"registered:{GPU}": PLUGIN_ASKS, **DEVICES}, {f"plugin:{GPU}"}),
    "renamed, budget spent": (
        {
            f"plugin:{GPU}": "restart budget spent: 3 plugin restarts did not bring nvidia-gpu.sock back",
            f"registered:{GPU}": "restart budget spent: 3 plugin restarts did not register it",
            **DEVICES,
        },
        set(),
    ),
}
BUILDERS = {
    "missed kubelet restart": _missed_kubelet_restart,
    "kubelet restarting": _kubelet_restarting,
    "unverified kubelet": _unverified_kubelet,
    "another plugin owns the socket": _another_plugin_owns_the_socket,
    "budget spent, never registering": _budget_spent_never_registering,
    "zero devices": _zero_devices,
    "renamed, within the budget": _renamed(RESTART_BUDGET - 1),
    "renamed, budget spent": _renamed(RESTART_BUDGET),
}


@pytest.mark.parametrize("state", list(STATES))
def test_each_no_restart_line_says_what_is_true_in_its_state(state: str) -> None:
    """Every `[!]` line of the state, and only those, with its why; never "a plugin restart would not
    mend it" for registration while a plugin restart is what liveness asks for."""
    quiet, live = STATES[state]
    reg, clock, _ = make(expect_devices=DeviceExpectation())
    BUILDERS[state](reg, clock)
    lines = {c.name: _line(reg.state, c) for c in reg.state.checks.values()}
    marked = {name for name, line in lines.items() if line.startswith("[!]")}
    assert marked == set(quiet), lines
    for name, why in quiet.items():
        assert lines[name].startswith(f"[!]{name} failed (no restart: {why}"), lines[name]
    assert reg.state.failed == live, lines
    if live:  # a plugin restart is under way: no registration line may say it would not mend it
        assert all(NO_RESTART not in lines[n] for n in marked if not n.startswith(("kubelet", "checkpoint")))


# -- an unknown count keeps the last trustworthy one: a forged line hides, it never registers -----------
def test_an_unknown_count_after_a_drop_does_not_register_on_the_checkpoint_alone() -> None:
    """A neighbour's made-up /proc/net/unix line makes the count unknown; the kubelet does not rewrite
    its checkpoint on a drop, so the checkpoint alone would read a dropped plugin as registered."""
    reg, clock, seen = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.connections = 0  # dropped
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    assert seen.restart_requests == 1
    node.connections = None  # the count cannot be read; the checkpoint still lists it, no pod-resources
    for _ in range(3):
        clock.now += 1
        reg.round(node.round())
        assert status(reg, f"registered:{GPU}") == ("failed", True)
    why = reason(reg, f"registered:{GPU}")
    assert "the live connection cannot be read: not visible" in why
    assert "the checkpoint recorded it at" in why
    assert "no longer connected to nvidia-gpu.sock" in why
    assert verdicts(reg) == (False, False)
    assert seen.restart_requests == 1  # the same episode
    # Trustworthy again and held (a plugin restart registered it): registered.
    node.plugin, node.checkpoint, node.connections = alive(P2), Checkpoint({GPU: ("GPU-0",)}, 7_000), 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_an_unknown_count_without_pod_resources_is_past_evidence_never_registered() -> None:
    """The kubelet does not rewrite its checkpoint when it drops a plugin, and a neighbour's look-alike
    pair at the plugin's path makes the count unknown: with no pod-resources, nothing live says the
    plugin is held. Never registered on the checkpoint's record (however it was held before, and
    whatever a restart of the sidecar forgot), and no restart either: readiness only."""
    reg, clock, _ = make(drop_confirm=0.2, grace=5)
    node = Node()
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)  # held, by a readable count
    node.connections = None
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", False)  # readiness only
    assert "no live evidence in this layout" in reason(reg, f"registered:{GPU}")
    # A fresh sidecar (no memory of the readings before) says the same.
    fresh, _, _ = make(drop_confirm=0.2, grace=5)
    fresh.round(node.round())
    state, live = status(fresh, f"registered:{GPU}")
    assert state != "ok" and not live
    assert "no live evidence in this layout" in reason(fresh, f"registered:{GPU}")
    # A drop the count could not show: a readable count takes over.
    node.connections = 0
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)


def test_an_unknown_count_after_no_connection_to_a_recorded_pair_keeps_it_not_registered() -> None:
    """Never seen held, no connection while the checkpoint already records the pair: not registered (rule
    1); an unknown count then does not make the checkpoint's old record a registration."""
    reg, clock, _ = make(grace=10)
    node = Node(connections=0)
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    node.connections = None
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    assert "the live connection cannot be read" in reason(reg, f"registered:{GPU}")


def test_an_unknown_count_while_a_register_is_under_way_falls_back_to_the_records() -> None:
    """A connection with no device list yet is a Register under way: its record, when it comes, counts."""
    reg, clock, _ = make(grace=10)
    node = Node(plugin=alive(P2))  # the checkpoint predates the socket
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("pending", False)
    node.connections, node.checkpoint = None, Checkpoint({GPU: ("GPU-0",)}, 7_000)
    node.pod_resources = {GPU: frozenset({"GPU-0"})}
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_an_unknown_count_with_pod_resources_listing_the_devices_is_registered_as_before() -> None:
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.connections = 0
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    node.connections, node.pod_resources = None, {GPU: frozenset({"GPU-0"})}
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


@pytest.mark.parametrize(
    ("pod_resources", "restarts"),
    [
        pytest.param({}, True, id="pod-resources lists no healthy device: the kubelet dropped it"),
        pytest.param(None, False, id="pod-resources not mounted: the 1.37 trap cannot be ruled out"),
    ],
)
def test_a_refusal_ends_with_the_connection_that_showed_it_and_a_drop_then_fails_liveness(
    pod_resources: dict[str, frozenset[str]] | None, restarts: bool
) -> None:
    """A look-alike connection (a neighbour's own namespaces, a tmpfs over the folder, the plugin's path
    bound there) to a dropped plugin: where the kubelet's own view shows the drop (pod-resources lists
    none of the devices it recorded healthy) the drop stands, liveness, before, while and after it stays.
    Where that view cannot be read it reads as a refused second Register, readiness only, also once it
    closes: on 1.37 the kubelet keeps a refused path's endpoint after its dials close, and a restart it
    refuses would be a wrong 503."""
    reg, clock, _ = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(pod_resources=pod_resources)
    node.connect(101)
    reg.round(node.round())
    node.connect()  # dropped
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    node.connect(666)  # the neighbour's connection, counted by path
    clock.now += 1
    reg.round(node.round())
    clock.now += 2.0
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", restarts)
    assert status(reg, f"kubelet-client:{GPU}")[0] == ("ok" if restarts else "failed")
    node.connect()  # the neighbour left
    clock.now += 1
    reg.round(node.round())
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", restarts)
    if not restarts:
        assert "refused its later Register" in reason(reg, f"registered:{GPU}")
        return
    assert "it dropped the plugin" in reason(reg, f"registered:{GPU}")
    assert verdicts(reg)[0] is False
    for _ in range(3):
        clock.now += 5
        reg.round(node.round())
        assert status(reg, f"registered:{GPU}") == ("failed", True)


@pytest.mark.parametrize(
    ("all_reported_unhealthy", "shown"),
    [
        # 1.37's trap: the kubelet refused a second Register, forgot the first stream's client, and
        # keeps the endpoint when the dials close: pod-resources still lists the devices healthy with no
        # stream behind them.
        pytest.param(False, "no stream behind them", id="the kubelet keeps the endpoint"),
        # The plugin had reported every device unhealthy itself: pod-resources lists none, and so does
        # the checkpoint its report rewrote. Nothing says the kubelet dropped it.
        pytest.param(True, "refused its later Register", id="the plugin reported its devices unhealthy"),
    ],
)
def test_a_refused_path_is_no_drop_when_its_dials_close_unless_the_kubelet_marked_the_devices(
    all_reported_unhealthy: bool, shown: str
) -> None:
    """A refused second Register (1.37) whose connections then close: not a drop where nothing shows the
    kubelet dropped the plugin (a plugin restart is refused too): readiness only, no restart asked."""
    reg, clock, seen = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node(pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    node.connect(101)
    reg.round(node.round())
    if all_reported_unhealthy:
        node.pod_resources, node.checkpoint = {}, Checkpoint({GPU: ()}, 4_000)
        clock.now += 1
        reg.round(node.round())
    node.connect(101, 102)
    clock.now += 1
    reg.round(node.round())
    clock.now += 2.0
    reg.round(node.round())
    assert "refused that Register" in reason(reg, f"kubelet-client:{GPU}")
    node.connect()
    for _ in range(3):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", False)
    assert shown in reason(reg, f"registered:{GPU}")
    assert seen.restart_requests == 0


# -- after a kubelet restart: HAMi's answer, or none --------------------------------------------------


def restarted(grace: float = 45.0, **rules: object) -> tuple[DevicePluginJudge, Clock, Published, Node]:
    """A held plugin, then a kubelet restart whose cleanup removed its socket; the new kubelet answers."""
    reg, clock, seen = make(grace=grace, **rules)
    node = Node()
    reg.round(node.round())
    reg.plugin_socket_deleted(GPU)
    reg.judge_vanished(GPU, AfterDeletion(None, None, False, listening=False), restart_window_over=False)
    node.kubelet, node.plugin, node.connections = alive(K2), ProbeResult("absent", "gone", 0.001, None), 0
    clock.now += 0.5
    reg.round(node.round())
    return reg, clock, seen, node


def test_a_plugin_that_served_no_new_socket_after_the_kubelet_restart_missed_it_and_fails_at_once() -> None:
    reg, clock, _, node = restarted()
    assert status(reg, f"plugin:{GPU}") == ("pending", False)
    assert reg.wake_at() == clock.now + 5.0
    clock.now += 4.9
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("pending", False)
    clock.now += 0.1
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)  # not 45 s later: it missed the restart
    assert "missed the kubelet's restart" in reason(reg, f"plugin:{GPU}")


def test_a_hami_start_that_failed_after_the_kubelet_restart_waits_for_its_own_retry() -> None:
    """HAMi served a new socket for the new kubelet, its Register failed, it stopped the plugin (the socket
    went) and retries 30 s later: no restart from us before that retry is due."""
    reg, clock, _, node = restarted()
    reg.plugin_socket_created(GPU, P2)
    clock.now += 0.2
    reg.plugin_socket_deleted(GPU)
    reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=True)
    for _ in range(40):  # 40 s: its 30 s retry is due within the grace
        clock.now += 1
        reg.round(node.round())
        assert status(reg, f"plugin:{GPU}")[1] is False
    assert "a failed start" in reason(reg, f"plugin:{GPU}")
    node.plugin = alive(P3)  # the retry
    reg.plugin_socket_created(GPU, P3)
    node.connect(301)
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 9_000)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("ok", False)
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_a_plugin_not_following_hamis_behaviour_keeps_the_constant_grace() -> None:
    reg, clock, _, node = restarted(grace=45.0, missed_restart_after=0.0)
    clock.now += 30
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("pending", False)


def test_a_plugin_timeout_in_a_round_whose_kubelet_probe_timed_out_too_is_no_hang() -> None:
    """Every probe of a starved node (or a starved sidecar) times out: the plugin is judged hung only in a
    round where kubelet.sock answered in time."""
    reg, clock, seen = make()
    node = Node()
    reg.round(node.round())
    hung = ProbeResult("timeout", "timeout: no answer", 2.0, P1)
    node.kubelet, node.plugin = ProbeResult("timeout", "timeout: no answer", 2.0, K1), hung
    for _ in range(5):
        clock.now += 1
        reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("ok", False)
    assert seen.restart_requests == 0
    node.kubelet = alive(K1)  # the kubelet answers: the plugin alone is slow
    for _ in range(2):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"plugin:{GPU}") == ("failed", True)


def test_on_137_a_connection_that_stays_beside_the_registered_one_is_refused_whatever_was_written() -> None:
    """1.37 disconnects the client it holds before it accepts another Register at that path: a later
    connection that came and stayed beside the one that carried the registration was refused, even where
    the kept stream's own write (a health change, a takeover's first answer) landed just after it came
    and looks like its record."""
    reg, clock, _ = make(drop_confirm=0.2, refusal_confirm=2.0)
    node = Node()
    node.connect(101)
    reg.round(node.round())
    node.connect(101, 102)
    node.checkpoint = Checkpoint({GPU: ("GPU-0",)}, 4_000)  # the kept stream writes a health change
    for _ in range(25):
        clock.now += 0.1
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    assert status(reg, f"kubelet-client:{GPU}") == ("failed", False)
    node.connect(102)  # the kept stream's connection closes: phantom capacity, readiness only
    node.pod_resources = {GPU: frozenset({"GPU-0"})}
    for _ in range(3):
        clock.now += 0.2
        reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", False)


@pytest.mark.parametrize("kubelet_stops", [False, True], ids=["a drop", "a stopping kubelet"])
def test_where_only_a_count_of_zero_is_trusted_a_lost_connection_is_still_confirmed(
    kubelet_stops: bool,
) -> None:
    """The /proc route without the plugin's descriptors trusts no positive count (a look-alike could make
    one) but trusts 0: held by pod-resources, the connections falling to 0 is confirmed once, as any lost
    connection, so a kubelet on its way out (it closes its connections a moment before its socket goes)
    is no drop."""
    reg, clock, seen = make(drop_confirm=0.2)
    node = Node(connections=None, pod_resources={GPU: frozenset({"GPU-0", "GPU-1"})})
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    node.connect()  # 0: trusted
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)  # confirmed once first
    assert reg.wake_at() == clock.now + 0.2
    if kubelet_stops:
        node.kubelet = ProbeResult("absent", "no such file", 0.001, None)
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}")[1] is not kubelet_stops
    assert seen.restart_requests == (0 if kubelet_stops else 1)
    if not kubelet_stops:  # held by its records only: no connection time to tell
        why = reason(reg, f"registered:{GPU}")
        assert "no longer connected to nvidia-gpu.sock: it dropped the plugin" in why, why


def test_a_listener_that_closes_within_the_restart_window_is_a_plugin_that_stopped() -> None:
    """A stopping gRPC server unlinks its socket file a moment before it closes its listener: the listener
    is looked at again when the restart window is over, and gone by then, the plugin stopped."""
    reg, _, _ = make()
    reg.round(Node().round())
    reg.plugin_socket_deleted(GPU)
    first = AfterDeletion(plugin=None, kubelet=K1, kubelet_refuses=False, listening=True)
    assert reg.judge_vanished(GPU, first, restart_window_over=False)
    then = AfterDeletion(plugin=None, kubelet=K1, kubelet_refuses=False, listening=False)
    reg.judge_vanished(GPU, then, restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("failed", True)


def held_after_a_kubelet_restart() -> tuple[DevicePluginJudge, Clock, Node]:
    """A kubelet restart, then HAMi's answer P2, seen held by a round before any of its events."""
    reg, clock, _ = make()
    node = Node()
    reg.round(node.round())
    reg.kubelet_socket_event("deleted", None)  # a kubelet restart
    node.kubelet, node.plugin = alive(K2), alive(P2)
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 7_000)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}")[0] == "ok"
    return reg, clock, node


def judge_past_the_window(reg: DevicePluginJudge) -> None:
    """The deleted socket's verdict under the new kubelet K2, after the restart window where it waits."""
    if reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=False):
        reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=True)


def judged_a_crash(reg: DevicePluginJudge) -> None:
    """The deleted socket's verdict: a crash, at once."""
    judge_past_the_window(reg)
    assert status(reg, f"plugin:{GPU}") == ("failed", True)
    assert "removed while the kubelet kept running" in reason(reg, f"plugin:{GPU}")


def test_a_creation_event_handled_once_its_socket_is_gone_opens_no_new_socket() -> None:
    """On a loaded node the creation event of the socket a round saw first can be handled after the
    plugin crashed (the observer holds events up to 0.5 s to pair moves), even after a round saw the
    socket absent. It is that socket's event: no new socket came and went before the kubelet held it
    (HAMi's failed start, pending), and the crash is judged as one."""
    reg, clock, node = held_after_a_kubelet_restart()
    node.plugin = down("absent")
    clock.now += 1
    reg.round(node.round())  # the crash, seen by a round before its event
    reg.plugin_socket_created(GPU, None)  # P2's creation event, handled now: the file is gone
    reg.plugin_socket_deleted(GPU)
    judged_a_crash(reg)


def test_a_held_socket_whose_events_come_late_is_judged_by_its_own_end() -> None:
    """A round sees the plugin's next socket, and the kubelet holding it, before the events of the
    socket before it and of this one come (the observer holds every event behind a move, such as the
    kubelet's checkpoint write, up to 0.5 s); then it crashes. The older socket's deletion and this
    one's creation open no new cycle: its own deletion is a held socket's crash, failed at once, not
    one that came and went before the kubelet held it (HAMi's failed start, pending)."""
    reg, clock, node = held_after_a_kubelet_restart()
    node.plugin = alive(P3)  # P2 crashed and the plugin came back, seen by a round before any event
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"plugin:{GPU}")[0] == "ok"
    node.plugin = down("absent")  # and P3 crashed
    reg.plugin_socket_deleted(GPU)  # P2's deletion event, handled now
    reg.plugin_socket_created(GPU, None)  # P3's creation event: the file is gone
    reg.plugin_socket_deleted(GPU)  # P3's deletion event
    judged_a_crash(reg)


def held_by_records(reg: DevicePluginJudge, clock: Clock, node: Node, socket: SocketId, records: str) -> None:
    """`socket` served, and judged registered where the kubelet's connections cannot be read (HAMi's
    default layout, or the socket table's read still under way): by pod-resources listing the
    resource's devices, or by a checkpoint written since the socket was made listing `records` (no
    healthy device: pod-resources, read, lists none, and whether it is held cannot be told)."""
    node.plugin, node.connections = alive(socket), None
    reg.plugin_socket_created(GPU, socket)
    if records == "pod-resources":
        node.pod_resources = {GPU: frozenset({"GPU-0", "GPU-1"})}
    else:
        node.pod_resources = {}
        node.checkpoint = Checkpoint({GPU: tuple(records.split())}, socket.mtime_ns + 1_000)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)


def test_a_socket_held_by_the_records_alone_that_goes_is_a_crash_not_a_failed_start() -> None:
    """After the kubelet's restart the records are of the sockets registered with the new kubelet,
    and HAMi's new socket is the first: they name it. It was held, so its end is a crash, failed at
    once, not a socket that came and went before the kubelet held it."""
    reg, clock, _, node = restarted()
    held_by_records(reg, clock, node, P2, "pod-resources")
    assert "pod-resources lists 2 device(s)" in reason(reg, f"registered:{GPU}")
    node.plugin = down("absent")
    assert reg.plugin_socket_deleted(GPU)
    judged_a_crash(reg)


def still_a_failed_start(reg: DevicePluginJudge) -> None:
    """The deleted socket's verdict: HAMi's failed start, pending for the grace."""
    judge_past_the_window(reg)
    assert status(reg, f"plugin:{GPU}") == ("pending", False)
    assert "a failed start" in reason(reg, f"plugin:{GPU}")


def test_a_fresh_checkpoint_listing_no_device_names_no_socket() -> None:
    """The new kubelet restores the resource from its checkpoint with no device, and any write (another
    plugin's registration, a pod's admission) lists it so: registered, since it cannot be told, but no
    sign that the kubelet held this socket. Its end stays HAMi's failed start."""
    reg, clock, _, node = restarted()
    held_by_records(reg, clock, node, P2, "")
    node.plugin = down("absent")
    assert reg.plugin_socket_deleted(GPU)
    still_a_failed_start(reg)


@pytest.mark.parametrize("records", ["pod-resources", ""])
def test_records_name_only_the_first_socket_the_kubelet_held(records: str) -> None:
    """HAMi re-serves a held plugin (its 30 s retry of another plugin, SIGHUP) and the new Register
    fails: the devices listed are the earlier socket's (they linger until its stream ends, and in the
    1.37 trap for good), however many rounds see them. Its end stays HAMi's failed start."""
    reg, clock, _, node = restarted()
    held_by_records(reg, clock, node, P2, records)
    assert reg.plugin_socket_deleted(GPU)  # P2 replaced by P3
    reg.judge_vanished(GPU, AfterDeletion(P3, K2, False, listening=False), restart_window_over=False)
    for _ in range(2):
        held_by_records(reg, clock, node, P3, records)
    node.plugin = down("absent")
    assert reg.plugin_socket_deleted(GPU)
    still_a_failed_start(reg)


def test_after_the_kubelet_held_it_a_new_socket_that_comes_and_goes_is_still_a_failed_start() -> None:
    """HAMi restarts every plugin of its process 30 s after one failed to start (or on SIGHUP): a held
    plugin's socket is replaced too, and when that Register fails HAMi stops it and retries 30 s later
    by itself. Its events come in order: pending for the grace, as after the kubelet's restart."""
    reg, clock, _, node = restarted()
    node.plugin = alive(P2)
    reg.plugin_socket_created(GPU, P2)
    node.connect(201)
    node.checkpoint = Checkpoint({GPU: ("GPU-0", "GPU-1")}, 7_000)
    clock.now += 1
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("ok", False)
    clock.now += 30
    assert reg.plugin_socket_deleted(GPU)  # HAMi's restart: P2 removed, P3 served
    reg.judge_vanished(GPU, AfterDeletion(P3, K2, False, listening=False), restart_window_over=False)
    clock.now += 0.2
    node.plugin = down("absent")  # P3's Register failed: HAMi stops it
    assert reg.plugin_socket_deleted(GPU)
    reg.judge_vanished(GPU, AfterDeletion(None, K2, False, listening=False), restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("pending", False)
    assert "a failed start" in reason(reg, f"plugin:{GPU}")


def test_a_creation_event_that_never_comes_holds_back_no_deletion_for_long() -> None:
    """A round saw a socket before its creation event; a deletion event before that event is an older
    socket's. Where the event is lost (an inotify overflow, the polling observer), deletion events are
    read as they come again after EVENT_LAG."""
    reg, clock, _ = make()
    node = Node()
    reg.round(node.round())
    node.plugin = alive(P2)
    clock.now += 1
    reg.round(node.round())  # P2, seen before its event
    assert not reg.plugin_socket_deleted(GPU)  # P1's deletion event
    clock.now += EVENT_LAG
    assert reg.plugin_socket_deleted(GPU)  # P2's, its creation event lost
    reg.judge_vanished(GPU, AfterDeletion(None, K1, False, listening=False), restart_window_over=True)
    assert status(reg, f"plugin:{GPU}") == ("failed", True)


def test_a_confirmed_drop_asks_for_no_more_rounds() -> None:
    """wake_at is for confirmations to come: once a drop (or a failed probe) is confirmed, a time in the
    past would have the sidecar probe every few milliseconds for as long as the failure lasts."""
    reg, clock, _ = make(drop_confirm=0.2)
    node = Node()
    reg.round(node.round())
    node.connections = 0
    clock.now += 1
    reg.round(node.round())
    assert reg.wake_at() == clock.now + 0.2  # the drop's confirmation
    clock.now += 0.2
    reg.round(node.round())
    assert status(reg, f"registered:{GPU}") == ("failed", True)
    clock.now += 1
    reg.round(node.round())
    wake = reg.wake_at()
    assert wake is None or wake > clock.now
