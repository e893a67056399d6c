"""What reading the Node costs the sidecar, by API client: the project's own reader (sidecar.kube.client
on the aiohttp the sidecar already runs) against lightkube, kr8s and kubernetes_asyncio (PyPI).

Each run is a process of its own that first imports what the sidecar always imports (grpc, aiohttp,
watchdog, psutil, prometheus_client, protobuf, its own device-plugin and DRA modules), then times the
client's import, its first and second GET of a Node from a real kube-apiserver (tests/apiserver.py: `make
node-bins`, etcd) and the CPU of 20 more, and reads its resident memory before and after. The other
clients are not dependencies of the project: install them in a venv of their own (`pip install -e .
lightkube kr8s kubernetes_asyncio`) and run this with it (`BENCH_PYTHON=/that/venv/bin/python`); a
client not installed there is skipped. RUNS runs each (5).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tests import apiserver

RUNS = int(os.environ.get("RUNS", "5"))
PYTHON = os.environ.get("BENCH_PYTHON", sys.executable)
NODE = "bench-node"

BASE = """
import asyncio, json, sys, time, resource
import grpc, aiohttp, watchdog.observers, psutil, prometheus_client, google.protobuf
import sidecar.config, sidecar.deviceplugin.watch, sidecar.dra.watch, sidecar.server.metrics
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
url, token, ca, kubeconfig, node = sys.argv[1:6]
before = rss()
t0 = time.perf_counter()
"""

CLIENTS = {
    "own reader (sidecar.kube.client)": """
from sidecar.hami.watch import read_node
from sidecar.kube.access import ApiAccess
from sidecar.kube.client import Reader
t1 = time.perf_counter()
access = ApiAccess(url, token, ca)
reader = None
async def get():
    global reader
    reader = reader or Reader(access)  # as the sidecar's watch keeps one
    r = await read_node(access, node, ['hami.io/node-nvidia-register'], 5.0, reader)
    assert r.node is not None, r.why
""",
    "lightkube": """
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Node
t1 = time.perf_counter()
client = None
async def get():
    global client
    if client is None:
        client = AsyncClient(config=KubeConfig.from_file(kubeconfig))
    await client.get(Node, name=node)
""",
    "kr8s": """
import kr8s.asyncio
from kr8s.asyncio.objects import Node
t1 = time.perf_counter()
api = None
async def get():
    global api
    if api is None:
        api = await kr8s.asyncio.api(kubeconfig=kubeconfig)
    await Node.get(node, api=api)
""",
    "kubernetes_asyncio": """
from kubernetes_asyncio import client, config
t1 = time.perf_counter()
v1 = None
async def get():
    global v1
    if v1 is None:
        await config.load_kube_config(config_file=kubeconfig)
        v1 = client.CoreV1Api(client.ApiClient())
    await v1.read_node(node)
""",
}

TAIL = """
async def main():
    a = time.perf_counter(); await get(); b = time.perf_counter(); await get(); c = time.perf_counter()
    cpu = time.process_time()
    for _ in range(20):
        await get()
    return b - a, c - b, (time.process_time() - cpu) / 20
first, second, cpu = asyncio.run(main())
print(json.dumps({"import": t1 - t0, "first": first, "second": second, "cpu": cpu, "before": before,
                  "after": rss(), "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def installed(module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([PYTHON, "-c", code], check=False).returncode == 0


async def main() -> None:
    reason = apiserver.missing()
    if reason is not None:
        raise SystemExit(f"no API server: {reason}")
    with tempfile.TemporaryDirectory(prefix="hg-bench-") as root:
        api = apiserver.ApiServer(root)
        try:
            await api.start()
            await api.request("POST", "/api/v1/nodes", {"metadata": {"name": NODE}})
            # As HAMi's chart grants its device plugin's ServiceAccount (kr8s gets by listing).
            await api.grant("hami-sidecar", "hami-sidecar", ["nodes"], ["get", "list"])
            args = [
                api.url,
                api.token_file("hami-sidecar"),
                api.ca_file,
                api.kubeconfig("hami-sidecar"),
                NODE,
            ]
            print(f"{RUNS} runs each, {PYTHON}; medians (RSS: resident MiB after the sidecar's own imports)")
            print("| client | import | first GET | second GET | CPU per GET | RSS added | RSS total |")
            print("|---|---|---|---|---|---|---|")
            for name, body in CLIENTS.items():
                module = name.split()[0] if not name.startswith("own") else "sidecar"
                if not installed(module):
                    print(f"| {name} | not installed | | | | | |")
                    continue
                runs = []
                for _ in range(RUNS):
                    out = await asyncio.to_thread(
                        subprocess.run,
                        [PYTHON, "-c", BASE + body + TAIL, *args],
                        capture_output=True,
                        text=True,
                        check=False,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    )
                    if out.returncode:
                        last = (out.stderr.strip().splitlines() or ["?"])[-1]
                        print(f"| {name} | failed: {last[:160]} | | | | | |")
                        break
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                if len(runs) < RUNS:
                    continue

                def med(key: str, rs: list[dict[str, float]] = runs) -> float:
                    return statistics.median(r[key] for r in rs)

                added = statistics.median(r["after"] - r["before"] for r in runs)
                print(
                    f"| {name} | {med('import') * 1000:.0f} ms | {med('first') * 1000:.0f} ms | "
                    f"{med('second') * 1000:.1f} ms | {med('cpu') * 1000:.1f} ms | {added:.1f} MiB | "
                    f"{med('after'):.1f} MiB |"
                )
        finally:
            api.stop()


if __name__ == "__main__":
    asyncio.run(main())
