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

from testing import FakeDevicePlugin, FakeKubelet, free_port
from testing.realkubelet import RealKubelet, Release

GPU = "nvidia.com/gpu"
# A second plugin whose socket name sorts before kubelet.sock (nvidia-gpu.sock sorts after).
ASCEND, ASCEND_SOCKET = "huawei.com/Ascend910B3", "Ascend910B3.sock"
# Two NPUs, one vNPU each, as Ascend's plugin lists them to the kubelet: `<NPU UUID>-<i>`.
ASCEND_IDS = ["5f0e2a1c-7b3d-4e8f-9a6b-1c2d3e4f5a60-0", "5f0e2a1c-7b3d-4e8f-9a6b-1c2d3e4f5a61-0"]


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(values: Sequence[float], unit: float = 1000.0, name: str = "ms") -> str:
    return (
        f"p50 {statistics.median(values) * unit:.1f} {name}, p99 {percentile(values, 99) * unit:.1f} {name}, "
        f"max {max(values) * unit:.1f} {name} (n={len(values)})"
    )


@dataclass
class Sidecar:
    """The real sidecar in a process of its own, and an HTTP client for it."""

    child: asyncio.subprocess.Process
    url: str
    http: aiohttp.ClientSession

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.child.pid)

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


@dataclass
class Node(Sidecar):
    """A simulated node: the kubelet simulator, HAMi-like plugins, and the sidecar."""

    dir: str
    kubelet: FakeKubelet
    plugin: FakeDevicePlugin
    others: tuple[FakeDevicePlugin, ...] = ()


def sidecar_argv(
    folder: str, pod_resources: str, port: int, *sidecar_args: str, cpu: int | None = None
) -> list[str]:
    """`python -m sidecar` on 127.0.0.1:`port` against `folder` (pinned to `cpu` where taskset is)."""
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
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    return argv


@contextlib.asynccontextmanager
async def sidecar_process(
    folder: str,
    pod_resources: str,
    *sidecar_args: str,
    cpu: int | None = None,
    log: str | None = None,
    keepalive: bool = True,
) -> AsyncIterator[Sidecar]:
    """Start `python -m sidecar` on a free port against `folder`; wait until its first round ran."""
    port = free_port()
    argv = sidecar_argv(folder, pod_resources, port, *sidecar_args, cpu=cpu)
    stderr = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = await asyncio.create_subprocess_exec(*argv, stderr=stderr)
    try:
        connector = aiohttp.TCPConnector(limit=4, force_close=not keepalive)
        async with aiohttp.ClientSession(connector=connector) as http:
            sidecar = Sidecar(proc, f"http://127.0.0.1:{port}", http)
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    if await sidecar.status("/sidecarz") == 200:
                        break
                await asyncio.sleep(0.02)
            yield sidecar
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        if log:
            stderr.close()  # type: ignore[union-attr]


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
    if ascend:
        sidecar_args += ("--plugin", f"{GPU}=nvidia-gpu.sock", "--plugin", f"{ASCEND}={ASCEND_SOCKET}")
    try:
        async with (
            FakeKubelet(folder, pod_resources, dial_timeout=1.0) as kubelet,
            FakeDevicePlugin(folder, register_timeout=5, retry_interval=3600) as plugin,
            contextlib.AsyncExitStack() as stack,
        ):
            others: tuple[FakeDevicePlugin, ...] = ()
            if ascend:
                npu = FakeDevicePlugin(
                    folder, ASCEND, ASCEND_SOCKET, ASCEND_IDS, register_timeout=5, retry_interval=3600
                )
                others = (await stack.enter_async_context(npu),)
            async with sidecar_process(
                folder, pod_resources, *sidecar_args, cpu=cpu, log=log, keepalive=keepalive
            ) as sc:
                n = Node(sc.child, sc.url, sc.http, folder, kubelet, plugin, others)
                await n.until(200)
                yield n
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class RealNode:
    """The kubelet's own device manager (tests/realkubelet) with one plugin, and the sidecar."""

    dir: str
    kubelet: RealKubelet
    sidecar: Sidecar


@contextlib.asynccontextmanager
async def real_node(release: Release, *sidecar_args: str) -> AsyncIterator[RealNode]:
    root = tempfile.mkdtemp(prefix="hg-bench-")
    folder = os.path.join(root, "device-plugins")
    pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
    os.makedirs(folder)
    try:
        async with (
            RealKubelet(folder, pod_resources, release=release) as kubelet,
            sidecar_process(folder, pod_resources, *sidecar_args) as sc,
        ):
            yield RealNode(folder, kubelet, sc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
