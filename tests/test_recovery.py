"""The recovery of devices HAMi can never mark healthy again (sidecar.deviceplugin.recovery), through the
judge as a table: observations in, the `recover:` check and what is published out; no sockets, no sleeps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hami_guard.flags import DeviceExpectation
from sidecar.config import parse_settings
from sidecar.deviceplugin.budget import RESTART_BUDGET
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.evidence import RoundEvidence
from sidecar.deviceplugin.probes import Reading
from sidecar.deviceplugin.recovery import RecoveryEvidence
from sidecar.server.views import _line
from tests.test_registration import GPU, P1, UUID0, UUID1, Node, alive, make, reason, status

RECOVER = f"recover:{GPU}"
AFTER = 60.0
SPLIT0 = frozenset(f"{UUID0}-{n}" for n in range(2))
SPLIT1 = frozenset(f"{UUID1}-{n}" for n in range(2))
BOTH = SPLIT0 | SPLIT1


class Host:
    """The recovery's evidence: who holds what (pod-resources List), the driver's GPUs, device nodes."""

    def __init__(self) -> None:
        self.held: dict[str, str] | None = {}
        self.uuids: frozenset[str] | None = frozenset({UUID0, UUID1})
        self.nodes: int | None = 2

    def evidence(self) -> RecoveryEvidence:
        pods = (
            Reading({GPU: dict(self.held)}) if self.held is not None else Reading.failed("UNAVAILABLE: down")
        )
        driver = Reading(self.uuids) if self.uuids is not None else Reading.failed("no /proc/driver/nvidia")
        return RecoveryEvidence(pods, driver, self.nodes)


class Rig:
    """A judge with --recover-unhealthy-after, one plugin holding two GPUs split in two, and the clock."""

    def __init__(self, after: float = AFTER, **rules: object) -> None:
        self.reg, self.clock, self.seen = make(recover_unhealthy_after=after, **rules)  # type: ignore[arg-type]
        self.node = Node(pod_resources={GPU: BOTH})
        self.host = Host()
        self.plugin = P1
        self.checkpoint_at = 3_000

    def round(self, listed: frozenset[str] | None = None) -> None:
        if listed is not None:  # the kubelet rewrites its checkpoint with each list: healthy devices only
            self.node.pod_resources = {GPU: listed}
            self.node.checkpoint = Checkpoint({GPU: tuple(sorted(listed))}, self.checkpoint_at)
        seen: RoundEvidence = replace(self.node.round(), recovery=self.host.evidence())
        self.reg.round(seen)

    def later(self, seconds: float, listed: frozenset[str] | None = None) -> None:
        self.clock.now += seconds
        self.round(listed)

    def restart_plugin(self) -> None:
        """What liveness asks for: the plugin serves a new socket and the kubelet records its new list."""
        self.plugin = replace(self.plugin, ino=self.plugin.ino + 1, mtime_ns=self.plugin.mtime_ns + 10_000)
        self.checkpoint_at = self.plugin.mtime_ns + 1
        self.reg.plugin_socket_created(GPU, self.plugin)
        self.node.plugin = alive(self.plugin)
        listed = (self.node.pod_resources or {}).get(GPU, frozenset())
        self.node.checkpoint = Checkpoint({GPU: tuple(sorted(listed))}, self.checkpoint_at)

    @property
    def live(self) -> bool:
        return self.reg.state.healthy()

    def line(self) -> str:
        return _line(self.reg.state, self.reg.state.checks[RECOVER])


def test_off_by_default_there_is_no_recover_check() -> None:
    reg, _, _ = make()
    reg.round(Node(pod_resources={GPU: BOTH}).round())
    assert RECOVER not in reg.state.checks
    assert reg.recovery() == {}


def test_a_transient_unhealthy_gpu_gets_one_restart_and_comes_back() -> None:
    rig = Rig()
    rig.round()
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert reason(rig.reg, RECOVER) == "every device the kubelet listed healthy is listed healthy"
    rig.later(1, SPLIT1)  # an XID: HAMi marks GPU 0 unhealthy, the kubelet lists GPU 1 alone
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert f"{UUID0} not listed healthy since" in reason(rig.reg, RECOVER)
    assert "(60s left)" in reason(rig.reg, RECOVER)
    rig.later(AFTER - 1)
    assert rig.live
    rig.later(1)
    assert status(rig.reg, RECOVER) == ("failed", True)
    assert not rig.live
    assert "the NVIDIA driver still lists them: HAMi never marks a device healthy again" in reason(
        rig.reg, RECOVER
    )
    assert rig.seen.recoveries == [("restart", 1)]
    rig.later(10)  # liveness keeps asking until the plugin restarts, counted once
    assert not rig.live and rig.seen.recoveries == [("restart", 1)]
    rig.restart_plugin()
    assert status(rig.reg, RECOVER) == ("pending", False)
    rig.later(1, BOTH)  # the new plugin re-read GPU 0: healthy again
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert rig.live
    assert reason(rig.reg, RECOVER) == f"brought back by a plugin restart: {UUID0}"
    assert rig.seen.recoveries == [("restart", 1), ("recovered", 1)]
    doc = rig.reg.recovery()[GPU]
    assert doc["restarts"] == 1 and list(doc["recovered"]) == [UUID0] and not doc["really_unhealthy"]


@pytest.mark.parametrize("when", ["at once", "an hour later"])
def test_a_gpu_unhealthy_again_after_its_restart_is_really_unhealthy_and_gets_no_more(when: str) -> None:
    rig = Rig()
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER)
    assert not rig.live
    rig.restart_plugin()
    if when == "an hour later":
        rig.later(1, BOTH)
        rig.later(3600)
    rig.later(1, SPLIT1)  # XID again
    rig.later(AFTER - 1)
    assert status(rig.reg, RECOVER)[0] == "ok"
    rig.later(1)
    assert status(rig.reg, RECOVER) == ("failed", False)
    assert rig.live
    assert rig.line().startswith(
        f"[!]{RECOVER} failed (no restart: the GPU is really unhealthy: it failed again after the plugin "
        "restart that re-read it; no more restarts for it): "
        f"{UUID0} unhealthy again after the plugin restart that re-read it: the GPU is really unhealthy"
    )
    rig.later(3600)
    assert rig.live
    restarts = [e for e in rig.seen.recoveries if e[0] == "restart"]
    assert restarts == [("restart", 1)]
    assert rig.seen.recoveries[-1] == ("unrecoverable", 1)
    doc = rig.reg.recovery()[GPU]
    assert list(doc["really_unhealthy"]) == [UUID0] and doc["restarts_in_vain"] == 1
    # The other GPU still gets its own restart.
    rig.later(1, frozenset())
    rig.later(AFTER)
    assert status(rig.reg, RECOVER) == ("failed", True)
    assert f"{UUID1} not listed healthy" in reason(rig.reg, RECOVER)


def test_a_gpu_a_running_pod_holds_is_never_taken_by_a_restart() -> None:
    rig = Rig()
    rig.host.held = {f"{UUID0}-1": "ml/train-0", f"{UUID1}-0": "ml/infer-3"}
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER * 10)
    assert rig.live
    assert status(rig.reg, RECOVER) == ("failed", False)
    assert rig.line().startswith(
        f"[!]{RECOVER} failed (no restart: a running pod holds a device not listed healthy ({UUID0} by "
        "ml/train-0): a restart waits until none does)"
    )
    assert rig.seen.recoveries == []
    rig.host.held = {f"{UUID1}-0": "ml/infer-3"}  # the pod ended; the healthy GPU's does not matter
    rig.later(1)
    assert status(rig.reg, RECOVER) == ("failed", True)


def test_no_restart_while_pod_resources_list_cannot_be_read() -> None:
    rig = Rig()
    rig.host.held = None
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER)
    assert rig.live and status(rig.reg, RECOVER) == ("failed", False)
    assert "pod-resources List cannot be read (UNAVAILABLE: down)" in rig.line()


def test_a_gpu_the_host_no_longer_shows_was_removed_and_gets_no_restart() -> None:
    rig = Rig()
    rig.round()
    rig.host.uuids = frozenset({UUID1})  # fell off the bus: the driver no longer lists it
    rig.later(1, SPLIT1)
    rig.later(AFTER)
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert "the NVIDIA driver no longer lists them: removed, not unhealthy" in reason(rig.reg, RECOVER)


def test_without_the_hosts_devices_unhealthy_cannot_be_told_from_removed() -> None:
    rig = Rig()
    rig.host.uuids, rig.host.nodes = None, None
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER)
    assert rig.live and status(rig.reg, RECOVER) == ("failed", False)
    assert "unhealthy cannot be told from removed" in rig.line()


@pytest.mark.parametrize(("nodes", "asks"), [(2, True), (1, False)])
def test_ids_that_are_no_uuid_are_told_by_the_hosts_device_nodes(nodes: int, asks: bool) -> None:
    rig = Rig()
    rig.host.uuids, rig.host.nodes = None, nodes
    rig.round(frozenset({"GPU-0", "GPU-1"}))
    rig.later(1, frozenset({"GPU-1"}))
    rig.later(AFTER)
    assert status(rig.reg, RECOVER) == (("failed", True) if asks else ("ok", False))
    assert f"the host shows {nodes} device node(s) for the 2 device(s) listed" in reason(rig.reg, RECOVER)


def test_devices_not_listed_while_the_plugin_is_not_held_say_nothing_of_their_health() -> None:
    rig = Rig()
    rig.round()
    rig.later(1, SPLIT1)
    rig.node.connections = 0  # dropped: registration's own check asks for its restart
    rig.later(AFTER)  # the lost connection awaits its confirmation: not a hold to restart for
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert reason(rig.reg, RECOVER) == "not judged: a lost hold of the plugin awaits its confirmation"
    rig.later(1)
    assert status(rig.reg, RECOVER) == ("ok", False)
    assert reason(rig.reg, RECOVER) == "not judged: the kubelet does not hold the plugin"
    rig.node.connections = 1
    rig.later(1)
    assert status(rig.reg, RECOVER) == ("ok", False)  # the duration counts again from here


def test_recovery_restarts_in_vain_spend_the_budget() -> None:
    gpus = [f"GPU-{n:08x}-0000-0000-0000-000000000000" for n in range(RESTART_BUDGET + 1)]
    rig = Rig()
    rig.host.uuids, rig.host.nodes = frozenset(gpus), len(gpus)
    everything = frozenset(gpus)
    rig.round(everything)
    for gpu in gpus[:RESTART_BUDGET]:
        rig.later(1, everything - {gpu})
        rig.later(AFTER)
        assert status(rig.reg, RECOVER) == ("failed", True), gpu
        rig.restart_plugin()
        rig.later(1, everything - {gpu})  # not back: really unhealthy
        rig.later(AFTER)
        assert status(rig.reg, RECOVER) == ("failed", False), gpu
        everything -= {gpu}
    last = gpus[-1]
    rig.later(1, everything - {last})
    rig.later(AFTER)
    assert rig.live
    assert "restart budget spent: 3 plugin restarts were followed by a device unhealthy again" in rig.line()
    assert rig.reg.recovery()[GPU]["restart_budget_spent"] is True


def test_the_devices_line_says_which_check_asks_for_the_restart() -> None:
    rig = Rig(expect_devices=DeviceExpectation.at_least(2))
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER)
    line = _line(rig.reg.state, rig.reg.state.checks[f"devices:{GPU}"])
    assert line.startswith(
        f"[!]devices:{GPU} failed (no restart: readiness only: {RECOVER} asks for the plugin"
    )


def test_a_kubelet_restart_re_reads_the_devices_as_a_plugin_restart_would() -> None:
    """HAMi restarts its plugins on every kubelet.sock creation: a device not listed healthy before is
    judged afresh against the new list, and no restart asked for counts as done."""
    rig = Rig()
    rig.round()
    rig.later(1, SPLIT1)
    rig.later(AFTER / 2)
    rig.restart_plugin()  # the socket HAMi serves for the new kubelet
    rig.later(1, BOTH)
    assert reason(rig.reg, RECOVER) == "every device the kubelet listed healthy is listed healthy"
    assert rig.reg.recovery()[GPU]["restarts"] == 0


def test_the_flag_takes_the_projects_durations_and_its_variable() -> None:
    assert parse_settings([]).recover_unhealthy_after == 0
    assert parse_settings(["--recover-unhealthy-after", "10m"]).recover_unhealthy_after == 600
    env = {"HAMI_GUARD_RECOVER_UNHEALTHY_AFTER": "90s"}
    assert parse_settings([], env).recover_unhealthy_after == 90
    with pytest.raises(SystemExit):
        parse_settings(["--recover-unhealthy-after", "-1"])
