"""CPU per 1,000 probes: the kubelet's probe of the sidecar's /healthz (a new connection each, closed
after the answer: answered at the front), the same request kept alive (aiohttp's handler, as every
request was before the front answered probes), and an exec probe that starts a process per check
(hami-initcheck stands in). Goal: the sidecar's own CPU per probe at least 50x lower than one process
start."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys

import psutil

from bench.common import node

REQUESTS = int(os.environ.get("REQUESTS", "5000"))
EXECS = int(os.environ.get("EXECS", "100"))
# The kubelet's httpGet (Go's client with keep-alives off), and the same request kept alive.
KEPT = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUser-Agent: kube-probe/1.37\r\nAccept: */*\r\n\r\n"
KUBELET = KEPT.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def one(port: int, request: bytes) -> bytes:
    """A new connection, one request, the answer read; the client closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        return head
    finally:
        writer.close()
        await writer.wait_closed()


async def per_probe(p: psutil.Process, port: int, request: bytes) -> float:
    """The sidecar's CPU ms per request, over REQUESTS new connections."""
    before = cpu(p)
    for _ in range(REQUESTS):
        assert (await one(port, request)).startswith(b"HTTP/1.1 200 ")
    return (cpu(p) - before) / REQUESTS * 1000


async def main() -> None:
    async with node() as n:
        port = int(n.url.rsplit(":", 1)[1])
        front = await per_probe(n.process, port, KUBELET % port)
        kept = await per_probe(n.process, port, KEPT % port)
        exe = shutil.which("hami-initcheck", path=os.path.dirname(sys.executable)) or "hami-initcheck"
        start = children_cpu()
        for _ in range(EXECS):
            proc = await asyncio.create_subprocess_exec(
                exe, "--device-plugin-dir", n.dir, stdout=subprocess.DEVNULL
            )
            await proc.wait()
        execs = (children_cpu() - start) / EXECS * 1000
    print(
        f"CPU seconds per 1,000 probes ({REQUESTS} requests each, a new connection each): sidecar /healthz "
        f"as the kubelet probes (closed after the answer, answered at the front) {front:.3f} s, kept alive "
        f"(aiohttp's handler) {kept:.3f} s; exec probe (hami-initcheck) {execs:.2f} s ({EXECS} runs)"
    )
    print(f"ratio: one process start costs {execs / front:.0f}x the sidecar's CPU per probe (goal >= 50x)")


if __name__ == "__main__":
    asyncio.run(main())
