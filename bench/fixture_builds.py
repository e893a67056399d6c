"""What the Go fixtures cost to build from an empty build cache, step by step in one shared cache.

Runs each step (a make target, with optional VAR=value words) in order, all against one throwaway
`GOCACHE` that starts empty, so a later step reuses what an earlier one compiled, as one CI run does;
the module cache (`GOMODCACHE`) is the machine's, warm (its downloads take seconds a release,
docs/kubelet-releases.md). Prints per step the wall time and the CPU (user + system of every process
the step ran), then the totals and what the cache holds.

    python bench/fixture_builds.py                        # the order .ci/run builds in (FIXTURE_STEPS)
    python bench/fixture_builds.py 'tests/realkubelet/bin/realkubelet-v1.34.4' ...
    NICE=15 python bench/fixture_builds.py                # under nice, on a shared machine
    KEEP_CACHE=1 ...; CACHE=/tmp/hg-gocache-... python bench/fixture_builds.py STEP...   # go on from it

Each step also writes its fixture's binary, as `make` would: run it in a working tree of its own.
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_steps() -> list[str]:
    """The Makefile's CI_FIXTURE_STEPS: every fixture .ci/run builds, in its order."""
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "print-fixture-steps"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    steps = sys.argv[1:] or default_steps()
    nice = int(os.environ.get("NICE", "0"))
    # CACHE: go on from a cache an earlier run kept (KEEP_CACHE=1), to add steps in the same order.
    cache = Path(os.environ.get("CACHE") or tempfile.mkdtemp(prefix="hg-gocache-"))
    env = dict(os.environ, GOCACHE=str(cache), GOFLAGS=os.environ.get("GOFLAGS", ""))
    rows: list[tuple[str, float, float, int]] = []
    state = "kept from an earlier run" if os.environ.get("CACHE") else "empty"
    print(f"GOCACHE {cache} ({state}); GOMODCACHE warm; {os.cpu_count()} cores; nice {nice}")
    try:
        for step in steps:
            argv = ["make", "-s", "--no-print-directory", *shlex.split(step)]
            if nice:
                argv = ["nice", "-n", str(nice), *argv]
            cpu0, wall0 = cpu_of_children(), time.monotonic()
            done = subprocess.run(argv, cwd=REPO, env=env, check=False)
            wall, cpu = time.monotonic() - wall0, cpu_of_children() - cpu0
            if done.returncode != 0:
                raise SystemExit(f"{step}: make exited {done.returncode}")
            rows.append((step, wall, cpu, size_of(cache)))
            load = os.getloadavg()[0]
            size = rows[-1][3] / 2**30
            print(f"{step}: wall {wall:.0f} s, CPU {cpu:.0f} s, cache {size:.2f} GiB, load {load:.1f}")
    finally:
        print()
        print("| step | wall | CPU (user + system) | cache after |")
        print("|---|---|---|---|")
        for step, wall, cpu, size in rows:
            print(f"| `{step}` | {wall:.0f} s | {cpu:.0f} s | {size / 2**30:.2f} GiB |")
        print(f"| all {len(rows)} | {sum(r[1] for r in rows):.0f} s | {sum(r[2] for r in rows):.0f} s | |")
        if os.environ.get("KEEP_CACHE") != "1":
            shutil.rmtree(cache, ignore_errors=True)
        else:
            print(f"kept {cache}")


if __name__ == "__main__":
    main()
