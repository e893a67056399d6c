"""Liveness restarts the plugin only where a restart is the remedy; readiness tells the whole truth.

The probe paths are the ones the shipped patch wires to the `device-plugin` container, read from
manifests/hami-patch/patch.yaml, so that a test and the manifests cannot drift apart.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

from hami_guard.flags import DeviceExpectation, Expect
from sidecar.deviceplugin.budget import RESTART_BUDGET
from tests.conftest import wait_for
from tests.e2e.conftest import GPU, Node, NodeFactory, Watch

PATCH = Path(__file__).parents[2] / "manifests" / "hami-patch" / "patch.yaml"
UUIDS = ("GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f", "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60")


def registered_since(node: Node, count: int) -> bool:
    return node.plugin.registrations > count


def restarts_seen(node: Node, count: int) -> bool:
    return node.sidecar.judge.kubelet_restarts >= count


def probe_paths() -> tuple[str, str]:
    """(liveness, readiness) paths of the `device-plugin` container in the shipped patch: the path its
    livenessProbe command asks for, and its readinessProbe's path less the query (the probe excludes the
    checks a rollback cannot mend: tests/test_manifests.py tests that gate; here /readyz is every check)."""
    doc = yaml.safe_load(PATCH.read_text())
    containers = doc["spec"]["template"]["spec"]["containers"]
    plugin = next(c for c in containers if c["name"] == "device-plugin")
    asked = re.search(r"GET (\S+) HTTP", plugin["livenessProbe"]["exec"]["command"][-1])
    assert asked is not None
    return asked.group(1), plugin["readinessProbe"]["httpGet"]["path"].split("?", 1)[0]


LIVE, READY = probe_paths()


async def both(node: Node) -> tuple[int, int]:
    return (await node.get(LIVE))[0], (await node.get(READY))[0]


def test_the_patch_wires_liveness_and_readiness_to_different_answers() -> None:
    assert (LIVE, READY) == ("/healthz", "/readyz")


async def test_all_devices_unhealthy_keeps_liveness_and_fails_readiness(make_node: NodeFactory) -> None:
    async with make_node(expect_devices=DeviceExpectation.at_least(2)) as node:
        await node.until(READY, 200)
        for device in ("GPU-0", "GPU-1"):
            node.plugin.set_health(device, False)
        body = await node.until(f"{READY}?verbose", 503, contains=f"devices:{GPU} failed")
        assert f"[+]registered:{GPU} ok" in body  # the kubelet holds it: registered with no healthy device
        await node.wait_rounds()
        assert await both(node) == (200, 503)
        assert node.plugin.registrations == 1  # and nothing restarted it


async def test_zero_or_all_unhealthy_devices_fail_readiness_without_an_expectation(
    make_node: NodeFactory,
) -> None:
    """No --expect-devices: a registered plugin with no healthy device is registered, live, not ready."""
    async with make_node() as node:
        await node.until(READY, 200)
        node.plugin.set_devices([])
        body = await node.until(f"{READY}?verbose", 503, contains=f"devices:{GPU} failed")
        assert "the kubelet lists 0 healthy device(s) by pod-resources, 1 expected" in body
        assert "--expect-devices 0 opts out" in body
        assert await node.get(f"{READY}/registered:{GPU}") == (200, "ok")
        node.plugin.set_devices(["GPU-0", "GPU-1"])
        await node.until(READY, 200)
        for device in ("GPU-0", "GPU-1"):
            node.plugin.set_health(device, False)
        await node.until(f"{READY}?verbose", 503, contains=f"devices:{GPU} failed")
        await node.wait_rounds()
        assert await both(node) == (200, 503)
        assert node.plugin.registrations == 1  # nothing restarted it


async def test_expect_devices_0_opts_out_of_the_devices_check(make_node: NodeFactory) -> None:
    async with make_node(expect_devices=DeviceExpectation(Expect.OFF)) as node:
        await node.until(READY, 200)
        node.plugin.set_devices([])
        await node.wait_rounds(rounds=3)
        assert await both(node) == (200, 200)
        assert f"devices:{GPU}" not in node.sidecar.state.checks


async def test_hami_split_ids_count_once_per_gpu_and_losing_one_gpu_fails_readiness(
    make_node: NodeFactory,
) -> None:
    ids = [f"{u}-{n}" for u in UUIDS for n in range(10)]  # HAMi's deviceSplitCount 10
    async with make_node(
        plugin_kwargs={"devices": ids}, expect_devices=DeviceExpectation.at_least(2)
    ) as node:
        await node.until(READY, 200)
        assert node.sidecar.judge.devices()[GPU]["pod_resources"] == 2
        for n in range(10):
            node.plugin.set_health(f"{UUIDS[1]}-{n}", False)
        body = await node.until(f"{READY}?verbose", 503, contains=f"devices:{GPU} failed")
        assert "the kubelet lists 1 healthy device(s) by pod-resources, 2 expected" in body
        assert (await node.get(LIVE))[0] == 200


async def test_a_plugin_that_never_registers_is_restarted_at_most_three_times_then_left_alone(
    make_node: NodeFactory,
) -> None:
    async with make_node(registration_grace=0.5) as node:
        node.plugin.register_enabled = False
        await node.kubelet.restart()  # the kubelet forgets it; the plugin does not register again
        for _ in range(RESTART_BUDGET):
            await node.until(LIVE, 503, timeout=3)
            await node.plugin.restart()  # what the kubelet does after failureThreshold 503s in a row
            await node.until(LIVE, 200)  # a new cycle: its grace runs again
        # The fourth cycle's grace runs out: liveness no longer asks for a restart, readiness says why.
        body = await node.until(f"{READY}?verbose", 503, contains=f"[!]registered:{GPU} failed", timeout=3)
        assert "restart budget spent: 3 plugin restarts did not register it" in body
        await node.wait_rounds(rounds=3)
        assert (await node.get(LIVE))[0] == 200
        status = (await node.get("/status"))[1]
        assert '"restart_budget_spent": true' in status
        # A crash still fails at once, budget or not.
        crashed = time.monotonic()
        await node.plugin.crash()
        await node.until(LIVE, 503, timeout=0.5)
        assert time.monotonic() - crashed < 0.5
        # Registration seen again restores the budget.
        node.plugin.register_enabled = True
        await node.plugin.restart()
        await node.until(READY, 200, timeout=3)
        assert '"restart_budget_spent": false' in (await node.get("/status"))[1]


async def test_a_kubelet_restart_restores_the_restart_budget(make_node: NodeFactory) -> None:
    """The budget bounds plugin restarts against one kubelet. Spent, then the kubelet restarts and the
    plugin does not register with the new one (HAMi's own failure): liveness fails again, and the
    plugin's restart mends it."""
    async with make_node(registration_grace=0.5) as node:
        node.plugin.register_enabled = False
        await node.kubelet.restart()
        for _ in range(RESTART_BUDGET):
            await node.until(LIVE, 503, timeout=3)
            await node.plugin.restart()
            await node.until(LIVE, 200)
        await node.until(f"{READY}?verbose", 503, contains="restart budget spent", timeout=3)
        await node.wait_rounds(rounds=3)
        assert (await node.get(LIVE))[0] == 200
        spent = f'device_plugin_restart_budget_spent{{plugin="hami",resource="{GPU}"}}'
        assert f"{spent} 1.0" in (await node.get("/metrics"))[1]
        await node.kubelet.restart()  # the plugin does not register with the new kubelet either
        body = await node.until(f"{LIVE}?verbose", 503, timeout=3)
        assert "restart budget spent" not in body
        assert '"restart_budget_spent": false' in (await node.get("/status"))[1]
        assert f"{spent} 0.0" in (await node.get("/metrics"))[1]
        node.plugin.register_enabled = True
        await node.plugin.restart()  # the kubelet's restart of the plugin, for the 503
        await node.until(READY, 200, timeout=3)


async def test_kubelet_restart_without_reregistration_fails_liveness_then_a_plugin_restart_mends_it(
    make_node: NodeFactory,
) -> None:
    async with make_node(registration_grace=0.5) as node:
        node.plugin.register_enabled = False
        await node.kubelet.restart()
        body = await node.until(f"{LIVE}?verbose", 503, timeout=3)
        assert f"[-]registered:{GPU} failed: the kubelet holds no connection to nvidia-gpu.sock" in body
        node.plugin.register_enabled = True
        await node.plugin.restart()
        await node.until(READY, 200, timeout=3)


async def test_a_missing_kubelet_for_three_graces_restarts_nothing(make_node: NodeFactory) -> None:
    async with make_node(registration_grace=0.3) as node:
        await node.until(READY, 200)
        await node.kubelet.stop(unlink_socket=True)
        gone = time.monotonic()
        await wait_for(lambda: time.monotonic() - gone > 3 * 0.3, what="three graces")
        await node.wait_rounds()
        code, body = await node.get(f"{LIVE}?verbose")
        assert code == 200, body
        assert "[!]kubelet failed (no restart" in body
        assert (await node.get(READY))[0] == 503
        await node.kubelet.start()
        await node.until(READY, 200, timeout=3)


async def test_both_socket_removal_orders_of_a_kubelet_restart_are_pending_never_failed(
    make_node: NodeFactory,
) -> None:
    """A kubelet's cleanup walks the folder unsorted: the plugin socket goes before or after kubelet.sock.

    Each restart is held until the sidecar has seen it: until the folder's events arrive, /readyz still
    answers the verdict from before the restart, so a quick restart could pass unseen, or be seen late
    together with the next one as one restart.
    """
    async with make_node() as node:
        await node.until(READY, 200)
        k = node.kubelet
        watch = Watch(node, LIVE, pause=0.005)
        try:
            for n, plugin_first in enumerate((True, False, True, False)):
                await k.stop()  # a killed kubelet: kubelet.sock stays as a dead file
                first, second = (
                    (node.plugin.socket_path, k.socket_path)
                    if plugin_first
                    else (k.socket_path, node.plugin.socket_path)
                )
                os.unlink(first)
                await asyncio.sleep(0.002)
                os.unlink(second)
                await wait_for(partial(restarts_seen, node, n + 1), what="the sidecar seeing the restart")
                assert node.sidecar.judge.kubelet_restarts == n + 1
                before = node.plugin.registrations
                await k.start()  # listens on a new kubelet.sock; the plugin registers again
                await wait_for(partial(registered_since, node, before), what="re-registration")
                await node.until(READY, 200, timeout=3)
        finally:
            answers = await watch.stop()
        assert answers
        assert set(answers) == {200}
        assert node.sidecar.judge.kubelet_restarts == 4


async def test_a_dropped_plugin_fails_liveness_within_an_interval_and_a_plugin_restart_mends_it(
    make_node: NodeFactory,
) -> None:
    async with make_node() as node:
        await node.until(READY, 200)
        dropped = time.monotonic()
        await node.kubelet.drop(GPU)  # the kubelet lets go; the plugin keeps serving and is not told
        interval, timeout = node.settings.probe_interval, node.settings.probe_timeout
        body = await node.until(f"{LIVE}?verbose", 503, timeout=interval + timeout + 1)
        assert time.monotonic() - dropped <= interval + timeout + node.settings.drop_confirm + 0.5
        assert f"[-]registered:{GPU} failed: the kubelet is no longer connected to nvidia-gpu.sock" in body
        assert "never registered" not in body
        await node.plugin.restart()  # what the kubelet does after failureThreshold 503s in a row
        await node.until(READY, 200, timeout=3)


@pytest.mark.parametrize("between_rounds", [True, False], ids=["connection watch", "rounds only"])
async def test_a_drop_is_judged_between_rounds_from_the_socket_table_alone(
    make_node: NodeFactory, between_rounds: bool
) -> None:
    """With a probe interval of a minute, a drop fails liveness within about the connection interval: the
    kubelet's connections are read between rounds (the socket table alone, no gRPC call). Without that
    read (--connection-interval 0) nothing tells before the next round."""
    async with make_node(probe_interval=60.0, connection_interval=0.5 if between_rounds else 0.0) as node:
        await node.until(READY, 200, timeout=5)
        rounds = node.sidecar.rounds
        dropped = time.monotonic()
        await node.kubelet.drop(GPU)
        if between_rounds:
            await node.until(f"{LIVE}?verbose", 503, timeout=5, contains="no longer connected")
            print(f"drop judged {time.monotonic() - dropped:.2f} s after it happened")
        else:
            await asyncio.sleep(3)
            assert (await node.get(LIVE))[0] == 200
            assert node.sidecar.rounds == rounds
