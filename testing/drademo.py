"""`make demo-dra` (DEMO_KUBELET=dra make demo): a DRA driver's tour against the kubelet's own plugin
manager and DRA manager (tests/realdra, built by `make dra-fixtures`), with the sidecar watching it.

DEMO_TOUR_ONLY=1 exits after the tour; otherwise it keeps serving until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable

import aiohttp

from sidecar.cli import serve
from sidecar.config import Settings
from sidecar.dra.spec import DraSpec
from testing import free_port
from testing.realdra import RealDraDriver, RealDraKubelet

DRIVER = "gpu.example.com"
GRACE = 4.0


async def _tour(tour_only: bool) -> int:
    root = tempfile.mkdtemp(prefix="hami-guard-dra-demo-")
    registry = os.path.join(root, "plugins_registry")
    folder = os.path.join(root, "device-plugins")
    os.makedirs(registry)
    os.makedirs(folder)
    settings = Settings(
        device_plugin_dir=folder,
        plugins=(),
        dra_drivers=(DraSpec(DRIVER, os.path.join(registry, f"{DRIVER}-reg.sock")),),
        dra_grace=GRACE,
        host="127.0.0.1",
        port=free_port(),
        probe_interval=1.0,
        probe_timeout=0.5,
    )
    url = f"http://127.0.0.1:{settings.port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    kubelet = RealDraKubelet(registry, os.path.join(root, "state"), os.path.join(folder, "kubelet.sock"))
    drivers: list[RealDraDriver] = []

    def new_driver() -> RealDraDriver:
        d = RealDraDriver(DRIVER, registry, os.path.join(root, "plugins", DRIVER))
        drivers.append(d)
        return d

    try:
        driver = new_driver()
        await driver.start()
        server = loop.create_task(serve(settings, stop))
        async with aiohttp.ClientSession() as http:

            async def healthz() -> tuple[int, str]:
                async with http.get(f"{url}/healthz?verbose") as r:
                    lines = [ln for ln in (await r.text()).splitlines() if "dra-" in ln or "healthz" in ln]
                    return r.status, "\n".join(lines)

            async def step(title: str, action: Callable[[], Awaitable[object]], code: int, text: str) -> None:
                print(f"\n== {title}", flush=True)
                await action()
                body = ""
                for _ in range(600):
                    with contextlib.suppress(aiohttp.ClientConnectionError):
                        got, body = await healthz()
                        if got == code and text in body:
                            break
                    await asyncio.sleep(0.05)
                print(f"$ curl -s {url}/healthz?verbose   -> HTTP {got}\n{body}", flush=True)

            async def nothing() -> None:
                return None

            async def refused_restart() -> None:
                nonlocal driver
                await driver.stop()
                driver = new_driver()
                await driver.start()
                await driver.set("refuse", True)

            async def kubelet_restart() -> None:
                await kubelet.restart(crash=True)

            print(f"hami-sidecar DRA demo in {root}\n  the kubelet's own plugin manager and DRA manager")
            print(f"  driver {DRIVER}: registration {driver.registration}, service {driver.service}")
            print(f"  endpoints: {url}/healthz  {url}/status  {url}/metrics  (DRA grace {GRACE:g} s)")
            await step(
                "the driver runs, no kubelet yet: readiness only", nothing, 200, "kubelet is not running"
            )
            await step(
                "the kubelet starts and registers it", kubelet.start, 200, f"[+]dra-registered:{DRIVER}"
            )
            await step(
                "a new driver instance whose NotifyRegistrationStatus refuses: running, not registered, "
                f"503 after the grace ({GRACE:g} s)",
                refused_restart,
                503,
                "not registered",
            )
            await step(
                "the refusal ends: the kubelet's retry registers it",
                lambda: driver.set("refuse", False),
                200,
                f"[+]dra-registered:{DRIVER}",
            )
            await step(
                "the kubelet is killed and restarts: never a 503", kubelet_restart, 200, "[+]dra-registered"
            )
            await step(
                "the driver's DRA service hangs, registration still answers: the kubelet keeps it and "
                "reports it connected, its calls time out; 503 after the grace",
                lambda: driver.set("hang-service", True),
                503,
                "hung DRA service",
            )
            await step(
                "the DRA service answers again",
                lambda: driver.set("hang-service", False),
                200,
                "[+]dra-plugin",
            )
            await step(
                "the driver's DRA service dies, registration still answers: 503 after the grace",
                driver.service_off,
                503,
                "does not exist",
            )
            async with http.get(f"{url}/metrics") as r:
                lines = [
                    ln
                    for ln in (await r.text()).splitlines()
                    if "dra-" in ln and ln.startswith("device_plugin_check")
                ]
            print("\n== DRA metrics\n" + "\n".join(lines), flush=True)
            if tour_only:
                stop.set()
            else:
                print("\nserving until Ctrl-C", flush=True)
            await server
    finally:
        for d in drivers:
            await d.close()
        await kubelet.close()
        shutil.rmtree(root, ignore_errors=True)
    print("demo stopped, folder removed", flush=True)
    return 0


def run(tour_only: bool) -> int:
    return asyncio.run(_tour(tour_only))
