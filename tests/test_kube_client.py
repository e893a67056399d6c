"""The project's API reader (sidecar.kube.client) against a server that answers in chunks, as the API
server does: the body is read whole, however it arrives, and never past its bound; compressed, it is
inflated off the event loop and never past its bound either; holding more JSON values than its bound,
it is not parsed."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import zlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sidecar.hami.watch import read_node
from sidecar.kube import client
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
async def chunked_server(
    body: bytes, piece: int = 1000, encoding: str = "", asked: list[str] | None = None
) -> AsyncIterator[ApiAccess]:
    """Serves `body` as the Node, in chunks of `piece` bytes, sent as it is with `encoding` as its
    Content-Encoding; the Accept-Encoding of each request goes to `asked`."""

    async def node(request: web.Request) -> web.StreamResponse:
        if asked is not None:
            asked.append(request.headers.get("Accept-Encoding", ""))
        headers = {"Content-Type": "application/json"}
        if encoding:
            headers["Content-Encoding"] = encoding
        r = web.StreamResponse(headers=headers)
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


def deflated(data: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    ("encoding", "sent"),
    [
        ("gzip", gzip.compress(BODY)),
        ("deflate", deflated(BODY, zlib.MAX_WBITS)),  # zlib's format
        ("deflate", deflated(BODY, -zlib.MAX_WBITS)),  # raw deflate, as some servers send it
        ("", BODY),
    ],
)
async def test_a_compressed_answer_is_inflated_and_only_what_is_inflated_is_asked_for(
    encoding: str, sent: bytes
) -> None:
    asked: list[str] = []
    async with chunked_server(sent, encoding=encoding, asked=asked) as access:
        reader = Reader(access)
        try:
            answer = await reader.get("/api/v1/nodes/gpu-1", 5, 4 << 20)
            assert answer.ok and answer.body == BODY, answer.why
        finally:
            await reader.close()
    assert asked == ["gzip, deflate"]


async def test_an_answer_that_inflates_past_the_bound_is_not_read() -> None:
    """A small gzip body that inflates past the bound: stopped at the bound, never held whole."""
    bomb = gzip.compress(b" " * (64 << 20))  # 64 KiB sent, 64 MiB inflated
    async with chunked_server(bomb, piece=16384, encoding="gzip") as access:
        answer = await client.get(access, "/api/v1/nodes/gpu-1", 5, 4 << 20)
    assert (answer.status, answer.body) == (200, b"")
    assert "inflates past 4194304 bytes" in answer.why


@pytest.mark.parametrize(
    ("encoding", "sent", "why"),
    [
        ("br", b"x" * 100, "encoding 'br' was not asked for"),
        ("gzip", gzip.compress(BODY)[:-100], "cut short"),
        ("gzip", b"not gzip at all", "does not inflate"),
    ],
)
async def test_an_answer_that_cannot_be_inflated_is_not_read(encoding: str, sent: bytes, why: str) -> None:
    async with chunked_server(sent, encoding=encoding) as access:
        answer = await client.get(access, "/api/v1/nodes/gpu-1", 5, 4 << 20)
    assert (answer.status, answer.body) == (200, b"") and why in answer.why, answer


async def test_an_answer_with_more_values_than_the_bound_is_not_parsed() -> None:
    """4 MiB of tiny values (a Node with 150,000 allocatable entries parses as slowly): refused on a
    count of its commas and colons, before any parse."""
    many = json.dumps({"kind": "Node", "status": {"allocatable": {f"r{i}": "1" for i in range(150_000)}}})
    async with chunked_server(gzip.compress(many.encode()), piece=65536, encoding="gzip") as access:
        answer = await client.get(access, "/api/v1/nodes/gpu-1", 5, 4 << 20)
        assert answer.body == b"" and "over 65536 JSON values (300003)" in answer.why, answer.why
        reading = await read_node(access, "gpu-1", ["k"], 5)
        assert reading.node is None and "not parsed" in reading.why
        answer = await client.get(access, "/api/v1/nodes/gpu-1", 5, 4 << 20, max_values=300_003)
        assert answer.ok and json.loads(answer.body)["kind"] == "Node"


async def test_the_node_is_inflated_and_parsed_off_the_event_loop() -> None:
    """The answer's inflating and the Node's parse run on the reader's worker thread, one at a time."""
    name = await client.off_loop(lambda: threading.current_thread().name)
    assert name.startswith("hami-kube-decode") and threading.current_thread().name != name
    node = {**NODE, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
    async with chunked_server(gzip.compress(json.dumps(node).encode()), encoding="gzip") as access:
        reading = await read_node(access, "gpu-1", ["example.org/key-7"], 5)
    assert reading.node is not None, reading.why
    assert reading.node.allocatable == {"nvidia.com/gpu": 8}
    assert reading.node.annotations == {"example.org/key-7": "v" * 40}
