"""A node whose kubelet is the real device manager (tests/realkubelet), with the sidecar in process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest

from sidecar.app import Sidecar
from sidecar.config import PluginSpec, Settings
from testing import free_port
from testing.realkubelet import RealKubelet, RealPlugin, Release
from tests.conftest import wait_for
from tests.e2e.running import sidecar_running

GPU = "nvidia.com/gpu"
UUIDS = ("GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f", "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60")
SETTINGS = Settings(probe_interval=0.5, probe_timeout=0.3, registration_grace=1.5, host="127.0.0.1")


def restarts_seen(node: RealNode, count: int) -> bool:
    return node.sidecar.judge.kubelet_restarts >= count


class Asks:
    """What a test node asks its sidecar over HTTP (its `settings.port`, through `http`)."""

    settings: Settings
    http: aiohttp.ClientSession
    until_timeout = 10.0

    async def get(self, path: str) -> tuple[int, str]:
        async with self.http.get(f"http://127.0.0.1:{self.settings.port}{path}") as r:
            return r.status, await r.text()

    async def until(self, path: str, status: int, timeout: float | None = None, contains: str = "") -> float:
        """Poll until `path` answers `status` (containing `contains`); the seconds it took."""
        timeout = self.until_timeout if timeout is None else timeout
        started = time.monotonic()
        while True:
            code, body = await self.get(path)
            if code == status and contains in body:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                pytest.fail(f"{path} answered {code} after {timeout}s, not {status} {contains!r}:\n{body}")
            await asyncio.sleep(0.005)


@dataclass
class RealNode(Asks):
    dir: str
    kubelet: RealKubelet
    sidecar: Sidecar
    settings: Settings
    http: aiohttp.ClientSession
    release: Release
    plugins: list[RealPlugin]

    async def rounds(self, n: int = 2) -> None:
        target = self.sidecar.rounds + n
        await wait_for(lambda: self.sidecar.rounds >= target, what="probe rounds")

    async def plugin(self, *args: Any, start: bool = True, **kwargs: Any) -> RealPlugin:
        """A plugin of this node's release, closed with the node; started unless told otherwise."""
        p = RealPlugin(self.dir, *args, release=self.release, **kwargs)
        self.plugins.append(p)
        if start:
            mark = p.mark()
            await p.start()
            if kwargs.get("register", True):
                await p.wait_event("stream-open", after=mark)
        return p


@contextlib.asynccontextmanager
async def real_node(
    dp_dir: str,
    short_tmp: str,
    release: Release,
    sockets: Iterable[str] = ("nvidia-gpu.sock",),
    kubelet_netns: bool = False,
    *,
    name_kubelet: bool = False,
    **overrides: Any,
) -> AsyncIterator[RealNode]:
    """`kubelet_netns`: the kubelet in a network namespace of its own, the sidecar and plugins in the
    test's, as in a pod without hostNetwork (the sidecar reads the kubelet's /proc/<pid>/net/unix).
    `overrides` may name the plugins (`plugins=`) in place of `sockets` of nvidia.com/gpu."""
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    overrides.setdefault("plugins", tuple(PluginSpec(GPU, s) for s in sockets))
    settings = replace(
        SETTINGS, device_plugin_dir=dp_dir, pod_resources_socket=pod_resources, port=free_port(), **overrides
    )
    plugins: list[RealPlugin] = []
    async with RealKubelet(
        dp_dir, pod_resources, release=release, netns=kubelet_netns, unique_name=name_kubelet
    ) as kubelet:
        if kubelet_netns or name_kubelet:  # `name_kubelet`: the sidecar finds the kubelet by its name
            settings = replace(settings, kubelet_process_name=kubelet.process_name)
        try:
            async with sidecar_running(settings) as (sidecar, _), aiohttp.ClientSession() as http:
                yield RealNode(dp_dir, kubelet, sidecar, settings, http, release, plugins)
        finally:
            for p in plugins:
                await p.close()
