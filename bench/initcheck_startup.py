"""Wall time, CPU time and peak RSS of `hami-initcheck` on a healthy socket, next to a bare
`python -c pass`: with the kubelet (a process named kubelet) listening on it, as on a node under
hostPID, and with the socket served by a process of another name while that kubelet is visible
elsewhere (it is ignored).

Goal: wall <= 2.5x the bare interpreter, peak RSS <= 20 MiB. Medians from one run,
alternating the commands so that machine noise hits them alike.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RUNS = int(os.environ.get("RUNS", "40"))
HELPER = (
    "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1024); "
    "print('ready', flush=True); time.sleep(3600)"
)


def measure(argv: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (KiB) and CPU seconds (user and system) of one run of argv."""
    started = time.perf_counter()
    devnull = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=devnull)
    _, status, usage = os.wait4(pid, 0)
    elapsed = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 100):
        raise SystemExit(f"{argv} exited {code}")
    return elapsed, usage.ru_maxrss, usage.ru_utime + usage.ru_stime


def main() -> None:
    folder = tempfile.mkdtemp(prefix="hg-bench-")
    script = shutil.which("hami-initcheck", path=os.path.dirname(sys.executable)) or "hami-initcheck"
    # A process named kubelet listening on the socket, as hostPID shows it on a node: with it,
    # initcheck reads where the kubelet listens (its descriptors and its net/unix).
    kubelet = os.path.join(folder, "kubelet")
    os.symlink(os.path.realpath(sys.executable), kubelet)
    sock = os.path.join(folder, "kubelet.sock")
    helper = subprocess.Popen([kubelet, "-c", HELPER, sock], stdout=subprocess.PIPE)
    assert helper.stdout is not None and helper.stdout.readline() == b"ready\n"
    # A socket no process of a kubelet's name listens on (the kubelet above is visible, and ignored).
    plain = os.path.join(folder, "plain")
    os.mkdir(plain)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(plain, "kubelet.sock"))
    listener.listen(1024)
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "hami-initcheck": [script, "--device-plugin-dir", plain, "--kubelet-process-name", "no-kubelet"],
        "hami-initcheck+kubelet": [script, "--device-plugin-dir", folder],
    }
    samples: dict[str, list[tuple[float, int, float]]] = {k: [] for k in commands}
    try:
        for _ in range(RUNS):
            for name, argv in commands.items():
                samples[name].append(measure(argv))
    finally:
        helper.kill()
        helper.wait()
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
    wall = {k: statistics.median(s[0] for s in v) for k, v in samples.items()}
    rss = {k: max(s[1] for s in v) for k, v in samples.items()}
    # CPU time varies less than wall time on a machine others share: a second figure to compare by.
    cpu = {k: statistics.median(s[2] for s in v) for k, v in samples.items()}
    print(f"runs: {RUNS} each, alternating; machine: {os.cpu_count()} cores")
    for name in commands:
        print(
            f"{name:24s} median wall {wall[name] * 1000:7.1f} ms   CPU {cpu[name] * 1000:6.1f} ms   "
            f"peak RSS {rss[name] / 1024:5.1f} MiB"
        )
    for name in list(commands)[1:]:
        ratio = wall[name] / wall["python -c pass"]
        print(
            f"{name}: wall {ratio:.2f}x the bare interpreter (goal <= 2.5x), peak RSS "
            f"{rss[name] / 1024:.1f} MiB (goal <= 20 MiB)"
        )


if __name__ == "__main__":
    main()
