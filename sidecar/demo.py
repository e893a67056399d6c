"""`make demo`: the sidecar against the embedded kubelet simulator, with a short scripted tour.

DEMO_TOUR_ONLY=1 exits after the tour (CI); otherwise it keeps serving until Ctrl-C.
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

from sidecar.cli import serve, setup_logging
from sidecar.config import Settings
from sidecar.testing import FakeDevicePlugin, FakeKubelet, free_port

GPU = "nvidia.com/gpu"


async def _tour(tour_only: bool) -> int:
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
        expect_devices=2,
    )
    url = f"http://127.0.0.1:{settings.port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with (
            FakeKubelet(folder, pod_resources, dial_timeout=1.0) as kubelet,
            FakeDevicePlugin(
                folder, GPU, "nvidia-gpu.sock", ["GPU-0", "GPU-1"], register_timeout=5
            ) as plugin,
        ):
            server = loop.create_task(serve(settings, stop))
            async with aiohttp.ClientSession() as http:

                async def get(path: str) -> tuple[int, str]:
                    async with http.get(f"{url}{path}?verbose") as r:
                        return r.status, await r.text()

                async def until(path: str, status: int, text: str = "") -> None:
                    for _ in range(800):
                        with contextlib.suppress(aiohttp.ClientConnectionError):
                            code, body = await get(path)
                            if code == status and text in body:
                                return
                        await asyncio.sleep(0.025)

                async def step(
                    title: str,
                    action: Callable[[], Awaitable[None]],
                    expect: tuple[int, int],
                    text: str,
                ) -> None:
                    """Act, wait for /healthz and /readyz to answer `expect`, show both."""
                    print(f"\n== {title}", flush=True)
                    await action()
                    await until("/healthz", expect[0], text if expect[0] == 503 else "")
                    await until("/readyz", expect[1], text)
                    for path in ("/healthz", "/readyz"):
                        code, body = await get(path)
                        print(f"$ curl -s {url}{path}?verbose   -> HTTP {code}\n{body}", end="", flush=True)

                print(f"hami-sidecar demo in {root}\n  kubelet simulator: {kubelet.socket_path}")
                print(f"  endpoints: {url}/healthz  {url}/readyz  {url}/status  {url}/metrics")
                print(
                    "  /healthz is the plugin's livenessProbe (503 = restart it), /readyz its readinessProbe"
                )
                print(f"  try: curl -s '{url}/readyz?verbose'", flush=True)
                registered = f"[+]registered:{GPU} ok"

                async def nothing() -> None:
                    return None

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

                async def drop() -> None:
                    await kubelet.drop(GPU)  # the kubelet lets go (kubernetes 121994, 131013)

                async def hang() -> None:
                    plugin.hung = True

                async def recover() -> None:
                    plugin.hung = False

                async def gpus_unhealthy() -> None:
                    for device in ("GPU-0", "GPU-1"):
                        plugin.set_health(device, False)

                async def gpus_healthy() -> None:
                    for device in ("GPU-0", "GPU-1"):
                        plugin.set_health(device, True)

                await step("1. a healthy node", nothing, (200, 200), registered)
                await step(
                    "2. the kubelet restarts; the plugin registers again (never a 503)",
                    restart,
                    (200, 200),
                    registered,
                )
                await step(
                    "3. the kubelet restarts and the plugin does NOT register again: no GPU on the node. "
                    f"Pending for the grace ({settings.registration_grace:g} s), then liveness fails",
                    restart_unregistered,
                    (503, 503),
                    f"[-]registered:{GPU} failed",
                )
                await step(
                    "4. the kubelet restarts the plugin; it registers", restart_plugin, (200, 200), registered
                )
                await step(
                    "5. the kubelet drops the plugin, which keeps serving: liveness fails within an interval",
                    drop,
                    (503, 503),
                    "no longer connected",
                )
                await step("6. a plugin restart registers it again", restart_plugin, (200, 200), registered)
                await step("7. the plugin hangs: the next probe times out", hang, (503, 503), "timeout")
                await step("8. the plugin answers again", recover, (200, 200), registered)
                await step(
                    "9. every GPU turns unhealthy: still registered, a restart would not help; not ready",
                    gpus_unhealthy,
                    (200, 503),
                    f"[!]devices:{GPU} failed",
                )
                await step("10. the GPUs recover", gpus_healthy, (200, 200), f"[+]devices:{GPU} ok")
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
    logging.getLogger("sidecar.testing").setLevel(logging.WARNING)
    tour_only = os.environ.get("DEMO_TOUR_ONLY", "") not in ("", "0")
    return asyncio.run(_tour(tour_only))


if __name__ == "__main__":
    sys.exit(run_demo())
