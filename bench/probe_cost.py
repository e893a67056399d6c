"""CPU per 1,000 probes: an httpGet on the sidecar's /healthz versus an exec probe that starts a
process per check (hami-initcheck stands in). Goal: the sidecar's own CPU per probe at least 50x
lower than one process start."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys

from bench.common import node

REQUESTS = int(os.environ.get("REQUESTS", "5000"))
EXECS = int(os.environ.get("EXECS", "100"))


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def main() -> None:
    async with node() as n:
        p = n.process
        before = p.cpu_times()
        for _ in range(REQUESTS):
            assert await n.status() == 200
        after = p.cpu_times()
        sidecar = ((after.user + after.system) - (before.user + before.system)) / REQUESTS * 1000
        exe = shutil.which("hami-initcheck", path=os.path.dirname(sys.executable)) or "hami-initcheck"
        start = children_cpu()
        for _ in range(EXECS):
            proc = await asyncio.create_subprocess_exec(
                exe, "--device-plugin-dir", n.dir, stdout=subprocess.DEVNULL
            )
            await proc.wait()
        execs = (children_cpu() - start) / EXECS * 1000
    print(
        f"CPU seconds per 1,000 probes: sidecar /healthz {sidecar:.3f} s ({REQUESTS} requests measured), "
        f"exec probe (hami-initcheck) {execs:.2f} s ({EXECS} runs measured)"
    )
    print(f"ratio: one process start costs {execs / sidecar:.0f}x the sidecar's CPU per probe (goal >= 50x)")


if __name__ == "__main__":
    asyncio.run(main())
