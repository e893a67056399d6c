"""A node in a temporary folder: FakeKubelet, FakeDevicePlugin, the real sidecar on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest

from sidecar.app import Sidecar
from sidecar.config import PluginSpec, Settings
from testing import FakeDevicePlugin, FakeKubelet, free_port
from testing.realkubelet import Release, selected_releases
from tests.conftest import wait_for
from tests.e2e.realnode import real_node
from tests.e2e.running import sidecar_running
from tests.test_realkubelet import require_fixture

GPU = "nvidia.com/gpu"
# Short settings so that every scenario runs in a second or two.
FAST = Settings(
    probe_interval=1.0,
    probe_timeout=0.3,
    registration_grace=2.0,
    host="127.0.0.1",
    # Never the machine's own: HAMi's node configuration, the driver's GPUs, vfio-bound devices.
    hami_config="/nonexistent/hami/config.json",
    driver_gpus_dir="/nonexistent/nvidia/gpus",
    vfio_dir="/nonexistent/vfio-pci",
)


@dataclass
class Node:
    dir: str
    kubelet: FakeKubelet
    plugin: FakeDevicePlugin
    sidecar: Sidecar
    settings: Settings
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    async def get(self, path: str = "/healthz?verbose") -> tuple[int, str]:
        async with self.http.get(self.url + path) as r:
            return r.status, await r.text()

    async def wait_rounds(self, done: Callable[[], object] = lambda: True, rounds: int = 2) -> None:
        """Wait for `rounds` more probe rounds, and for `done`: progress, not a sleep."""
        target = self.sidecar.rounds + rounds
        await wait_for(lambda: self.sidecar.rounds >= target and done(), what="probe rounds")

    async def until(self, path: str, status: int, timeout: float = 5.0, contains: str = "") -> str:
        """Poll `path` every 5 ms until it answers `status` (and contains `contains`); the body."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            code, body = await self.get(path)
            if code == status and contains in body:
                return body
            if loop.time() > deadline:
                pytest.fail(f"{path} answered {code} after {timeout}s, not {status} {contains!r}:\n{body}")
            await asyncio.sleep(0.005)


NodeFactory = Callable[..., contextlib.AbstractAsyncContextManager[Node]]


class Watch:
    """Polls a path in the background (`/healthz?verbose` by default) and records every answer."""

    def __init__(self, node: Any, path: str = "/healthz?verbose", pause: float = 0.003) -> None:
        self.node, self.path, self.pause = node, path, pause
        self.seen: list[tuple[float, int, str]] = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            code, body = await self.node.get(self.path)
            self.seen.append((time.monotonic(), code, body))
            await asyncio.sleep(self.pause)

    async def started(self) -> None:
        """Return once the first answers are in."""
        await wait_for(lambda: len(self.seen) >= 2, what="the watch's first answers")

    async def stop(self) -> list[int]:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return [code for _, code, _ in self.seen]


@pytest.fixture(params=selected_releases())
def release(request: pytest.FixtureRequest) -> Release:
    """A release of the real-kubelet fixture: skipped where it is not built, failing under CI=true."""
    rel: Release = request.param
    require_fixture(rel)
    return rel


@pytest.fixture
def node_factory(dp_dir: str, short_tmp: str, release: Release) -> Any:
    """Nodes whose kubelet is the real device manager of `release` (tests/e2e/realnode.py)."""

    def make(**overrides: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        return real_node(dp_dir, short_tmp, release, **overrides)

    return make


@pytest.fixture
def make_node(dp_dir: str, short_tmp: str) -> NodeFactory:
    @contextlib.asynccontextmanager
    async def factory(plugin_kwargs: dict[str, Any] | None = None, **overrides: Any) -> AsyncIterator[Node]:
        pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
        settings = replace(
            FAST, device_plugin_dir=dp_dir, pod_resources_socket=pod_resources, port=free_port(), **overrides
        )
        async with (
            FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as kubelet,
            FakeDevicePlugin(dp_dir, register_timeout=5, **(plugin_kwargs or {})) as plugin,
        ):
            await wait_for(lambda: kubelet.healthy_devices(GPU), what="registration")
            async with sidecar_running(settings) as (sidecar, _), aiohttp.ClientSession() as http:
                yield Node(dp_dir, kubelet, plugin, sidecar, settings, http)

    return factory


@pytest.fixture
async def node(make_node: NodeFactory) -> AsyncIterator[Node]:
    async with make_node() as n:
        yield n


__all__ = ["FAST", "GPU", "Node", "NodeFactory", "PluginSpec", "Watch", "sidecar_running"]
