"""The kubelet's 5-minute stop grace, for real (`make real-slow`, not `make test`).

After a kubelet restart the kubelet keeps each resource of its checkpoint as a stopped endpoint; when
no plugin registered it within `endpointStopGracePeriod` (5 minutes, a constant in
pkg/kubelet/cm/devicemanager/types.go), the next `GetCapacity` (the node status loop's, about every
10 s) removes it and rewrites the checkpoint. The simulator, at its default stop grace, must do the
same at the same time; the sidecar must fail the registration from the first grace on, and never call
a resource it held "never registered".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from sidecar.config import Settings
from sidecar.deviceplugin.checkpoint import CheckpointError, read_checkpoint
from testing import FakeDevicePlugin, FakeKubelet, free_port
from testing.kubelet import STOP_GRACE
from testing.realkubelet import RealKubelet, RealPlugin, Release
from tests.conftest import wait_for
from tests.e2e.conftest import sidecar_running
from tests.test_realkubelet import require_fixture

GPU = "nvidia.com/gpu"
TICK = 10.0  # the node status loop's period, both kubelets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(STOP_GRACE + 180)]


def listed(checkpoint: str) -> bool | None:
    """Whether the checkpoint lists the resource; None while the kubelet has written none."""
    try:
        return GPU in read_checkpoint(checkpoint).registered
    except CheckpointError:
        return None


@contextlib.asynccontextmanager
async def folder(root: str, name: str) -> AsyncIterator[tuple[str, str]]:
    path = os.path.join(root, name, "device-plugins")
    os.makedirs(path, 0o750)
    yield path, os.path.join(root, name, "pod-resources", "kubelet.sock")


async def expiry(kubelet: RealKubelet | FakeKubelet, restarted: float) -> float:
    """Seconds from the restart to the checkpoint no longer listing the resource."""
    await wait_for(lambda: listed(kubelet.checkpoint_path) is False, timeout=STOP_GRACE + 2 * TICK + 30)
    return time.monotonic() - restarted


async def real_case(root: str, release: Release) -> tuple[float, str]:
    async with folder(root, release) as (dp, pr):
        settings = replace(
            Settings(probe_interval=1.0, probe_timeout=0.3, registration_grace=2.0, host="127.0.0.1"),
            device_plugin_dir=dp,
            pod_resources_socket=pr,
            port=free_port(),
        )
        async with (
            RealKubelet(dp, pr, release=release, capacity_interval=TICK) as kubelet,
            RealPlugin(dp, release=release, watch_kubelet=False) as plugin,
            sidecar_running(settings) as (sidecar, _),
        ):
            await wait_for(sidecar.state.all_ok, timeout=10, what="a registered node")
            # The sidecar may see the registration a moment before the kubelet writes its checkpoint
            # (20 ms apart in the kubelet's log): restarted before that, there is no grace to measure.
            await wait_for(lambda: listed(kubelet.checkpoint_path) is True, what="the checkpoint written")
            # Stamped before the restart: the grace starts inside it, so a stamp after its return would
            # shorten what is measured by the restart's own latency (22 ms short of 300 s, under load).
            restarted = time.monotonic()
            await kubelet.restart()  # the plugin misses kubelet.sock's creation
            assert await plugin.streams_open() == 0
            took = await expiry(kubelet, restarted)
            assert GPU not in (await kubelet.capacity())["capacity"]
            check = sidecar.state.checks[f"registered:{GPU}"]
            # The rewrite wakes a round: the reason follows the checkpoint within moments.
            await wait_for(lambda: "no longer lists" in check.reason, what="the reason after the expiry")
            return took, check.reason


async def simulated_case(root: str) -> float:
    async with (
        folder(root, "simulator") as (dp, pr),
        FakeKubelet(dp, pr, dial_timeout=1.0, capacity_interval=TICK) as kubelet,
        FakeDevicePlugin(dp, register_timeout=5) as plugin,
    ):
        await wait_for(lambda: kubelet.healthy_devices(GPU), what="registration")
        await wait_for(lambda: listed(kubelet.checkpoint_path) is True, what="the checkpoint written")
        plugin.register_enabled = False
        restarted = time.monotonic()
        await kubelet.restart()
        return await expiry(kubelet, restarted)


async def test_the_stop_grace_runs_out_alike_in_both_kubelets_and_the_simulator(short_tmp: str) -> None:
    for release in ("new", "old"):
        require_fixture(release)
    new, old, simulated = await asyncio.gather(
        real_case(short_tmp, "new"), real_case(short_tmp, "old"), simulated_case(short_tmp)
    )
    for took in (new[0], old[0], simulated):
        assert STOP_GRACE <= took <= STOP_GRACE + TICK + 5
    for _, reason in (new, old):
        assert "never registered" not in reason
        assert "no longer lists" in reason
    print(f"stop grace ran out after: new {new[0]:.1f} s, old {old[0]:.1f} s, simulator {simulated:.1f} s")
