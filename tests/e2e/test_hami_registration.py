"""HAMi's own registration against a real API server (tests/apiserver.py: kube-apiserver and etcd), with
HAMi-shaped writers of the Node's annotations (tests/hamifixture.py: the device plugin's register loop,
the scheduler's handshake) and the simulated kubelet and device plugin beside the real sidecar.

What it holds on a real API server, each as HAMi v2.10.0's code does it (tests/hamifixture.py says which
facts the writers mirror): on one GPU a failed patch stays until the plugin restarts, on two a round in
another map order patches again by itself; an annotation stale on a GPU's health has HAMi's scheduler
place Pods on the GPU the kubelet took out; one removed after the scheduler read it leaves the scheduler
on its last copy; a dead plugin is not judged, and the scheduler still offers its annotation meanwhile.

Marked slow and not in `make real-slow`: it needs `make node-bins` (kube-apiserver) and etcd;
`make hami-registration` runs it. About a minute. HAMi's 30 s loop and 5 s retry are scaled to tenths
of a second, the sidecar's --hami-repair to 3 s; the handshake's 60 s run on clocks the test moves.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from doctor import settings as doctor_settings
from doctor.hami import gather_hami, hami_causes
from doctor.logscan import scan
from doctor.patterns import PLUGIN_PATTERNS
from doctor.types import Cause
from sidecar.config import PluginSpec
from sidecar.deviceplugin.probes import Reading
from sidecar.hami.verdicts import HANDSHAKE_EXPIRY, SCHEDULER_TICK, HamiVerdict
from sidecar.hami.watch import HamiKeys, HamiWatch, boot_id
from sidecar.health import HealthState, Status
from sidecar.kube.access import ApiAccess
from sidecar.server.status import status_document
from testing import FakeDevicePlugin, FakeKubelet, free_port, hami_device_ids
from testing.hamiwriter import InCluster, Registrar
from tests import apiserver
from tests.conftest import wait_for
from tests.e2e.conftest import FAST, GPU, Node, NodeFactory
from tests.e2e.running import sidecar_running
from tests.hamifixture import (
    HANDSHAKE,
    MERGE,
    REGISTER,
    Gpu,
    HamiRegistrar,
    HamiScheduler,
    Vendor,
    go_map_order,
    held_order,
    marshal,
    same_devices,
)

pytestmark = pytest.mark.slow
NODE = "gpu-node-1"
G1 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
G2 = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
CHECK = f"hami:{GPU}"
REPAIR = 3.0
KEYS = (HamiKeys(GPU, REGISTER, HANDSHAKE),)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api(short_tmp: str) -> AsyncIterator[apiserver.ApiServer]:
    reason = apiserver.missing()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    server = apiserver.ApiServer(short_tmp)
    try:
        await server.start()
        for name in (NODE, "gpu-node-2"):
            await server.request("POST", "/api/v1/nodes", {"metadata": {"name": name}})
        # The kubelet's report: this machine's boot ID, the GPUs allocatable (HAMi's 10 splits each).
        await set_status(server, NODE, boot_id(), 20)
        await set_status(server, "gpu-node-2", "another-machine", 20)
        # HAMi's chart grants its device plugin get/list/update/patch on nodes; here get and patch apart,
        # so that the test can take patch away alone. The sidecar needs get.
        await server.grant("hami-plugin", "hami-plugin-get", ["nodes"], ["get"])
        await server.grant("hami-plugin", "hami-plugin-patch", ["nodes"], ["patch"])
        await server.grant("hami-sidecar", "hami-sidecar", ["nodes"], ["get"])
        yield server
    finally:
        server.stop()


KUBELET_VERSION = "v1.34.4"  # as the Node reports it


async def set_status(api: apiserver.ApiServer, node: str, boot: str, gpus: int) -> None:
    body = {
        "status": {
            "nodeInfo": {"bootID": boot, "kubeletVersion": KUBELET_VERSION},
            "capacity": {GPU: str(gpus)},
            "allocatable": {GPU: str(gpus)},
        }
    }
    await api.request(
        "PATCH", f"/api/v1/nodes/{node}/status", body, content_type="application/merge-patch+json"
    )


async def annotation(api: apiserver.ApiServer, key: str = REGISTER) -> str | None:
    n = await api.request("GET", f"/api/v1/nodes/{NODE}")
    value = (n["metadata"].get("annotations") or {}).get(key)
    return value if isinstance(value, str) else None


def check(node: Node) -> tuple[Status, bool, str]:
    c = node.sidecar.state.checks[CHECK]
    return c.status, c.live_failed, c.reason


def resource_document(watch: HamiWatch, now: float) -> dict[str, Any]:
    """/status's hami_registration.resources entry of the GPU resource."""
    resources: dict[str, dict[str, Any]] = watch.document(now)["resources"]  # type: ignore[assignment]
    return resources[GPU]


def skips(writer: Registrar, since: int = 0) -> int:
    """The rounds HAMi's loop skipped as unchanged, from its log line `since` on."""
    return sum("unchanged, skipping" in line for line in writer.log[since:])


def reason_metric(node: Node, code: str) -> float:
    value: float = node.sidecar.metrics.hami_reason.labels("hami", GPU, code)._value.get()
    return value


def restarts_asked(node: Node) -> float:
    value: float = node.sidecar.metrics.restart_requests.labels("hami", GPU)._value.get()
    return value


async def test_one_gpu_the_failed_patch_stays_and_a_restart_writes_it_again(
    api: apiserver.ApiServer, make_node: NodeFactory
) -> None:
    """On one GPU HAMi's plugin lists its GPU in one order every round: after a failed PATCH its cache
    matches every round, and nothing but a restart writes the annotation."""
    gpus = [Gpu(G1)]
    writer = HamiRegistrar(api, NODE, gpus, interval=0.1, error_interval=0.05)  # Go's map order
    await set_status(api, NODE, boot_id(), 10)  # one GPU's ten splits
    sidecar_api = ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file)
    scheduler = HamiScheduler(api, NODE)
    await scheduler.tick()  # HAMi's scheduler selects the node: its handshake
    async with make_node(
        {"devices": hami_device_ids([G1])},
        node_name=NODE,
        hami_api=sidecar_api,
        hami_interval=0.2,
        hami_repair=REPAIR,
    ) as node:
        assert node.sidecar.hami is not None
        # The kubelet's binary cannot be read here (the simulator runs in the test's process): the rules
        # follow the release this node's Node reports.
        await wait_for(
            lambda: status_document(node.sidecar)["kubelet_release"]["version"] == KUBELET_VERSION,
            what="the kubelet's release from the Node",
        )
        assert status_document(node.sidecar)["kubelet_release"]["rules"] == "1.30-1.36"
        # No annotation yet: HAMi's own loop is waited for (readiness says so, liveness does not fail).
        await wait_for(lambda: "HAMi's loop rewrites" in check(node)[2], what="the wait for HAMi's loop")
        assert check(node)[0] is Status.OK and (await node.get("/healthz"))[0] == 200
        # The first patch fails (HAMi's ServiceAccount may not patch nodes yet), after the cache took it.
        await api.unbind("hami-plugin-patch")
        writer.start()
        try:
            await wait_for(
                lambda: any("patch node error" in line for line in writer.log), what="a failed patch"
            )
            await api.bind("hami-plugin", "hami-plugin-patch")  # the fault is gone; HAMi's cache stays
            await wait_for(lambda: skips(writer) >= 10, what="ten rounds skipped as unchanged")
            assert await annotation(api) is None
            body = await node.until("/healthz?verbose", 503, timeout=REPAIR + 3, contains=f"[-]{CHECK}")
            assert "it may skip every later round as 'unchanged' until the plugin restarts" in body
            assert "with one GPU it always does" in body and "'node unregistered'" in body
            assert writer.patches == 0 and await annotation(api) is None  # nothing else mends it
            await scheduler.tick()
            assert scheduler.offers() is None  # `node unregistered` for its Pods
            # The liveness probe's remedy: the kubelet restarts the plugin's container.
            await writer.restart()
            await node.plugin.restart()
            await node.until("/healthz", 200, timeout=5)
            await wait_for(lambda: check(node)[0] is Status.OK, timeout=5, what="hami ok again")
            assert same_devices(await annotation(api), marshal(gpus))
            await scheduler.tick()
            assert scheduler.offers() == frozenset({G1})
        finally:
            await writer.stop()


async def test_two_gpus_a_round_in_another_order_patches_again_by_itself(
    api: apiserver.ApiServer, make_node: NodeFactory
) -> None:
    """On two GPUs HAMi's plugin lists them in Go's map order, another one about a round in five: a round
    in another order differs from the cache as a string and patches again, with no restart. The orders
    are Go's odds drawn from a seeded generator, whose longest run of one order the test bounds first, so
    that the result does not hang on the draw."""
    rng, probe = random.Random(9), random.Random(9)
    draws = [tuple(go_map_order(2, probe)) for _ in range(1000)]
    longest = max(len(list(run)) for _, run in itertools.groupby(draws))
    assert longest <= 25, longest  # at 0.02 s a round, well within the sidecar's 10 s
    gpus = [Gpu(G1), Gpu(G2)]
    writer = HamiRegistrar(
        api, NODE, gpus, interval=0.02, error_interval=0.02, order=lambda n: go_map_order(n, rng)
    )
    await HamiScheduler(api, NODE).tick()
    sidecar_api = ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file)
    async with make_node(
        {"devices": hami_device_ids([G1, G2])},
        node_name=NODE,
        hami_api=sidecar_api,
        hami_interval=0.2,
        hami_repair=10.0,
    ) as node:
        await wait_for(lambda: "HAMi's loop rewrites" in check(node)[2], what="the wait for HAMi's loop")
        await api.unbind("hami-plugin-patch")
        writer.start()
        try:
            await wait_for(lambda: any("patch node error" in x for x in writer.log), what="a failed patch")
            await api.bind("hami-plugin", "hami-plugin-patch")
            failed = max(i for i, x in enumerate(writer.log) if "patch node error" in x)
            await wait_for(lambda: writer.patches >= 1, timeout=8, what="a round in another order patching")
            assert same_devices(await annotation(api), marshal(gpus))
            await wait_for(lambda: check(node)[2].startswith("HAMi's annotation lists the 2"), what="hami ok")
            assert restarts_asked(node) == 0 and reason_metric(node, "ok") == 1
            print(f"two GPUs: patched again after {skips(writer, failed)} round(s) skipped as unchanged")
        finally:
            await writer.stop()


async def test_a_stale_health_places_pods_on_the_gpu_the_kubelet_took_out(
    api: apiserver.ApiServer, make_node: NodeFactory
) -> None:
    """A GPU turns unhealthy while the plugin's patch fails once (its order held, as one GPU's: the
    annotation stays stale): HAMi's scheduler re-reads the node when the allocatable count changes and
    offers the GPU the kubelet took out; the sidecar names that harm and fails liveness."""
    gpus = [Gpu(G1), Gpu(G2)]
    writer = HamiRegistrar(api, NODE, gpus, interval=0.2, error_interval=0.05, order=held_order)
    scheduler = HamiScheduler(api, NODE)
    await scheduler.tick()
    sidecar_api = ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file)
    async with make_node(
        {"devices": hami_device_ids([G1, G2])},
        node_name=NODE,
        hami_api=sidecar_api,
        hami_interval=0.2,
        hami_repair=REPAIR,
    ) as node:
        writer.start()
        try:
            await wait_for(lambda: check(node)[2].startswith("HAMi's annotation lists the 2"), what="hami ok")
            await scheduler.tick()
            assert scheduler.offers() == frozenset({G1, G2})
            await api.unbind("hami-plugin-patch")
            for device in hami_device_ids([G2]):
                node.plugin.set_health(device, False)
            gpus[1].healthy = False
            await set_status(api, NODE, boot_id(), 10)  # the kubelet's allocatable: G1's ten splits
            before = len(writer.log)
            await wait_for(lambda: any("patch node error" in x for x in writer.log[before:]), what="failed")
            await api.bind("hami-plugin", "hami-plugin-patch")
            # HAMi's scheduler reads the node again (the count changed), from the stale annotation.
            await scheduler.tick()
            assert scheduler.offers() == frozenset({G1, G2})
            body = await node.until("/healthz?verbose", 503, timeout=REPAIR + 5, contains=f"[-]{CHECK}")
            assert f"it lists as healthy GPU(s) the kubelet does not list healthy: {G2}" in body
            assert "HAMi's scheduler places GPU Pods on the GPU(s) the kubelet took out" in body
            assert reason_metric(node, "stale_health") == 1 and reason_metric(node, "mismatched") == 0
            doc = status_document(node.sidecar)["hami_registration"]["resources"][GPU]
            assert doc["reason_code"] == "stale_health" and doc["judged"] and doc["fails_liveness"]
            assert doc["scheduler"] == f"places Pods on GPU(s) the kubelet took out: {G2}"
            await writer.restart()
            await node.plugin.restart()
            for device in hami_device_ids([G2]):
                node.plugin.set_health(device, False)
            await node.until("/healthz", 200, timeout=5)
            assert same_devices(await annotation(api), marshal(gpus))
            await scheduler.tick()  # the annotation changed: read again
            assert scheduler.offers() == frozenset({G1})
        finally:
            await writer.stop()


async def test_an_annotation_gone_after_the_scheduler_read_it_is_its_last_copy(
    api: apiserver.ApiServer,
) -> None:
    """The register annotation removed after HAMi's scheduler read it: the scheduler keeps scheduling on its
    copy, and the sidecar says so (not "cannot see"); once the scheduler cleans the node up, the copy is
    gone and its Pods get `node unregistered`, which the sidecar then says."""
    gpus = [Gpu(G1), Gpu(G2)]
    writer = HamiRegistrar(api, NODE, gpus, order=held_order)
    assert await writer.register_once()
    scheduler = HamiScheduler(api, NODE)
    await scheduler.tick()
    assert scheduler.offers() == frozenset({G1, G2})
    clock = Clock()
    watch = HamiWatch(
        KEYS,
        {},
        ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file),
        NODE,
        pod_resources_socket="/nonexistent",
        every=0.0,
        repair=REPAIR,
        clock=clock,
    )
    kubelet = Reading({GPU: frozenset(hami_device_ids([G1, G2]))})

    async def verdict() -> HamiVerdict:
        return (await watch.round({GPU: (True, True)}, kubelet))[GPU][1]

    try:
        assert (await verdict()).code == "ok"
        clock.now += SCHEDULER_TICK
        assert (await verdict()).code == "ok"  # in place for a scheduler tick: it has read it
        await api.request(
            "PATCH",
            f"/api/v1/nodes/{NODE}",
            {"metadata": {"annotations": {REGISTER: None}}},
            content_type="application/merge-patch+json",
        )
        await scheduler.tick()
        assert scheduler.offers() == frozenset({G1, G2})  # its last copy
        assert await writer.register_once() and writer.log[-1].endswith("skipping annotation update")
        v = await verdict()
        assert v.code == "repairing" and "(HAMi's scheduler read it: 2 healthy GPU(s)" in v.reason
        clock.now += REPAIR
        v = await verdict()
        assert v.status is Status.FAILED and v.code == "last_copy" and v.live_failed, v.reason
        assert "keeps scheduling on its last copy of the annotation" in v.reason
        doc = resource_document(watch, clock.now)
        assert doc["scheduler"] == "schedules on its last copy: 2 healthy GPU(s)" and doc["judged"]
        # The scheduler cleans the node up (the kubelet's status: allocatable 0): its copy goes, and the
        # handshake with it; it stamps a new one, and finds no annotation to read.
        await set_status(api, NODE, boot_id(), 0)
        await scheduler.tick()
        assert scheduler.offers() is None and "cleaning up node" in scheduler.log[-1]
        assert await annotation(api, HANDSHAKE) is None
        assert (await verdict()).code == "no_handshake"
        await set_status(api, NODE, boot_id(), 20)
        await scheduler.tick()
        assert (await annotation(api, HANDSHAKE) or "").startswith("Requesting_")
        assert scheduler.offers() is None  # `node unregistered`
        v = await verdict()
        assert v.code == "repairing" and "HAMi's scheduler read it" not in v.reason
        clock.now += REPAIR
        v = await verdict()
        assert v.code == "missing" and "'node unregistered' where it never read an earlier annotation" in (
            v.reason
        )
    finally:
        await watch.close()


async def test_a_dead_plugin_is_not_judged_and_says_the_scheduler_still_offers_its_annotation(
    api: apiserver.ApiServer,
) -> None:
    """The plugin is dead: the kubelet lists no healthy device and reports allocatable 0, the annotation
    still lists both GPUs. HAMi's v2.10 scheduler drops the node, re-adds it from the annotation at its
    next tick, drops it again once its new stamp is 60 s old: the sidecar does not judge (the plugin's
    checks do) and says the scheduler still offers the node; the doctor too, apart from an unread Node."""
    writer = HamiRegistrar(api, NODE, [Gpu(G1), Gpu(G2)])
    assert await writer.register_once()
    sched_now = [time.time()]
    scheduler = HamiScheduler(api, NODE, now=lambda: sched_now[0])
    await scheduler.tick()
    assert scheduler.offers() == frozenset({G1, G2})
    await set_status(api, NODE, boot_id(), 0)
    clock = Clock()
    access = ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file)
    watch = HamiWatch(
        KEYS, {}, access, NODE, pod_resources_socket="/nonexistent", every=0.0, repair=REPAIR, clock=clock
    )
    gone: Reading[dict[str, frozenset[str]]] = Reading({GPU: frozenset()})
    offered = []
    try:
        for _ in range(8):  # two minutes of the scheduler's 15 s ticks
            await scheduler.tick()
            offered.append(scheduler.offers() is not None)
            _, v = (await watch.round({GPU: (False, False)}, gone))[GPU]
            assert v.status is Status.OK and v.code == "plugin_down" and not v.restarts, v.reason
            assert v.reason.startswith("not judged while the plugin does not serve") and v.gpus == 2
            if await annotation(api, HANDSHAKE) is None:  # v2.10 cleaned the node up this tick
                assert "or it has just cleaned the node up" in v.reason
            else:
                assert "meanwhile HAMi's scheduler still offers the node from this annotation (2 healthy" in (
                    v.reason
                )
                assert v.scheduler == "still offers the node from the last annotation: 2 healthy GPU(s)"
            sched_now[0] += SCHEDULER_TICK
            clock.now += SCHEDULER_TICK
        # Dropped, added back, dropped again: offered most of the time.
        assert offered[0] is False and True in offered[1:] and sum(offered) >= 4, offered
        assert sum("cleaning up node" in line for line in scheduler.log) >= 2, scheduler.log
        print(f"dead plugin: HAMi's scheduler offered the node at {sum(offered)} of {len(offered)} ticks")
        doc = resource_document(watch, clock.now)
        assert doc["reason_code"] == "plugin_down" and doc["judged"] is False
    finally:
        await watch.close()
    # hami-doctor, as a snapshot: "unknown", said as not judged, with what the scheduler does.
    found = await gather_hami(
        access, NODE, ((GPU, REGISTER),), HANDSHAKE, kubelet=gone, serving={GPU: False}, timeout=15.0
    )
    row = hami_causes(found, [])[0]
    assert row.verdict == "unknown" and row.evidence[0].startswith(f"{GPU}: not judged while the plugin")
    assert "meanwhile HAMi's scheduler still offers the node from this annotation" in row.evidence[0]
    nobody = ApiAccess(api.url, api.token_file("nobody"), api.ca_file)
    found = await gather_hami(
        nobody, NODE, ((GPU, REGISTER),), HANDSHAKE, kubelet=gone, serving={GPU: False}, timeout=15.0
    )
    row = hami_causes(found, [])[0]
    assert row.verdict == "unknown" and "no evidence: the Node cannot be read" in row.evidence[0]
    assert "403" in row.evidence[0] and "not judged" not in row.evidence[0]


async def test_the_standin_writer_as_a_pod_runs_it(api: apiserver.ApiServer) -> None:
    """The node end-to-end's writer (tests/node/e2e_hami.py): urllib with a ServiceAccount's token and CA
    files, its one-shot failed PATCH (a stale resourceVersion: 409), then HAMi's cached skip."""
    assert InCluster.from_environ({}) is None
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert InCluster.from_environ(env) == InCluster("https://10.96.0.1:443")
    fail = [True]

    def once() -> bool:
        was, fail[0] = fail[0], False
        return was

    gpus = [Gpu(G1), Gpu(G2)]
    access = InCluster(api.url, api.token_file("hami-plugin"), api.ca_file)
    writer = Registrar(access, NODE, lambda: gpus, fail_patch=once, order=held_order)
    assert not await writer.register_once()
    assert "409" in writer.error and "patch node error" in writer.log[-1], writer.log
    assert await writer.register_once() and writer.log[-1].endswith("skipping annotation update")
    assert writer.patches == 0 and await annotation(api) is None
    writer.order = lambda n: [1, 0]  # another map order: another string, the same devices, patched
    assert await writer.register_once() and writer.patches == 1
    assert await annotation(api) == marshal(gpus, [1, 0]) and same_devices(
        await annotation(api), marshal(gpus)
    )
    writer.order = held_order
    writer.cache = ""  # a plugin restart
    assert await writer.register_once() and await annotation(api) == marshal(gpus)
    denied = Registrar(InCluster(api.url, api.token_file("nobody"), api.ca_file), NODE, lambda: gpus)
    assert not await denied.register_once()
    assert denied.log == [f"get node error {denied.error}"] and ": 403 " in denied.error


async def test_a_deleted_handshake_that_stays_is_readiness_only(api: apiserver.ApiServer) -> None:
    clock, sched_now = Clock(), [1.7e9]
    scheduler = HamiScheduler(api, NODE, release="before-v2.9", now=lambda: sched_now[0])
    writer = HamiRegistrar(api, NODE, [Gpu(G1), Gpu(G2)], order=held_order)
    assert await writer.register_once()
    watch = HamiWatch(
        KEYS,
        {},
        ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file),
        NODE,
        pod_resources_socket="/nonexistent",
        every=0.0,
        clock=clock,
    )
    state = HealthState(60.0, clock)
    watch.attach(state, _Nothing())
    kubelet = Reading({GPU: frozenset(hami_device_ids([G1, G2]))})

    async def verdict() -> tuple[Status, str, str]:
        _, v = (await watch.round({GPU: (True, True)}, kubelet))[GPU]
        return v.status, v.code, v.reason

    await scheduler.tick()  # the first handshake
    assert (await annotation(api, HANDSHAKE) or "").startswith("Requesting_")
    first = await verdict()
    assert first[1] == "ok", first
    # The kubelet stops reporting the GPUs for a while; the stamp is over 60 s old: the node is cleaned.
    await set_status(api, NODE, boot_id(), 0)
    assert (await verdict())[1] == "ok"  # the allocatable's 0 is new
    sched_now[0] += 61
    clock.now += HANDSHAKE_EXPIRY
    assert (await verdict())[1] == "handshake_expired"
    await scheduler.tick()
    assert any("Device is unhealthy, cleaning up node" in line for line in scheduler.log)
    assert (await annotation(api, HANDSHAKE) or "").startswith("Deleted_")
    # The GPUs are back, but the old scheduler keeps its Deleted_ handshake: it never looks again.
    await set_status(api, NODE, boot_id(), 20)
    for _ in range(3):
        sched_now[0] += 15
        await scheduler.tick()
    assert not scheduler.sees and (await annotation(api, HANDSHAKE) or "").startswith("Deleted_")
    assert (await verdict())[1] == "ok"  # a current scheduler replaces it within a tick
    clock.now += HANDSHAKE_EXPIRY + SCHEDULER_TICK
    status, code, reason = await verdict()
    assert (status, code) == (Status.FAILED, "handshake_deleted")
    assert f"kubectl annotate node {NODE} {HANDSHAKE}-" in reason
    assert state.healthy() and not state.all_ok()  # readiness only: no restart
    # The fix the reason names: the annotation removed, the scheduler hands shakes again.
    await api.request(
        "PATCH",
        f"/api/v1/nodes/{NODE}",
        {"metadata": {"annotations": {HANDSHAKE: None}}},
        content_type="application/merge-patch+json",
    )
    await scheduler.tick()
    await scheduler.tick()
    assert scheduler.sees
    assert (await verdict())[1] == "ok" and state.all_ok()
    await watch.close()


async def test_no_api_access_is_no_evidence_and_a_wrong_node_is_readiness_only(
    api: apiserver.ApiServer, short_tmp: str
) -> None:
    writer = HamiRegistrar(api, NODE, [Gpu(G1)])
    assert await writer.register_once()
    await HamiScheduler(api, NODE).tick()
    kubelet = Reading({GPU: frozenset(hami_device_ids([G2]))})  # it differs: only access can hide it
    clock = Clock()

    async def verdict(access: ApiAccess, node: str = NODE) -> tuple[str, str, bool]:
        watch = HamiWatch(
            KEYS, {}, access, node, pod_resources_socket="/nonexistent", every=0.0, repair=REPAIR, clock=clock
        )
        state = HealthState(60.0, clock)
        watch.attach(state, _Nothing())
        try:
            for _ in range(2):
                _, v = (await watch.round({GPU: (True, True)}, kubelet))[GPU]
                clock.now += 10 * REPAIR
        finally:
            await watch.close()
        return v.code, v.reason, state.healthy()

    nobody = ApiAccess(api.url, api.token_file("nobody"), api.ca_file)
    expired = os.path.join(short_tmp, "expired.token")
    with open(expired, "w") as f:
        f.write("a-token-the-api-server-does-not-know\n")
    for access, words in (
        (nobody, "answered 403"),  # RBAC: no get on nodes
        (ApiAccess(api.url, os.path.join(short_tmp, "no-token"), api.ca_file), "no ServiceAccount token"),
        (ApiAccess(api.url, expired, api.ca_file), "answered 401"),
        (ApiAccess(api.url, "", api.ca_file), "answered 403"),  # anonymous
        (
            ApiAccess(f"https://127.0.0.1:{free_port()}", api.token_file("hami-sidecar"), api.ca_file),
            "cannot be asked",
        ),
    ):
        code, reason, live = await verdict(access)
        assert code == "no_evidence" and words in reason and reason.startswith("no evidence: "), reason
        assert live
    sidecar = ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file)
    code, reason, live = await verdict(sidecar, "no-such-node")
    assert code == "wrong_node" and "no Node 'no-such-node'" in reason and live
    code, reason, live = await verdict(sidecar, "gpu-node-2")
    assert code == "wrong_node" and "another machine" in reason and live
    code, reason, live = await verdict(sidecar)  # the right name: the difference is seen, and fails
    assert code == "stale_health" and not live  # it lists G1 healthy, which the kubelet does not


class _Nothing:
    def hami(self, resource: str, code: str, gpus: int | None) -> None:
        pass

    def restart_requested(self, resource: str) -> None:
        pass


async def test_the_doctor_names_the_stuck_cache_and_removes_a_deleted_handshake(
    api: apiserver.ApiServer, short_tmp: str
) -> None:
    # hami-doctor --kubeconfig: the sidecar's user, as a kubeconfig (its CA and token inline or by path).
    settings = doctor_settings.parse_settings(
        ["--kubeconfig", api.kubeconfig("hami-sidecar")], {"NODE_NAME": NODE}
    )
    assert settings.hami_api is not None and settings.hami_api.source.startswith("kubeconfig ")
    assert settings.hami_keys == ((GPU, REGISTER),)
    writer = HamiRegistrar(api, NODE, [Gpu(G1), Gpu(G2)], order=held_order)  # one order: it skips
    await HamiScheduler(api, NODE).tick()
    await api.unbind("hami-plugin-patch")
    assert not await writer.register_once()
    await api.bind("hami-plugin", "hami-plugin-patch")
    assert await writer.register_once()  # "unchanged": skipped
    # The plugin's log as klog prints it (a registration, then the loop's lines).
    lines = [
        "I1205 07:00:00.000000       1 server.go:404] "
        "Registered device plugin for 'nvidia.com/gpu' with Kubelet"
    ]
    lines += [f"E1205 07:00:01.000000       1 register.go:303] {line}" for line in writer.log]
    log = scan(("\n".join(lines) + "\n").encode(), PLUGIN_PATTERNS, "device-plugin.log", None, 0.0)
    kubelet = Reading({GPU: frozenset(hami_device_ids([G1, G2]))})

    async def rows() -> dict[str, Cause]:
        assert settings.hami_api is not None
        found = await gather_hami(
            settings.hami_api,
            settings.node_name,
            settings.hami_keys,
            settings.hami_handshake,
            kubelet=kubelet,
            serving={GPU: True},
            timeout=15.0,  # CI builds beside it slow the API server: a GET cut short reads "unknown"
        )
        return {c.id: c for c in hami_causes(found, [log])}

    r = await rows()
    reg = r["hami-registration"]
    assert reg.verdict == "problem" and f"{REGISTER} is absent" in reg.evidence[0]
    assert any("patch node error" in e for e in reg.evidence) and any("skipping" in e for e in reg.evidence)
    assert "cached" in reg.fix[0] and "delete pod" in reg.fix[1]
    assert r["hami-handshake"].verdict == "ok" and "Requesting_" in r["hami-handshake"].evidence[0]
    # The plugin restarted: the annotation is back; an old scheduler left a Deleted_ handshake.
    writer.cache = ""  # a plugin restart: a new process, an empty cache; its first round patches
    assert await writer.register_once() and writer.patches == 1
    await api.request(
        "PATCH",
        f"/api/v1/nodes/{NODE}",
        {"metadata": {"annotations": {HANDSHAKE: "Deleted_2024.01.02 00:00:00"}}},
        content_type="application/merge-patch+json",
    )
    r = await rows()
    assert r["hami-registration"].verdict == "ok"
    hs = r["hami-handshake"]
    assert hs.verdict == "problem" and hs.fix[-1] == f"$ kubectl annotate node {NODE} {HANDSHAKE}-"
    # Without access: unknown, never a problem.
    settings = doctor_settings.parse_settings(["--kubeconfig", api.kubeconfig("nobody")], {"NODE_NAME": NODE})
    r = await rows()
    assert r["hami-registration"].verdict == "unknown" and "403" in r["hami-registration"].evidence[0]


# -- other vendors: the register's format and the plugin's own stamp ------------------------------------
DCU = "hygon.com/dcunum"
ASCEND = "huawei.com/Ascend910B3"
D1 = "DCU-0123456789"


@contextlib.asynccontextmanager
async def vendor_node(
    api: apiserver.ApiServer, dp_dir: str, short_tmp: str, *, resource: str, socket: str, devices: list[str]
) -> AsyncIterator[Node]:
    """A node whose one plugin serves `resource` on `socket` (the vendor profile's), with the sidecar
    reading this test's API server: the vendor's keys and format come from its profile."""
    body = {
        "status": {
            "nodeInfo": {"bootID": boot_id(), "kubeletVersion": KUBELET_VERSION},
            "capacity": {resource: str(len(devices))},
            "allocatable": {resource: str(len(devices))},
        }
    }
    await api.request("PATCH", f"/api/v1/nodes/{NODE}/status", body, content_type=MERGE)
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    settings = replace(
        FAST,
        device_plugin_dir=dp_dir,
        pod_resources_socket=pod_resources,
        port=free_port(),
        plugins=(PluginSpec(resource, socket),),
        node_name=NODE,
        hami_api=ApiAccess(api.url, api.token_file("hami-sidecar"), api.ca_file),
        hami_interval=0.2,
        hami_repair=REPAIR,
    )
    async with (
        FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as kubelet,
        FakeDevicePlugin(
            dp_dir, register_timeout=5, resource=resource, socket_name=socket, devices=devices
        ) as plugin,
    ):
        await wait_for(lambda: kubelet.healthy_devices(resource), what="registration")
        async with sidecar_running(settings) as (sidecar, _), aiohttp.ClientSession() as http:
            yield Node(dp_dir, kubelet, plugin, sidecar, settings, http)


def vendor_check(node: Node, resource: str) -> tuple[Status, bool, str]:
    c = node.sidecar.state.checks[f"hami:{resource}"]
    return c.status, c.live_failed, c.reason


async def test_a_dcu_annotation_in_json_is_not_ready_and_never_a_restart(
    api: apiserver.ApiServer, dp_dir: str, short_tmp: str
) -> None:
    """HAMi v2.10.0 decodes Hygon DCU's register annotation as the legacy CSV text: a DCU plugin writing
    JSON (built for another HAMi release) is a format skew, which a restart writes again: readiness
    fails, liveness never, over many times the sidecar's --hami-repair; the plugin's own CSV is ok."""
    dcu = Vendor.of("dcu", DCU)
    writer = HamiRegistrar(api, NODE, [Gpu(D1)], interval=0.1, error_interval=0.05, vendor=dcu.skewed())
    devices = [f"{D1}-fake-{i}" for i in range(4)]
    async with vendor_node(
        api, dp_dir, short_tmp, resource=DCU, socket="hygon.com_dcunum", devices=devices
    ) as node:
        writer.start()
        try:
            await wait_for(
                lambda: (
                    "format_skew" in node.sidecar.state.checks[f"hami:{DCU}"].reason
                    or "legacy CSV" in vendor_check(node, DCU)[2]
                ),
                what="the format skew",
            )
            started, lives = time.monotonic(), []
            while time.monotonic() - started < 4 * REPAIR:  # twice the stamp's bound, four times repair's
                status, live, reason = vendor_check(node, DCU)
                assert status is Status.FAILED and not live, reason
                assert "legacy CSV (DecodeNodeDevices)" in reason and "no restart" in reason
                lives.append((await node.get("/healthz"))[0])
                await node.wait_rounds(rounds=1)
            assert set(lives) == {200} and (await node.get("/readyz"))[0] == 503
            value: float = node.sidecar.metrics.restart_requests.labels("hami", DCU)._value.get()
            reason_on: float = node.sidecar.metrics.hami_reason.labels(
                "hami", DCU, "format_skew"
            )._value.get()
            assert (value, reason_on) == (0, 1)
            assert writer.patches > 10 and (await annotation(api, dcu.register) or "").startswith("[")
            # The plugin release that writes HAMi's CSV: the same node is ok.
            await writer.stop()
            writer.vendor = dcu
            writer.start()
            await wait_for(lambda: vendor_check(node, DCU)[0] is Status.OK, what="hami ok on CSV")
            assert "lists the 1 healthy GPU(s) the kubelet lists" in vendor_check(node, DCU)[2]
            print(f"format skew: {len(lives)} rounds over {4 * REPAIR:g}s, /healthz 200 in each, 0 restarts")
        finally:
            await writer.stop()


async def test_an_ascend_stamp_that_stops_while_the_plugin_serves_is_one_restart(
    api: apiserver.ApiServer, dp_dir: str, short_tmp: str
) -> None:
    """Ascend's plugin patches its register annotation and `Reported_<time>` every round: a stamp that
    stops while the plugin serves is its register loop stopped. Liveness fails once; the restarted plugin
    stamps again and the check passes; one restart asked."""
    ascend = Vendor.of("ascend", ASCEND)
    uuid = "7c1f3a52-0000-4b1e-9d3f-6a2b8c9d0e1f"
    writer = HamiRegistrar(api, NODE, [Gpu(uuid)], interval=0.1, error_interval=0.05, vendor=ascend)
    devices = [f"{uuid}-{i}" for i in range(4)]
    async with vendor_node(
        api, dp_dir, short_tmp, resource=ASCEND, socket="Ascend910B3.sock", devices=devices
    ) as node:
        writer.start()
        try:
            await wait_for(lambda: "GPU(s) the kubelet lists" in vendor_check(node, ASCEND)[2], what="ok")
            assert (await annotation(api, ascend.handshake) or "").startswith("Reported_")
            await writer.stop()  # the register loop stops; the plugin still serves
            stopped = time.monotonic()
            body = await node.until(
                "/healthz?verbose", 503, timeout=2 * REPAIR + 5, contains=f"[-]hami:{ASCEND}"
            )
            took = time.monotonic() - stopped
            assert "register loop" in body and took >= 2 * REPAIR - 1.5, took
            asked: float = node.sidecar.metrics.restart_requests.labels("hami", ASCEND)._value.get()
            assert asked == 1
            # The kubelet restarts the plugin's container: a new plugin, a new loop.
            await node.plugin.restart()
            await writer.restart()
            await node.until("/healthz", 200, timeout=5)
            await wait_for(lambda: vendor_check(node, ASCEND)[0] is Status.OK, timeout=10, what="hami ok")
            asked = node.sidecar.metrics.restart_requests.labels("hami", ASCEND)._value.get()
            assert asked == 1
            print(f"stamp stalled: liveness failed {took:.1f}s after the loop stopped, 1 restart asked")
        finally:
            await writer.stop()
