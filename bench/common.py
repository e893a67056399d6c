"""Shared by the benchmarks: a simulated node in this process, the real sidecar in its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import psutil

from sidecar.testing import FakeDevicePlugin, FakeKubelet, free_port

GPU = "nvidia.com/gpu"
# A second plugin whose socket name sorts before kubelet.sock (nvidia-gpu.sock sorts after).
ASCEND, ASCEND_SOCKET = "huawei.com/Ascend910B3", "Ascend910B3.sock"


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(values: Sequence[float], unit: float = 1000.0, name: str = "ms") -> str:
    return (
        f"p50 {statistics.median(values) * unit:.1f} {name}, p99 {percentile(values, 99) * unit:.1f} {name}, "
        f"max {max(values) * unit:.1f} {name} (n={len(values)})"
    )


@dataclass
class Node:
    dir: str
    kubelet: FakeKubelet
    plugin: FakeDevicePlugin
    sidecar: asyncio.subprocess.Process
    url: str
    http: aiohttp.ClientSession
    others: tuple[FakeDevicePlugin, ...] = ()

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.sidecar.pid)

    async def status(self, path: str = "/healthz") -> int:
        async with self.http.get(self.url + path) as r:
            await r.read()
            return r.status

    async def until(self, status: int, timeout: float = 30.0, path: str = "/healthz") -> float:
        """Poll as fast as the loop allows until `path` answers `status`; the time it took."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while await self.status(path) != status:
            if loop.time() - start > timeout:
                raise TimeoutError(f"{path} did not answer {status} within {timeout}s")
        return loop.time() - start


@contextlib.asynccontextmanager
async def node(
    *sidecar_args: str,
    cpu: int | None = None,
    log: str | None = None,
    keepalive: bool = True,
    ascend: bool = False,
) -> AsyncIterator[Node]:
    """A node with HAMi's NVIDIA plugin (and, with `ascend`, an Ascend plugin beside it)."""
    root = tempfile.mkdtemp(prefix="hg-bench-")
    folder = os.path.join(root, "device-plugins")
    pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "--device-plugin-dir",
        folder,
        "--pod-resources-socket",
        pod_resources,
        "--listen",
        f"127.0.0.1:{port}",
        *sidecar_args,
    ]
    if ascend:
        argv += ["--plugin", f"{GPU}=nvidia-gpu.sock", "--plugin", f"{ASCEND}={ASCEND_SOCKET}"]
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    try:
        async with (
            FakeKubelet(folder, pod_resources, dial_timeout=1.0) as kubelet,
            FakeDevicePlugin(folder, register_timeout=5, retry_interval=3600) as plugin,
            contextlib.AsyncExitStack() as stack,
        ):
            others: tuple[FakeDevicePlugin, ...] = ()
            if ascend:
                npu = FakeDevicePlugin(
                    folder, ASCEND, ASCEND_SOCKET, ["npu-0", "npu-1"], register_timeout=5, retry_interval=3600
                )
                others = (await stack.enter_async_context(npu),)
            stderr = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
            proc = await asyncio.create_subprocess_exec(*argv, stderr=stderr)
            try:
                connector = aiohttp.TCPConnector(limit=4, force_close=not keepalive)
                async with aiohttp.ClientSession(connector=connector) as http:
                    n = Node(folder, kubelet, plugin, proc, f"http://127.0.0.1:{port}", http, others)
                    for _ in range(300):
                        with contextlib.suppress(aiohttp.ClientError):
                            if await n.status("/sidecarz") == 200:
                                break
                        await asyncio.sleep(0.02)
                    await n.until(200)
                    yield n
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
                if log:
                    stderr.close()  # type: ignore[union-attr]
    finally:
        shutil.rmtree(root, ignore_errors=True)
