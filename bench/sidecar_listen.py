"""Seconds from starting `hami-sidecar` to its port accepting a connection: what the native sidecar's
startupProbe (a TCP connect, every 1 s, up to 60 s) waits for before the kubelet starts the plugin.

Prints each start, the median and the maximum from one run (RUNS starts, 10 by default).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RUNS = int(os.environ.get("RUNS", "10"))
LIMIT = 60.0  # the startupProbe's periodSeconds x failureThreshold


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_start() -> float:
    folder = tempfile.mkdtemp(prefix="hg-listen-")
    port = free_port()
    argv = [sys.executable, "-m", "sidecar", "--device-plugin-dir", folder, "--listen", f"127.0.0.1:{port}"]
    argv += ["--pod-resources-socket", os.path.join(folder, "pr.sock")]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < LIMIT:
            if proc.poll() is not None:
                raise SystemExit(f"hami-sidecar exited {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return time.perf_counter() - started
            except OSError:
                time.sleep(0.01)
        raise SystemExit(f"not listening after {LIMIT:g} s")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    took = [one_start() for _ in range(RUNS)]
    print("hami-sidecar start to listening, s: " + ", ".join(f"{t:.2f}" for t in took))
    median = statistics.median(took)
    print(
        f"median {median:.2f} s, max {max(took):.2f} s ({RUNS} starts; the startupProbe allows {LIMIT:g} s)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
