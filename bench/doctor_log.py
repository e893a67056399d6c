"""How long `hami-doctor` takes to read its logs.

1. The whole process with a small and a 200 MiB kubelet log (goal: under 1 s, independent of the log's
   size: logs are read from the end, at most 10 MiB).
2. The log scan alone (`scan_file`: the read from the end and the scan) on 10 MiB logs whose lines are
   long, each against the same bytes in short lines (goal: within 2x; the scan is linear in the bytes
   whatever the line lengths): a kubelet log that is one 10 MiB line, and a plugin's CRI log whose lines
   the container runtime split in 16 KiB partial (`P`) lines.
3. The whole process with the 10 MiB single-line log as both logs (goal: under 2 s).

Medians of RUNS runs each.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from doctor.logscan import scan_file
from doctor.patterns import KUBELET_PATTERNS, PLUGIN_PATTERNS
from doctor.types import Pattern

RUNS = int(os.environ.get("RUNS", "5"))
SIZE = 10 << 20
SINCE = 3650 * 86400.0
LINE = (
    b'I1202 10:00:00.000000    1234 manager.go:1] "Got registration request from device plugin '
    b'with resource" resourceName="nvidia.com/gpu"\n'
)
# A plugin's line as HAMi prints it, each one a match (the slowest short lines to scan).
PLUGIN_LINE = (
    b"E1202 10:00:00.000000       1 server.go:325] Could not register device plugin: "
    b"context deadline exceeded"
)
PART = 16 * 1024  # containerd's default max_container_log_line_size


def write_log(path: str, size: int) -> None:
    block = LINE * (1024 * 1024 // len(LINE))
    with open(path, "wb") as f:
        while f.tell() < size:
            f.write(block)


def cri_prefix(flag: bytes) -> bytes:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()).encode()
    return stamp + b".123456789Z stderr " + flag + b" "


def kubelet_logs(folder: str) -> tuple[str, str]:
    """10 MiB of klog lines, and the same bytes as one line (each newline a space but the last)."""
    short = LINE * (SIZE // len(LINE))
    single = short[:-1].replace(b"\n", b" ") + b"\n"
    return write(folder, "kubelet-short.log", short), write(folder, "kubelet-single-line.log", single)


def plugin_logs(folder: str) -> tuple[str, str, str]:
    """The plugin's CRI log: 10 MiB of its klog lines as short F lines; the same content as 16 KiB F lines;
    and as one long line the runtime split in 16 KiB P lines (the last one F)."""
    full, partial = cri_prefix(b"F"), cri_prefix(b"P")
    lines = SIZE // len(full + PLUGIN_LINE + b"\n")  # short lines: 10 MiB
    content = b" ".join([PLUGIN_LINE] * lines)
    parts = [content[i : i + PART] for i in range(0, len(content), PART)]
    short = (full + PLUGIN_LINE + b"\n") * lines
    long_f = b"".join(full + part + b"\n" for part in parts)
    long_p = b"".join((partial if i < len(parts) - 1 else full) + p + b"\n" for i, p in enumerate(parts))
    return (
        write(folder, "plugin-short.log", short),
        write(folder, "plugin-16k-F.log", long_f),
        write(folder, "plugin-16k-P.log", long_p),
    )


def write(folder: str, name: str, data: bytes) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def cpu() -> float:
    """CPU seconds of this process and its waited-for children: what other load on the machine does not
    inflate."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def median(run: Callable[[], object]) -> tuple[float, float]:
    """The median wall time and the median CPU time of RUNS runs."""
    wall, used = [], []
    for _ in range(RUNS):
        started, cpu_before = time.perf_counter(), cpu()
        run()
        wall.append(time.perf_counter() - started)
        used.append(cpu() - cpu_before)
    return statistics.median(wall), statistics.median(used)


def time_scan(path: str, patterns: tuple[Pattern, ...]) -> tuple[float, float]:
    return median(lambda: scan_file(path, patterns, SINCE))


def time_doctor(folder: str, kubelet_log: str, plugin_log: str | None = None) -> tuple[float, float]:
    argv = [
        sys.executable,
        "-m",
        "doctor",
        "--device-plugin-dir",
        folder,
        "--kubelet-log",
        kubelet_log,
        "--plugin-log",
        plugin_log or kubelet_log,
        "--sample-interval",
        "0",
        "--since",
        "3650d",
        "--output",
        "json",
    ]
    return median(lambda: subprocess.run(argv, stdout=subprocess.DEVNULL, check=False))


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="hg-bench-")
    try:
        results = {}
        for label, size in (("1 MiB", 1 << 20), ("200 MiB", 200 << 20)):
            log = os.path.join(tmp, f"kubelet-{size}.log")
            write_log(log, size)
            results[label] = time_doctor(tmp, log)
        print(f"hami-doctor report, median of {RUNS} runs (the whole process: start, checks, two logs read)")
        for label, (seconds, used) in results.items():
            print(
                f"  kubelet and plugin log of {label:>7}: {seconds * 1000:6.0f} ms wall, "
                f"{used * 1000:6.0f} ms CPU"
            )
        ratio = results["200 MiB"][0] / results["1 MiB"][0]
        print(f"ratio 200 MiB / 1 MiB: {ratio:.2f} (goal: under 1 s, independent of the size)")

        short, single = kubelet_logs(tmp)
        f_short, f_long, p_long = plugin_logs(tmp)
        rows = [
            ("kubelet log, 10 MiB of short klog lines", short, KUBELET_PATTERNS, None),
            ("kubelet log, the same bytes as one 10 MiB line", single, KUBELET_PATTERNS, short),
            ("plugin CRI log, 10 MiB of short F lines", f_short, PLUGIN_PATTERNS, None),
            ("plugin CRI log, the same content as 16 KiB F lines", f_long, PLUGIN_PATTERNS, f_short),
            ("plugin CRI log, the same content as 16 KiB P lines", p_long, PLUGIN_PATTERNS, f_short),
        ]
        print(f"\nthe log scan alone (scan_file: read from the end, scan), median of {RUNS} runs")
        print(f"  {'log':<52} {'file':>9} {'wall':>8} {'CPU':>8}  CPU vs the short lines")
        scanned: dict[str, tuple[float, float]] = {}
        for label, path, patterns, against in rows:
            wall, used = scanned[path] = time_scan(path, patterns)
            ratio_text = f"{used / scanned[against][1]:5.2f}x" if against else ""
            mib = os.path.getsize(path) / (1 << 20)
            print(f"  {label:<52} {mib:5.1f} MiB {wall * 1000:5.0f} ms {used * 1000:5.0f} ms  {ratio_text}")
        print("goal: long lines within 2x of the same bytes in short lines")

        wall, used = time_doctor(tmp, single, p_long)
        print(
            "\nhami-doctor report with the 10 MiB single-line kubelet log and the 16 KiB P-line plugin log, "
            f"median of {RUNS} runs: {wall * 1000:.0f} ms wall, {used * 1000:.0f} ms CPU (goal: under 2 s)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
