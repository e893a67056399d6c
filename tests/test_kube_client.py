"""The project's API reader (sidecar.kube.client) against a server that answers in chunks, as the API
server does: the body is read whole, however it arrives, and never past its bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from sidecar.kube.access import ApiAccess
from sidecar.kube.client import Reader
from testing import free_port

# A Node of about 6 KB (a real one, with its images and conditions, is larger).
NODE = {
    "kind": "Node",
    "metadata": {"name": "gpu-1", "annotations": {f"example.org/key-{i}": "v" * 40 for i in range(100)}},
}
BODY = json.dumps(NODE).encode()


@contextlib.asynccontextmanager
async def chunked_server(body: bytes, piece: int = 1000) -> AsyncIterator[ApiAccess]:
    async def node(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "application/json"})
        r.enable_chunked_encoding()
        await r.prepare(request)
        for at in range(0, len(body), piece):
            await r.write(body[at : at + piece])
            await asyncio.sleep(0.005)  # each chunk its own segment: the reader sees the first alone
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_get("/api/v1/nodes/{name}", node)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield ApiAccess(f"http://127.0.0.1:{port}", token="test")
    finally:
        await runner.cleanup()


async def test_a_chunked_answer_is_read_whole() -> None:
    assert len(BODY) > 5000
    async with chunked_server(BODY) as access:
        reader = Reader(access)
        try:
            for _ in range(10):
                answer = await reader.get("/api/v1/nodes/gpu-1", 5, 4 << 20)
                assert answer.status == 200 and answer.body == BODY, answer.why
        finally:
            await reader.close()


async def test_an_answer_over_the_bound_is_not_read() -> None:
    async with chunked_server(BODY) as access:
        reader = Reader(access)
        try:
            answer = await reader.get("/api/v1/nodes/gpu-1", 5, len(BODY) - 1)
            assert not answer.body and "exceeds" in answer.why, answer
            answer = await reader.get("/api/v1/nodes/gpu-1", 5, len(BODY))
            assert answer.body == BODY
        finally:
            await reader.close()
