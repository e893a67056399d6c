"""`make demo`: the sidecar against the embedded kubelet simulator, with a short scripted tour.

DEMO_TOUR_ONLY=1 exits after the tour (CI); otherwise it keeps serving until Ctrl-C.
DEMO_KUBELET=real runs the tour against the kubelet's own device manager (the Go fixture of
tests/realkubelet, built by `make kubelet-fixtures`) instead of the simulator; DEMO_KUBELET=dra
runs a DRA driver's tour against the kubelet's own DRA manager (testing/drademo.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable

import aiohttp

from hami_guard.flags import DeviceExpectation
from sidecar.cli import serve, setup_logging
from sidecar.config import Settings
from testing import FakeDevicePlugin, FakeKubelet, drademo, free_port
from testing.realdra import missing_reason as dra_missing
from testing.realkubelet import RealKubelet, RealPlugin, missing_reason

GPU = "nvidia.com/gpu"


Steps = Callable[["Tour"], Awaitable[None]]


class Tour:
    """The scripted part: act, wait for /healthz and /readyz to answer, show both."""

    def __init__(self, http: aiohttp.ClientSession, url: str, settings: Settings) -> None:
        self.http, self.url, self.settings = http, url, settings
        self.registered = f"[+]registered:{GPU} ok"

    async def get(self, path: str) -> tuple[int, str]:
        async with self.http.get(f"{self.url}{path}?verbose") as r:
            return r.status, await r.text()

    async def until(self, path: str, status: int, text: str = "") -> None:
        for _ in range(800):
            with contextlib.suppress(aiohttp.ClientConnectionError):
                code, body = await self.get(path)
                if code == status and text in body:
                    return
            await asyncio.sleep(0.025)

    async def step(
        self, title: str, action: Callable[[], Awaitable[object]], expect: tuple[int, int], text: str
    ) -> None:
        print(f"\n== {title}", flush=True)
        await action()
        await self.until("/healthz", expect[0], text if expect[0] == 503 else "")
        await self.until("/readyz", expect[1], text)
        for path in ("/healthz", "/readyz"):
            code, body = await self.get(path)
            print(f"$ curl -s {self.url}{path}?verbose   -> HTTP {code}\n{body}", end="", flush=True)


async def _nothing() -> None:
    return None


def simulator_tour(kubelet: FakeKubelet, plugin: FakeDevicePlugin) -> Steps:
    async def registers_again() -> None:
        while not kubelet.connected(GPU) or not kubelet.healthy_devices(GPU):
            await asyncio.sleep(0.01)

    async def restart() -> None:
        await kubelet.restart()
        await registers_again()

    async def restart_unregistered() -> None:
        plugin.register_enabled = False  # the plugin misses kubelet.sock's creation
        await kubelet.restart()

    async def restart_plugin() -> None:
        plugin.register_enabled = True
        await plugin.restart()  # what the kubelet does after the livenessProbe's 503s
        await registers_again()

    async def hang() -> None:
        plugin.hung = True

    async def recover() -> None:
        plugin.hung = False

    async def gpus(healthy: bool) -> None:
        for device in ("GPU-0", "GPU-1"):
            plugin.set_health(device, healthy)

    async def steps(t: Tour) -> None:
        await t.step("1. a healthy node", _nothing, (200, 200), t.registered)
        await t.step(
            "2. the kubelet restarts; the plugin registers again (never a 503)",
            restart,
            (200, 200),
            t.registered,
        )
        await t.step(
            "3. the kubelet restarts and the plugin does NOT register again: no GPU on the node. "
            f"Pending for the grace ({t.settings.registration_grace:g} s), then liveness fails",
            restart_unregistered,
            (503, 503),
            f"[-]registered:{GPU} failed",
        )
        await t.step(
            "4. the kubelet restarts the plugin; it registers", restart_plugin, (200, 200), t.registered
        )
        await t.step(
            "5. the kubelet drops the plugin, which keeps serving: liveness fails within an interval",
            lambda: kubelet.drop(GPU),  # kubernetes issues 121994, 131013
            (503, 503),
            "no longer connected",
        )
        await t.step("6. a plugin restart registers it again", restart_plugin, (200, 200), t.registered)
        await t.step("7. the plugin hangs: the next probe times out", hang, (503, 503), "timeout")
        await t.step("8. the plugin answers again", recover, (200, 200), t.registered)
        await t.step(
            "9. every GPU turns unhealthy: still registered, a restart would not help; not ready",
            lambda: gpus(False),
            (200, 503),
            f"[!]devices:{GPU} failed",
        )
        await t.step("10. the GPUs recover", lambda: gpus(True), (200, 200), f"[+]devices:{GPU} ok")

    return steps


def real_tour(kubelet: RealKubelet, plugin: RealPlugin) -> Steps:
    async def restart(unlink: bool) -> None:
        mark = plugin.mark()
        await kubelet.restart(unlink_socket=unlink)
        await plugin.restart()  # HAMi serves and registers again when kubelet.sock is created
        await plugin.wait_event("stream-open", after=mark)

    async def gpus(healthy: bool) -> None:
        for device in ("GPU-0", "GPU-1"):
            await plugin.set_health(device, healthy)

    async def steps(t: Tour) -> None:
        await t.step(f"1. a healthy node (kubernetes {kubelet.version})", _nothing, (200, 200), t.registered)
        await t.step(
            "2. the kubelet is killed and restarts; the plugin registers again (never a 503)",
            lambda: restart(False),
            (200, 200),
            t.registered,
        )
        await t.step(
            "3. the kubelet restarts and the plugin does NOT register again: no GPU on the node. "
            f"Pending for the grace ({t.settings.registration_grace:g} s), then liveness fails",
            kubelet.restart,
            (503, 503),
            f"[-]registered:{GPU} failed",
        )
        await t.step(
            "4. the kubelet restarts the plugin; it registers", plugin.restart, (200, 200), t.registered
        )
        await t.step(
            "5. every GPU turns unhealthy: still registered, a restart would not help; not ready",
            lambda: gpus(False),
            (200, 503),
            f"[!]devices:{GPU} failed",
        )
        await t.step("6. the GPUs recover", lambda: gpus(True), (200, 200), f"[+]devices:{GPU} ok")
        await t.step("7. the plugin stops serving", plugin.stop_serving, (503, 503), f"[-]plugin:{GPU}")

    return steps


async def _tour(tour_only: bool, real: bool) -> int:
    root = tempfile.mkdtemp(prefix="hami-guard-demo-")
    folder = os.path.join(root, "device-plugins")
    pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
    settings = Settings(
        device_plugin_dir=folder,
        pod_resources_socket=pod_resources,
        host="127.0.0.1",
        port=free_port(),
        probe_interval=2.0,
        probe_timeout=0.5,
        registration_grace=3.0,
        expect_devices=DeviceExpectation.at_least(2),
    )
    url = f"http://127.0.0.1:{settings.port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if real:
                kubelet = await stack.enter_async_context(RealKubelet(folder, pod_resources))
                plugin = await stack.enter_async_context(RealPlugin(folder, watch_kubelet=False))
                steps = real_tour(kubelet, plugin)
                where = f"the kubelet's own device manager ({kubelet.version}): {kubelet.socket_path}"
            else:
                fake = await stack.enter_async_context(FakeKubelet(folder, pod_resources, dial_timeout=1.0))
                fake_plugin = FakeDevicePlugin(
                    folder, GPU, "nvidia-gpu.sock", ["GPU-0", "GPU-1"], register_timeout=5
                )
                await stack.enter_async_context(fake_plugin)
                steps = simulator_tour(fake, fake_plugin)
                where = f"kubelet simulator: {fake.socket_path}"
            server = loop.create_task(serve(settings, stop))
            async with aiohttp.ClientSession() as http:
                print(f"hami-sidecar demo in {root}\n  {where}")
                print(f"  endpoints: {url}/healthz  {url}/readyz  {url}/status  {url}/metrics")
                print(
                    "  /healthz is the plugin's livenessProbe (503 = restart it), /readyz its readinessProbe"
                )
                print(f"  try: curl -s '{url}/readyz?verbose'", flush=True)
                await steps(Tour(http, url, settings))
                async with http.get(f"{url}/metrics") as r:
                    lines = [
                        ln
                        for ln in (await r.text()).splitlines()
                        if ln.startswith(("device_plugin_registration", "device_plugin_liveness"))
                    ]
                print("\n== registration metrics\n" + "\n".join(lines), flush=True)
                if tour_only:
                    stop.set()
                else:
                    print("\nserving until Ctrl-C", flush=True)
            await server
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("demo stopped, folder removed", flush=True)
    return 0


def run_demo() -> int:
    setup_logging("text", "INFO")
    logging.getLogger("testing").setLevel(logging.WARNING)
    tour_only = os.environ.get("DEMO_TOUR_ONLY", "") not in ("", "0")
    real = os.environ.get("DEMO_KUBELET", "simulator") == "real"
    if os.environ.get("DEMO_KUBELET") == "dra":  # a DRA driver's tour (testing/drademo.py)
        if (why := dra_missing("new")) is not None:
            print(f"error: DEMO_KUBELET=dra: {why}", file=sys.stderr)
            return 2
        return drademo.run(tour_only)
    if real and (why := missing_reason("new")) is not None:
        print(f"error: DEMO_KUBELET=real: {why}", file=sys.stderr)
        return 2
    return asyncio.run(_tour(tour_only, real))


if __name__ == "__main__":
    sys.exit(run_demo())
