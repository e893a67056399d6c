"""The devices check on a simulated node, and a plugin serving under another name, restarted for real.

`--expect-devices auto` reads HAMi's node configuration in HAMi's real format (the chart's device-plugin
ConfigMap `config.json`) and the driver's GPU list from files in a folder; the renamed resource runs the
simulator's plugin as its own process, killed and started again as the kubelet does on a failed
livenessProbe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import aiohttp
import pytest

from hami_guard.flags import AUTO_DEVICES
from sidecar.app import Sidecar
from sidecar.config import Settings
from sidecar.deviceplugin.budget import RESTART_BUDGET
from testing import FakeKubelet, free_port
from testing.plugin import hami_device_ids
from tests.conftest import wait_for
from tests.e2e.conftest import FAST, GPU, NodeFactory, sidecar_running
from tests.test_hamiconfig import NODE, UUIDS, Host, chart_config

PY = sys.executable
VGPU = "nvidia.com/vgpu"
# The simulator's plugin as a process of its own: serves until SIGTERM, then removes its socket.
PLUGIN = """
import asyncio, signal, sys
from testing import FakeDevicePlugin

async def main() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with FakeDevicePlugin(sys.argv[1], sys.argv[2], sys.argv[3], register_timeout=2, retry_interval=60):
        print("serving", flush=True)
        await stop.wait()

asyncio.run(main())
"""


async def test_auto_with_two_of_four_gpus_filtered_by_hamis_node_configuration_is_ready(
    make_node: NodeFactory, short_tmp: str
) -> None:
    host = Host(os.path.join(short_tmp, "host"))
    served = [UUIDS[0], UUIDS[2]]  # HAMi leaves out the filtered GPUs 1 (by UUID) and 3 (by index)
    settings = {
        "expect_devices": AUTO_DEVICES,
        "device_glob": os.path.join(host.dev, "nvidia[0-9]*"),
        "hami_config": host.config,
        "node_name": NODE,
        "driver_gpus_dir": host.gpus,
        "vfio_dir": host.vfio,
    }
    async with make_node(plugin_kwargs={"devices": hami_device_ids(served)}, **settings) as node:
        # No configuration mounted: four device nodes, two devices listed: not ready, saying so.
        body = await node.until("/readyz?verbose", 503, contains=f"devices:{GPU} failed")
        assert "the kubelet lists 2 healthy device(s) by pod-resources, 4 expected" in body
        assert "no HAMi node configuration at" in body
        Path(host.config).write_bytes(
            chart_config({"name": NODE, "filterdevices": {"uuid": [UUIDS[1]], "index": [3]}})
        )
        body = await node.until("/readyz?verbose", 200, contains=f"[+]devices:{GPU} ok")
        doc = json.loads((await node.get("/status"))[1])
        expected = doc["expected_devices"]
        assert (expected["want"], expected["host_device_nodes"]) == (2, 4)
        assert [f["device"] for f in expected["filtered"]] == [
            f"index 1, {UUIDS[1]}, {host.dev}/nvidia1",
            f"index 3, {UUIDS[3]}, {host.dev}/nvidia3",
        ]
        assert expected["filtered"][0]["why"].startswith(f"uuid listed in filterdevices of nodeconfig {NODE}")
        assert expected["filtered"][1]["why"].startswith("index listed in filterdevices")
        assert expected["hami_config"] == host.config
        reason = doc["checks"][f"devices:{GPU}"]["reason"]
        assert reason.startswith("the kubelet lists 2 (want 2: --expect-devices auto: 4 device node(s)")
        assert f"2 filtered by HAMi's node configuration: index 1, {UUIDS[1]}" in reason
        # One more GPU lost: the filter does not hide it.
        for n in range(10):
            node.plugin.set_health(f"{UUIDS[2]}-{n}", False)
        await node.until("/readyz?verbose", 503, contains="1 healthy device(s) by pod-resources, 2 expected")
        assert (await node.get("/healthz"))[0] == 200


@contextlib.asynccontextmanager
async def plugin_process(
    folder: str, resource: str, socket: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The plugin's process, up once it serves (the kubelet in this loop answers its Register)."""
    proc = await asyncio.create_subprocess_exec(
        PY, "-c", PLUGIN, folder, resource, socket, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"serving\n"
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def fast_node(dp_dir: str, short_tmp: str, **overrides: float) -> tuple[str, Settings]:
    """pod-resources' socket, and the sidecar's settings: a round every 0.2 s."""
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    settings = replace(
        FAST,
        device_plugin_dir=dp_dir,
        pod_resources_socket=pod_resources,
        port=free_port(),
        probe_interval=0.2,
        **overrides,  # type: ignore[arg-type]
    )
    return pod_resources, settings


def counted(sidecar: Sidecar, n: int) -> bool:
    return bool(sidecar.judge.registration()[GPU]["restarts_without_registration"] == n)


def rounds_past(sidecar: Sidecar, n: int) -> bool:
    return sidecar.rounds >= n


@contextlib.asynccontextmanager
async def healthz(port: int) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http:
        yield http


async def answer(http: aiohttp.ClientSession, path: str = "/healthz?verbose") -> tuple[int, str]:
    async with http.get(path) as r:
        return r.status, await r.text()


async def until(http: aiohttp.ClientSession, status: int, timeout: float = 5.0) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        code, body = await answer(http)
        if code == status:
            return body
        if loop.time() > deadline:
            pytest.fail(f"/healthz answered {code} after {timeout}s, not {status}:\n{body}")
        await asyncio.sleep(0.01)


async def test_a_renamed_resource_stops_failing_liveness_after_the_budget_and_says_what_matches(
    dp_dir: str, short_tmp: str
) -> None:
    """HAMi installed with resourceName=nvidia.com/vgpu serves nvidia-vgpu.sock; the sidecar keeps its
    default nvidia.com/gpu=nvidia-gpu.sock. Each failed liveness restarts the plugin process (here: the
    test, as the kubelet would); after the budget's three, liveness passes and says what matches."""
    pod_resources, settings = fast_node(dp_dir, short_tmp, probe_timeout=0.1, registration_grace=0.5)
    fix = "--plugin nvidia.com/vgpu=nvidia-vgpu.sock, or HAMI_GUARD_PLUGIN=nvidia.com/vgpu=nvidia-vgpu.sock"
    async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as kubelet:
        stack = contextlib.AsyncExitStack()
        async with stack:
            await stack.enter_async_context(plugin_process(dp_dir, VGPU, "nvidia-vgpu.sock"))
            await wait_for(lambda: kubelet.healthy_devices(VGPU), what="the renamed plugin's registration")
            async with sidecar_running(settings) as (sidecar, _), healthz(settings.port) as http:
                for restart in range(RESTART_BUDGET):
                    body = await until(http, 503)
                    assert f"[-]plugin:{GPU} failed: " in body
                    assert "a device plugin serves nvidia-vgpu.sock in the folder instead" in body
                    assert fix in body
                    # The kubelet restarts the plugin's container: the process stops, a new one starts.
                    await stack.aclose()
                    await stack.enter_async_context(plugin_process(dp_dir, VGPU, "nvidia-vgpu.sock"))
                    if restart < RESTART_BUDGET - 1:
                        await wait_for(partial(counted, sidecar, restart + 1), what="the restart counted")
                        assert (await answer(http))[0] == 503  # within the budget: still failing
                body = await until(http, 200)
                assert (
                    f"[!]plugin:{GPU} failed (no restart: restart budget spent: {RESTART_BUDGET} plugin "
                    "restarts did not bring nvidia-gpu.sock back)"
                ) in body
                assert fix in body
                # Then it stays so: the budget holds while the renamed plugin serves on.
                rounds = sidecar.rounds
                await wait_for(lambda: sidecar.rounds >= rounds + 5)
                assert (await answer(http))[0] == 200
                status = json.loads((await answer(http, "/status"))[1])
                reg = status["registration"][GPU]
                assert (reg["restart_budget_spent"], reg["socket_found_instead"]) == (
                    True,
                    "nvidia-vgpu.sock",
                )
                metrics = (await answer(http, "/metrics"))[1]
                assert f'device_plugin_restart_budget_spent{{plugin="hami",resource="{GPU}"}} 1.0' in metrics
                # The doctor names the mismatch and prints the setting that matches.
                doctor = await asyncio.to_thread(
                    subprocess.run,
                    [
                        PY,
                        "-m",
                        "doctor",
                        "--device-plugin-dir",
                        dp_dir,
                        "--pod-resources-socket",
                        pod_resources,
                        "--sample-interval",
                        "0",
                        "--plugin-process-name",
                        "none",
                        "--kubelet-process-name",
                        "none",
                        "--probe-timeout",
                        "0.5",
                        "--kubelet-log",
                        "/nonexistent",
                        "--plugin-log",
                        "/nonexistent",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert "plugin socket under another name" in doctor.stdout, doctor.stdout + doctor.stderr
                assert "HAMI_GUARD_PLUGIN=nvidia.com/vgpu=nvidia-vgpu.sock" in doctor.stdout
                assert "hami-doctor --plugin nvidia.com/vgpu=nvidia-vgpu.sock" in doctor.stdout


async def test_a_plugin_that_had_served_and_crashed_still_fails_at_once_whatever_the_folder_shows(
    dp_dir: str, short_tmp: str
) -> None:
    """The budget covers a socket never served; a crash of a plugin that served fails as before, even with
    another plugin's socket coming and going in the folder."""
    pod_resources, settings = fast_node(dp_dir, short_tmp)
    async with (
        FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5),
        sidecar_running(settings) as (sidecar, _),
        healthz(settings.port) as http,
    ):
        for _ in range(RESTART_BUDGET + 1):
            async with plugin_process(dp_dir, GPU, "nvidia-gpu.sock"):
                await until(http, 200)
            body = await until(http, 503, timeout=1.0)  # stopped, its socket removed: at once
            assert f"[-]plugin:{GPU} failed" in body
            async with plugin_process(dp_dir, VGPU, "nvidia-vgpu.sock"):  # another socket comes and goes
                await wait_for(partial(rounds_past, sidecar, sidecar.rounds + 3))
                assert (await answer(http))[0] == 503
        assert sidecar.judge.registration()[GPU]["restarts_without_registration"] == 0
