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
        registration_grace=10.0,
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

                async def healthz() -> tuple[int, str]:
                    async with http.get(f"{url}/healthz?verbose") as r:
                        return r.status, await r.text()

                async def until(status: int, text: str = "") -> None:
                    for _ in range(400):
                        with contextlib.suppress(aiohttp.ClientConnectionError):
                            code, body = await healthz()
                            if code == status and text in body:
                                return
                        await asyncio.sleep(0.025)

                async def step(
                    title: str, action: Callable[[], Awaitable[None]], status: int, text: str
                ) -> None:
                    print(f"\n== {title}", flush=True)
                    await action()
                    await until(status, text)
                    code, body = await healthz()
                    print(f"$ curl -s {url}/healthz?verbose   -> HTTP {code}\n{body}", end="", flush=True)

                print(f"hami-sidecar demo in {root}\n  kubelet simulator: {kubelet.socket_path}")
                print(f"  endpoints: {url}/healthz  {url}/readyz  {url}/status  {url}/metrics")
                print(f"  try: curl -s '{url}/healthz?verbose'", flush=True)

                async def nothing() -> None:
                    return None

                async def restart() -> None:
                    before = kubelet.register_calls[GPU]
                    await kubelet.restart()
                    while kubelet.register_calls[GPU] == before or not kubelet.healthy_devices(GPU):
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.1)  # the checkpoint event reaches the sidecar

                async def hang() -> None:
                    plugin.hung = True

                async def recover() -> None:
                    plugin.hung = False

                await step("1. a healthy node", nothing, 200, f"[+]registered:{GPU} ok")
                await step(
                    "2. the kubelet restarts; the plugin registers again (never a 503)",
                    restart,
                    200,
                    f"[+]registered:{GPU} ok",
                )
                await step("3. the plugin hangs: the next probe times out", hang, 503, "timeout")
                await step("4. the plugin answers again", recover, 200, f"[+]plugin:{GPU} ok")
                await until(200, f"[+]registered:{GPU} ok")
                async with http.get(f"{url}/metrics") as r:
                    lines = [
                        ln
                        for ln in (await r.text()).splitlines()
                        if ln.startswith("device_plugin_registration")
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
