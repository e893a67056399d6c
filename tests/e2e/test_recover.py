"""--recover-unhealthy-after against the kubelet's real device manager and PodResources server.

The fixture plugin plays HAMi's: a device it reports Unhealthy stays so until its process is replaced,
which is what the livenessProbe's restart of HAMi's container does (HAMi re-reads every device at start).
The test plays the kubelet's livenessProbe: on a 503 for `recover:`, it replaces the plugin's process.
The driver's GPUs are a folder of `information` files, as /proc/driver/nvidia/gpus holds them.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from sidecar.server.status import status_document
from testing.realkubelet import RealPlugin
from tests.e2e.conftest import Watch
from tests.e2e.realnode import GPU, UUIDS, RealNode
from tests.e2e.test_real_kubelet import NO_PROCESS_LOOKUP
from tests.test_doctor import Doctor, row

RECOVER = f"recover:{GPU}"
AFTER = 1.0


def driver(tmp_path: Path) -> dict[str, Any]:
    """The settings of a node whose driver lists both GPUs (and no device node is read from /dev)."""
    gpus = tmp_path / "gpus"
    for n, uuid in enumerate(UUIDS):
        folder = gpus / f"0000:0{n + 1}:00.0"
        folder.mkdir(parents=True)
        (folder / "information").write_text(
            f"Model: \t\t Test GPU\nGPU UUID: \t {uuid}\nDevice Minor: \t {n}\n"
        )
    return {
        "recover_unhealthy_after": AFTER,
        "driver_gpus_dir": str(gpus),
        "device_glob": str(tmp_path / "no-dev" / "nvidia[0-9]*"),
    }


async def unhealthy(node: RealNode, plugin: RealPlugin, device: str) -> None:
    """An XID: the plugin reports `device` Unhealthy, and the kubelet has applied it (its own view,
    polled: `applied` counts the lists of one stream since the kubelet's start, and a restarted
    plugin's is the second)."""
    generation = await plugin.set_health(device, False)
    await plugin.wait_event("sent", lambda e: e["generation"] == generation, timeout=30)
    deadline = time.monotonic() + 30
    while device in await node.kubelet.healthy_devices(GPU):
        assert time.monotonic() < deadline, f"the kubelet still lists {device} healthy"
        await asyncio.sleep(0.02)


async def restarted(node: RealNode, plugin: RealPlugin) -> RealPlugin:
    """The livenessProbe's restart of the plugin's container: a new process, which re-reads the devices."""
    await plugin.close()
    fresh = await node.plugin(devices=list(UUIDS))
    await node.until("/readyz", 200)
    return fresh


async def metric(node: RealNode, name: str) -> float:
    text = (await node.get("/metrics"))[1]
    prefix = f'{name}{{plugin="hami",resource="{GPU}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix) :])


async def test_a_transient_unhealthy_gpu_is_brought_back_by_one_plugin_restart(
    node_factory: Any, tmp_path: Path
) -> None:
    async with node_factory(**driver(tmp_path)) as node:
        plugin = await node.plugin(devices=list(UUIDS))
        await node.until("/readyz", 200)
        await unhealthy(node, plugin, UUIDS[0])
        took = await node.until("/healthz?verbose", 503, contains=f"[-]{RECOVER} failed: {UUIDS[0]}")
        assert took >= AFTER - node.settings.probe_interval
        assert await metric(node, "device_plugin_unhealthy_recovery_restarts_total") == 1
        await restarted(node, plugin)
        assert sorted(await node.kubelet.healthy_devices(GPU)) == sorted(UUIDS)
        assert (await node.get("/healthz"))[0] == 200
        doc = status_document(node.sidecar)["unhealthy_recovery"][GPU]
        assert (doc["restarts"], list(doc["recovered"]), doc["really_unhealthy"]) == (1, [UUIDS[0]], {})
        assert await metric(node, "device_plugin_unhealthy_devices_recovered_total") == 1
        assert status_document(node.sidecar)["checks"][RECOVER]["reason"] == (
            f"brought back by a plugin restart: {UUIDS[0]}"
        )


async def test_a_gpu_unhealthy_again_after_its_restart_gets_no_more_restarts(
    node_factory: Any, tmp_path: Path
) -> None:
    async with node_factory(**driver(tmp_path)) as node:
        plugin = await node.plugin(devices=list(UUIDS))
        await node.until("/readyz", 200)
        await unhealthy(node, plugin, UUIDS[0])
        await node.until("/healthz?verbose", 503, contains=RECOVER)
        plugin = await restarted(node, plugin)
        watch = Watch(node, "/healthz", pause=0.005)
        try:
            await unhealthy(node, plugin, UUIDS[0])  # the XID again: the GPU is really broken
            await node.until(
                "/readyz?verbose",
                503,
                contains=f"[!]{RECOVER} failed (no restart: the GPU is really unhealthy",
            )
            await asyncio.sleep(AFTER + 2 * node.settings.probe_interval)
        finally:
            answers = await watch.stop()
        assert answers and set(answers) == {200}
        doc = status_document(node.sidecar)["unhealthy_recovery"][GPU]
        assert (doc["restarts"], list(doc["really_unhealthy"])) == (1, [UUIDS[0]])
        assert await metric(node, "device_plugin_unhealthy_recovery_restarts_total") == 1
        assert await metric(node, "device_plugin_unhealthy_devices_unrecoverable") == 1
        # hami-doctor, run in the pod, says what was done: one restart, and the GPU really unhealthy.
        tmp = os.path.dirname(node.dir)
        logs = [os.path.join(tmp, name) for name in ("kubelet.log", "plugin.log")]
        for log in logs:
            open(log, "a").close()
        url = f"http://127.0.0.1:{node.settings.port}/status"
        code, report = await Doctor(node.dir, tmp, *logs).report(*NO_PROCESS_LOOKUP, "--sidecar-status", url)
        assert code == 1
        evidence = " ".join(row(report, "unhealthy-devices")["evidence"])
        assert f"{GPU}: the sidecar asked for 1 plugin restart(s) to re-read unhealthy devices" in evidence
        assert f"{UUIDS[0]} unhealthy again after the plugin restart that re-read it" in evidence


async def test_a_gpu_a_running_pod_holds_is_never_taken_by_a_restart(
    node_factory: Any, tmp_path: Path
) -> None:
    async with node_factory(**driver(tmp_path)) as node:
        plugin = await node.plugin(devices=list(UUIDS))
        await node.until("/readyz", 200)
        [held] = await node.kubelet.allocate("train-0", "main", GPU, 1)
        watch = Watch(node, "/healthz", pause=0.005)
        try:
            await unhealthy(node, plugin, held)
            await node.until(
                "/readyz?verbose", 503, contains=f"a running pod holds a device not listed healthy ({held} by"
            )
            await asyncio.sleep(AFTER + 2 * node.settings.probe_interval)
        finally:
            answers = await watch.stop()
        assert answers and set(answers) == {200}
        assert await plugin.streams_open() == 1  # never restarted
        assert status_document(node.sidecar)["unhealthy_recovery"][GPU]["restarts"] == 0
        assert os.path.exists(plugin.socket_path)
