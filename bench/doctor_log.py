"""How long `hami-doctor` takes with a small and a 200 MiB kubelet log (goal: under 1 s,
independent of the log's size: logs are read from the end, at most 10 MiB)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RUNS = int(os.environ.get("RUNS", "5"))
LINE = (
    b'I1202 10:00:00.000000    1234 manager.go:1] "Got registration request from device plugin '
    b'with resource" resourceName="nvidia.com/gpu"\n'
)


def write_log(path: str, size: int) -> None:
    block = LINE * (1024 * 1024 // len(LINE))
    with open(path, "wb") as f:
        while f.tell() < size:
            f.write(block)


def time_doctor(folder: str, log: str) -> float:
    argv = [
        sys.executable,
        "-m",
        "doctor",
        "--device-plugin-dir",
        folder,
        "--kubelet-log",
        log,
        "--plugin-log",
        log,
        "--sample-interval",
        "0",
        "--since",
        "3650d",
        "--output",
        "json",
    ]
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="hg-bench-")
    try:
        results = {}
        for label, size in (("1 MiB", 1 << 20), ("200 MiB", 200 << 20)):
            log = os.path.join(tmp, f"kubelet-{size}.log")
            write_log(log, size)
            results[label] = statistics.median(time_doctor(tmp, log) for _ in range(RUNS))
        print(f"hami-doctor report, median of {RUNS} runs (the whole process: start, checks, two logs read)")
        for label, seconds in results.items():
            print(f"  kubelet and plugin log of {label:>7}: {seconds * 1000:6.0f} ms")
        ratio = results["200 MiB"] / results["1 MiB"]
        print(f"ratio 200 MiB / 1 MiB: {ratio:.2f} (goal: under 1 s, independent of the size)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
