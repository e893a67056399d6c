"""The real sidecar served in this loop, for the end-to-end tests and the real-kubelet node."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from sidecar.app import Sidecar
from sidecar.cli import serve
from sidecar.config import Settings
from tests.conftest import wait_for


@contextlib.asynccontextmanager
async def sidecar_running(settings: Settings) -> AsyncIterator[tuple[Sidecar, asyncio.Task[Sidecar]]]:
    stop = asyncio.Event()
    sidecar = Sidecar(settings)
    task = asyncio.get_running_loop().create_task(serve(settings, stop, sidecar))
    try:
        await wait_for(lambda: sidecar.ready or task.done(), what="the first probe round")
        yield sidecar, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
