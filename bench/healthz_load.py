"""/healthz under load from a second process on loopback, next to a bare aiohttp handler.

The server runs pinned to core 0, the load generator to core 1. Saturation: `wrk -t1 -c16`
(Debian's wrk); latency at 100 req/s: an aiohttp client sending one request every 10 ms.
Goals: >= 15,000 req/s on one core; p99 <= 1 ms at 100 req/s and <= 3 ms at saturation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time

import aiohttp

from bench.common import node, percentile
from testing import free_port

DURATION = int(os.environ.get("LOAD_SECONDS", "10"))
BARE = """
import sys
from aiohttp import web
async def ok(request):
    return web.Response(text="ok")
app = web.Application()
app.router.add_get("/healthz", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


async def wrk(url: str) -> tuple[float, float, float]:
    """Requests per second, p50 and p99 latency (ms) from `wrk -t1 -c16 --latency`.

    Run without blocking this loop: the simulated kubelet and plugin live in it and must keep
    answering the sidecar's probes, or /healthz would turn 503 under load.
    """
    argv = ["taskset", "-c", "1", "wrk", "-t1", "-c16", f"-d{DURATION}s", "--latency", url]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out = (await proc.communicate())[0].decode()
    assert "Non-2xx" not in out, out

    def ms(label: str) -> float:
        m = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)", out, re.MULTILINE)
        assert m, out
        return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return rps, ms("50"), ms("99")


async def paced(url: str, rate: float = 100.0) -> tuple[float, float]:
    """p50 and p99 (ms) of requests sent at `rate` per second for DURATION seconds."""
    latencies = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        start = time.perf_counter()
        for i in range(int(DURATION * rate)):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            t0 = time.perf_counter()
            async with http.get(url) as r:
                await r.read()
            latencies.append(time.perf_counter() - t0)
    return percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000


async def measure(name: str, url: str) -> None:
    if shutil.which("wrk"):
        rps, p50, p99 = await wrk(url)
        print(f"{name:22s} saturation (wrk -t1 -c16): {rps:8.0f} req/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    else:
        print(f"{name:22s} saturation: wrk not installed (apt-get install wrk)")
    p50, p99 = await paced(url)
    print(f"{name:22s} at 100 req/s:             p50 {p50:.2f} ms, p99 {p99:.2f} ms")


async def main() -> None:
    print(f"{os.cpu_count()} cores; servers pinned to core 0, load to core 1; {DURATION} s per figure")
    port = free_port()
    bare = await asyncio.create_subprocess_exec("taskset", "-c", "0", sys.executable, "-c", BARE, str(port))
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            await asyncio.sleep(0.05)
        await measure("bare aiohttp handler", f"http://127.0.0.1:{port}/healthz")
    finally:
        bare.terminate()
        await bare.wait()
    async with node(cpu=0) as n:
        await measure("hami-sidecar /healthz", f"{n.url}/healthz")
    print("goals: >= 15,000 req/s; p99 <= 1 ms at 100 req/s and <= 3 ms at saturation")


if __name__ == "__main__":
    asyncio.run(main())
