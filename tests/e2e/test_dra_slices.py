"""The node's ResourceSlices as optional DRA evidence, against a real API server (tests/apiserver.py)
with the DRA fixture's kubelet (its DRA manager wipes for real) and driver (the plugin helper
publishes for real), k8s.io/kubernetes v1.37.2.

Marked slow and not in `make real-slow`: it needs `make node-bins` (kube-apiserver) and etcd;
`make dra-slices` runs it (.ci/run does, after node-bins). About a minute: the kubelet's wiping
delay is 30 s.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from sidecar.dra.slices import ApiAccess, read_slices
from sidecar.dra.spec import DraSpec
from sidecar.dra.verdicts import Judgement
from sidecar.dra.watch import SLICES_EVERY, DraWatch
from sidecar.health import Status
from testing import free_port
from testing.realdra import RealDraDriver, RealDraKubelet
from tests import apiserver
from tests.conftest import require_dra_fixture
from tests.test_realdra import Clock

pytestmark = pytest.mark.slow
DRIVER = "gpu.example.com"
NODE = "node-1"


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
        await server.setup_node(NODE)
        yield server
    finally:
        server.stop()


async def test_resourceslices_are_evidence_and_never_a_verdict(
    short_tmp: str, api: apiserver.ApiServer
) -> None:
    require_dra_fixture("new")
    registry = os.path.join(short_tmp, "plugins_registry")
    os.makedirs(registry)
    kubelet_socket = os.path.join(short_tmp, "kubelet.sock")
    kubelet = RealDraKubelet(
        registry, os.path.join(short_tmp, "state"), kubelet_socket, kubeconfig=api.kubeconfig()
    )
    driver = RealDraDriver(
        DRIVER, registry, os.path.join(short_tmp, "plugins", DRIVER), kubeconfig=api.kubeconfig()
    )
    clock = Clock()
    spec = DraSpec(DRIVER, os.path.join(registry, f"{DRIVER}-reg.sock"))

    def watch(access: ApiAccess | None) -> DraWatch:
        return DraWatch([spec], kubelet_socket, timeout=2.0, clock=clock, api=access, node=NODE)

    allowed = watch(ApiAccess(api.url, api.token_file("slices"), api.ca_file))
    forbidden = watch(ApiAccess(api.url, api.token_file("nobody"), api.ca_file))
    unknown = watch(ApiAccess(api.url, os.path.join(short_tmp, "no-token"), api.ca_file))
    nobody_home = watch(ApiAccess(f"https://127.0.0.1:{free_port()}", api.token_file("slices"), api.ca_file))
    without = watch(None)
    watches = [allowed, forbidden, unknown, nobody_home, without]

    async def verdicts() -> list[Judgement]:
        clock.now += SLICES_EVERY  # each reads the API again
        return [(await w.round())[DRIVER][1] for w in watches]

    try:
        await kubelet.start()
        await driver.start()
        async with asyncio.timeout(15):
            while not await kubelet.usable(DRIVER):
                await asyncio.sleep(0.05)
        await driver.publish(2)
        async with asyncio.timeout(15):
            while (await read_slices(allowed.api or ApiAccess(""), NODE, 2.0)).of(DRIVER) != (1, 2):
                await asyncio.sleep(0.2)
        j = await verdicts()
        # Every one registered: the reading adds to the reason, whatever the API answers.
        assert all(x.registered.status is Status.OK for x in j), j
        assert "1 ResourceSlice of the driver on this node (2 devices)" in j[0].registered.reason, j[0]
        assert "answered 403 (no evidence)" in j[1].registered.reason, j[1]
        assert "no ServiceAccount token" in j[2].registered.reason, j[2]
        assert "cannot be asked" in j[3].registered.reason, j[3]
        assert "ResourceSlice" not in j[4].registered.reason, j[4]
        # The DRA service dies, registration answers: the kubelet wipes the slices 30 s later.
        await driver.service_off()
        async with asyncio.timeout(60):
            while (await read_slices(allowed.api or ApiAccess(""), NODE, 2.0)).of(DRIVER) != (0, 0):
                await asyncio.sleep(0.5)
        j = await verdicts()
        assert all(x.registered.status is not Status.OK for x in j), j
        assert "no ResourceSlice of the driver on this node" in j[0].registered.reason, j[0]
        # The same verdict with and without the API: evidence only.
        assert {(x.registered.status, x.registered.restarts) for x in j} == {
            (j[4].registered.status, j[4].registered.restarts)
        }, j
    finally:
        for w in watches:
            w.close()
        await driver.close()
        await kubelet.close()
