"""/healthz and the sidecar's memory while the API server's answers to its GET of the Node cost to parse.

The real sidecar (its own process, the simulated kubelet and plugin in this one) reads its Node from an
API server that is a loopback HTTPS server of this script's (its own process, a self-signed certificate
made with openssl): once a second (`--hami-interval 1 --probe-interval 1`). For 3 s the server answers an
ordinary Node (the RSS at rest), then for SECONDS (20) one of the answers below, while /healthz is asked
every 10 ms on a new connection, as the kubelet asks (bench/stress.py's prober). Printed per answer:
/healthz p50, p99 and max, the RSS at rest, its peak and at the end, the GETs served, and what the
sidecar made of the answer (its /status).

| answer | what the server sends |
|---|---|
| node | an ordinary Node (about 10 KB) |
| tiny-values | a Node with 4 MiB of tiny JSON values (an array of 0s) |
| allocatable | a Node with 150,000 `status.allocatable` entries |
| gzip | a gzip body (4 KiB) that inflates to 4 MiB of tiny values, the bound |
| deflate | the same, deflate |
| bound-allocatable | 32,500 `status.allocatable` entries: within the bound of 65,536 values, parsed |
| bound-strings | a Node of 4 MiB: 65,000 strings of escaped characters, within both bounds, parsed |

    .venv/bin/python -m bench.api_answers     # SECONDS=20 ANSWERS=tiny-values,gzip SIDECAR_SRC=<checkout>

SIDECAR_SRC runs another checkout's sidecar (before and after). SHARES=1 puts the sidecar in a cgroup of
the largest CPU weight and PROBER_PRIORITY="chrt -f 20" runs the prober in the real-time class: on a
machine shared with other work the figures are otherwise the machine's load (bench/stress.py says
more). Loopback only; every process it starts is gone when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator

import psutil

from bench.common import percentile, sidecar_argv
from bench.stress import CpuLimit, probe_once, run_in
from testing import FakeDevicePlugin, FakeKubelet, free_port

SECONDS = float(os.environ.get("SECONDS", "20"))
REST_SECONDS = 3.0
ANSWERS = os.environ.get(
    "ANSWERS", "node,tiny-values,allocatable,gzip,deflate,bound-allocatable,bound-strings"
).split(",")
SIDECAR_SRC = os.environ.get("SIDECAR_SRC", "")
SHARES = os.environ.get("SHARES", "") == "1"
PROBER_PRIORITY = os.environ.get("PROBER_PRIORITY", "").split()
NODE = "bench-node"
BOUND = 4 * 1024 * 1024  # sidecar.hami.annotation.MAX_NODE
GOAL_P99_MS = 20.0
GOAL_RSS_MIB = 80.0

# The API server: the Node at /api/v1/nodes/<name>, the answer chosen by POST /answer/<kind>, the GETs
# counted at /count. Its own process: what it costs is not the sidecar's.
SERVER = r"""
import gzip, json, ssl, sys, zlib
from aiohttp import web

port, cert, key, node, boot = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
gpus = enumerate(["GPU-0", "GPU-1"])
register = json.dumps([{"id": d, "index": i, "count": 10, "health": True} for i, d in gpus])
BOUND = 4 * 1024 * 1024
base = {
    "kind": "Node", "apiVersion": "v1",
    "metadata": {"name": node, "labels": {f"example.org/l{i}": "x" * 20 for i in range(40)},
                 "annotations": {"hami.io/node-nvidia-register": register}},
    "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"},
               "nodeInfo": {"bootID": boot, "kubeletVersion": "v1.33.0"},
               "images": [{"names": [f"registry.example.org/i{i}:v1"], "sizeBytes": 1 << 20}
                          for i in range(50)]},
}
plain = json.dumps(base).encode()
head = json.dumps({**base, "x": []}).encode()[:-3]  # ..."x": [
tiny = head + b"[" + b"0," * ((BOUND - len(head) - 8) // 2) + b"0]}"
assert len(tiny) <= BOUND
def with_allocatable(n):
    entries = {f"example.org/r{i}": "1" for i in range(n)}
    return json.dumps({**base, "status": {**base["status"], "allocatable": entries}}).encode()
alloc = with_allocatable(150_000)
# At the sidecar's bound (65,536 values): parsed, at the most a parse then costs.
seps = plain.count(b",") + plain.count(b":")
bound_alloc = with_allocatable((65_536 - seps - 8) // 2)
strings = (65_536 - seps - 8)
escaped = '"' + "\\u00e9" * ((BOUND - len(head) - 16) // strings // 6 - 1) + '"'
bound_strings = head + ("[" + ",".join([escaped] * strings) + "]}").encode()
assert len(bound_strings) <= BOUND, len(bound_strings)
def deflate(data):
    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS)
    return c.compress(data) + c.flush()
answers = {
    "node": (plain, ""),
    "tiny-values": (tiny, ""),
    "allocatable": (alloc, ""),
    "gzip": (gzip.compress(tiny), "gzip"),
    "deflate": (deflate(tiny), "deflate"),
    "bound-allocatable": (bound_alloc, ""),
    "bound-strings": (bound_strings, ""),
}
state = {"answer": "node", "count": 0}

async def get_node(request):
    state["count"] += 1
    body, encoding = answers[state["answer"]]
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    return web.Response(body=body, headers=headers)

async def choose(request):
    state["answer"] = request.match_info["kind"]
    state["count"] = 0
    return web.Response(text=json.dumps({k: len(v[0]) for k, v in answers.items()}))

async def count(request):
    return web.Response(text=str(state["count"]))

app = web.Application()
app.router.add_get("/api/v1/nodes/{name}", get_node)
app.router.add_post("/answer/{kind}", choose)
app.router.add_get("/count", count)
ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
ctx.load_cert_chain(cert, key)
print("ready", flush=True)
web.run_app(app, host="127.0.0.1", port=port, ssl_context=ctx, print=None, handle_signals=True)
"""


def certificate(folder: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA), and its key."""
    cert, key = os.path.join(folder, "api.crt"), os.path.join(folder, "api.key")
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert),
            *("-days", "1", "-subj", "/CN=bench-api", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@contextlib.asynccontextmanager
async def api_server(folder: str) -> AsyncIterator[tuple[int, str, asyncio.subprocess.Process]]:
    cert, key = certificate(folder)
    port = free_port()
    with open("/proc/sys/kernel/random/boot_id") as f:  # this machine's: the Node is this one's
        boot = f.read().strip()
    argv = [sys.executable, "-c", SERVER, str(port), cert, key, NODE, boot]
    if shutil.which("taskset"):
        argv = ["taskset", "-c", "1", *argv]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if line != b"ready\n":
            raise RuntimeError(f"the API server did not start: {line!r}")
        yield port, cert, proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def control(port: int, cert: str, method: str, path: str) -> str:
    import ssl  # noqa: PLC0415

    import aiohttp  # noqa: PLC0415

    ctx = ssl.create_default_context(cafile=cert)
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"https://127.0.0.1:{port}{path}", ssl=ctx) as r,
    ):
        return await r.text()


@contextlib.asynccontextmanager
async def sidecar(
    root: str, api_port: int, cert: str, group: CpuLimit | None
) -> AsyncIterator[tuple[int, int]]:
    folder = os.path.join(root, "device-plugins")
    pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
    token = os.path.join(root, "token")
    with open(token, "w") as f:
        f.write("bench-token\n")
    port = free_port()
    args = ["--kube-api-server", f"https://127.0.0.1:{api_port}", "--kube-ca-file", cert]
    args += ["--kube-token-file", token, "--node-name", NODE, "--hami-interval", "1", "--probe-interval", "1"]
    args += ["--probe-timeout", "0.5"]
    argv = sidecar_argv(folder, pod_resources, port, "--log-format", "json", *args, cpu=0)
    path = os.pathsep.join(p for p in (SIDECAR_SRC, os.getcwd()) if p)
    env = {**os.environ, "PYTHONPATH": path}
    async with (
        FakeKubelet(folder, pod_resources, dial_timeout=1.0),
        FakeDevicePlugin(folder, register_timeout=5, retry_interval=3600),
    ):
        with open(os.path.join(root, "sidecar.log"), "wb") as log:
            proc = await asyncio.create_subprocess_exec(*argv, stderr=log, env=env, cwd=SIDECAR_SRC or None)
        try:
            if group is not None and group.path:
                group.add(proc.pid)
            for _ in range(400):
                if (await asyncio.to_thread(probe_once, port))[1] == 200 or proc.returncode is not None:
                    break
                await asyncio.sleep(0.025)
            if proc.returncode is not None:
                raise RuntimeError(f"the sidecar exited {proc.returncode}")
            yield proc.pid, port
        finally:
            if proc.returncode is None:
                proc.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 10)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def status_of(port: int) -> str:
    """What the sidecar's /status says of its last reading of the Node."""
    import aiohttp  # noqa: PLC0415

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/status") as r:
        doc = await r.json()
    reading = (doc.get("hami_registration") or {}).get("reading")
    return str(reading)[:120]


async def run(kind: str, group: CpuLimit | None) -> dict[str, object]:
    root = tempfile.mkdtemp(prefix="hg-api-")
    try:
        async with (
            api_server(root) as (api_port, cert, _),
            sidecar(root, api_port, cert, group) as (pid, port),
        ):
            proc = psutil.Process(pid)
            await asyncio.sleep(REST_SECONDS)
            rest = proc.memory_info().rss / 2**20
            await control(api_port, cert, "POST", f"/answer/{kind}")
            args = ["--sample", "--port", str(port), "--seconds", str(SECONDS), "--rate", "100", "--on-time"]
            sampler = asyncio.ensure_future(
                run_in([sys.executable, "-m", "bench.stress", *args], PROBER_PRIORITY)
            )
            rss: list[float] = []
            cpu0 = sum(proc.cpu_times()[:2])
            t0 = time.monotonic()
            while not sampler.done():
                with contextlib.suppress(psutil.Error):
                    rss.append(proc.memory_info().rss / 2**20)
                await asyncio.sleep(0.05)
            samples = json.loads(await sampler)
            cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
            gets = int(await control(api_port, cert, "GET", "/count"))
            await asyncio.sleep(1.1)  # /status is rate limited with the other paths: not right after
            reading = await status_of(port)
            end = proc.memory_info().rss / 2**20
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lat = [t for t, _, _ in samples]
    return {
        "answer": kind,
        "p50": percentile(lat, 50) * 1000,
        "p99": percentile(lat, 99) * 1000,
        "max": max(lat) * 1000,
        "failed": sum(1 for _, status, _ in samples if status != 200),
        "probes": len(lat),
        "rss_rest": rest,
        "rss_peak": max(rss, default=0.0),
        "rss_end": end,
        "gets": gets,
        "cpu": cpu,
        "reading": reading,
    }


async def main() -> int:
    print(
        f"{os.cpu_count()} cores; the sidecar on core 0, the API server and the prober on core 1; "
        f"one GET of the Node a second; /healthz every 10 ms for {SECONDS:g} s; sidecar from "
        f"{SIDECAR_SRC or 'here'}; load average {os.getloadavg()[0]:.2f}"
    )
    missed = []
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(CpuLimit(0, shares=True)) if SHARES else None
        if group is not None:
            print(group.why or f"the sidecar in {group.path}")
        for kind in ANSWERS:
            r = await run(kind, group)
            print(
                f"{kind:12s} /healthz p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms, "
                f"failed {r['failed']} of {r['probes']}; RSS {r['rss_rest']:.1f} at rest, peak "
                f"{r['rss_peak']:.1f}, {r['rss_end']:.1f} MiB at the end; {r['gets']} GETs; "
                f"CPU {float(str(r['cpu'])) * 100:.0f} %; reading: {r['reading']}",
                flush=True,
            )
            if (
                float(str(r["p99"])) >= GOAL_P99_MS
                or float(str(r["rss_peak"])) >= GOAL_RSS_MIB
                or r["failed"]
            ):
                missed.append(kind)
    print(f"load average {os.getloadavg()[0]:.2f} after")
    print(
        f"goals: /healthz p99 < {GOAL_P99_MS:g} ms, RSS < {GOAL_RSS_MIB:g} MiB, no failed probe: "
        + ("met" if not missed else "MISSED for " + ", ".join(missed))
    )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
