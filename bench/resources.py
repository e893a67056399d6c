"""Idle CPU over 60 s with the default probe interval, and resident memory at steady state.

Goals: idle CPU <= 0.1 % of a core (a sidecar that wakes itself on its own reads of the folder spins
at a full core, so this catches feedback loops); RSS <= 55 MiB (the imports alone cost about 47 MiB).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from bench.common import node

SECONDS = float(os.environ.get("IDLE_SECONDS", "60"))


def imports_rss() -> float:
    code = (
        "import grpc, aiohttp, watchdog.observers, psutil, prometheus_client, google.protobuf, resource;"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    return (
        int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        / 1024
    )


async def main() -> None:
    async with node() as n:  # default interval 10 s, timeout 2 s
        await asyncio.sleep(5)  # warm-up: the first rounds, the first scrapes
        await n.status("/metrics")
        p = n.process
        before = p.cpu_times()
        await asyncio.sleep(SECONDS)
        after = p.cpu_times()
        cpu = (after.user + after.system) - (before.user + before.system)
        rss = p.memory_info().rss / 2**20
        fds, threads = p.num_fds(), p.num_threads()
    print(
        f"idle over {SECONDS:g} s (interval 10 s): {cpu:.3f} CPU s = {cpu / SECONDS * 100:.3f} % of a core "
        "(goal <= 0.1 %)"
    )
    print(f"steady-state RSS: {rss:.1f} MiB (goal <= 55 MiB); fds {fds}, threads {threads}")
    print(f"importing the dependencies alone: {imports_rss():.1f} MiB peak RSS")


if __name__ == "__main__":
    asyncio.run(main())
