"""/healthz while the kubelet's network namespace holds 100,000 Unix sockets, by either route.

Each round the sidecar reads the kernel's table of Unix sockets of the kubelet's namespace
(docs/design.md#socket-table): sock_diag where it shares that namespace (hostNetwork), else the
kubelet's /proc/<pid>/net/unix (hostPID). This script makes a network namespace of its own for the
node, fills it with SOCKETS sockets (socket pairs held by a few processes), runs the simulated kubelet
there under a kubelet's name, the plugin and the real sidecar (its own process, a round every 2 s)
either in that namespace (sock_diag) or in a pod's namespace of its own (/proc, as the manifests run
it: uid 0, every capability dropped), and asks /healthz RATE times a second for SECONDS seconds from
the sidecar's namespace. It prints p50/p99/max of /healthz and the sidecar's RSS (now and peak).

Needs root (unshare --net, nsenter, setpriv). Bounded: at most 400,000 sockets, every step within a
timeout; the namespaces, processes and folders it made are gone when it returns, whatever happened.
`SIDECAR_SRC=/path/to/checkout` runs another checkout's sidecar (a before/after comparison).

    .venv/bin/python -m bench.socket_table   # SOCKETS=100000 SECONDS=30 RATE=100 ROUTES=sock_diag,proc
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from bench.common import percentile
from testing import free_port
from testing.netns import Netns, PluginProcess

SOCKETS = min(int(os.environ.get("SOCKETS", "100000")), 400_000)
SECONDS = float(os.environ.get("SECONDS", "30"))
RATE = float(os.environ.get("RATE", "100"))
ROUTES = os.environ.get("ROUTES", "sock_diag,proc").split(",")
# Socket pairs a filler holds: two descriptors each, within the hard limit of open files.
PER_FILLER = min(25_000, (resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 64) // 2)
KUBELET_NAME = "kubelet-bench"
ROOT_NO_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
# The sidecar and the client run with this priority: on a machine shared with other work, a process of
# ordinary weight waits its turn for tens of ms (p99 45 ms here for 100 sockets at a load of 10; 30 ms
# niced to -15 at a load of 18), which no change of the sidecar's can show through. The default is the
# real-time FIFO class (`chrt -f 10`: the sidecar's threads and the client before any ordinary process,
# for the minute a run takes); PRIORITY="nice -n -15" or PRIORITY="" measure otherwise.
PRIORITY = os.environ.get("PRIORITY", "chrt -f 10").split()

FILLER = r"""
import resource, socket, sys
pairs = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (2 * pairs + 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = [socket.socketpair() for _ in range(pairs)]
print("ready", flush=True)
sys.stdin.read()
"""

KUBELET = r"""
import asyncio, sys
with open("/proc/self/comm", "w") as f:
    f.write(sys.argv[3])
from testing import FakeKubelet
async def main():
    async with FakeKubelet(sys.argv[1], sys.argv[2], dial_timeout=1.0):
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""

# Asks /healthz at a steady rate over one kept-alive connection; prints the latencies (s) as JSON, each
# from the moment the request was due: a request held behind a stalled one counts its wait too (a
# client that sends when the last answer came would record one slow answer a stall, whatever its length).
CLIENT = r"""
import http.client, json, sys, time
port, seconds, rate = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
out, codes = [], {}
start = time.perf_counter()
for i in range(int(seconds * rate)):
    due = start + i / rate
    time.sleep(max(0.0, due - time.perf_counter()))
    conn.request("GET", "/healthz")
    r = conn.getresponse(); r.read()
    out.append(time.perf_counter() - due)
    codes[r.status] = codes.get(r.status, 0) + 1
print(json.dumps({"latencies": out, "codes": codes}))
"""

# /status, whatever its code (503 while a check fails), asked again while the serving limits say busy.
STATUS = r"""
import sys, time, urllib.error, urllib.request
for _ in range(50):
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/status", timeout=10).read()
    except urllib.error.HTTPError as e:
        body = e.read()
    if body.startswith(b"{"):
        break
    time.sleep(0.1)
print(body.decode())
"""
LOOPBACK_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "f = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH22x', b'lo', 0))[:18])[1]; "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', f | 1))"
)


class Held:
    """A process that says "ready" and holds what it made until its stdin closes."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != "ready\n":
            self.stop()
            raise RuntimeError(f"{argv[:4]} did not start")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def in_ns(ns: Netns, argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net={ns.path}", "--", *argv]


def sockets_in(ns: Netns) -> int:
    with open(f"/proc/{ns.pid}/net/unix", "rb") as f:
        return sum(1 for _ in f) - 1


def memory(pid: int) -> tuple[float, float]:
    """VmRSS and VmHWM (peak) of `pid`, MiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


@contextlib.contextmanager
def filled(ns: Netns, sockets: int) -> Iterator[None]:
    """`sockets` more sockets in `ns` (socket pairs), held until the block ends."""
    fillers: list[Held] = []
    try:
        left = sockets // 2
        while left > 0:
            pairs = min(left, PER_FILLER)
            fillers.append(Held(in_ns(ns, [sys.executable, "-c", FILLER, str(pairs)])))
            left -= pairs
        yield
    finally:
        for f in fillers:
            f.stop()


def run(route: str, root: str) -> dict[str, object]:
    folder = os.path.join(root, route, "device-plugins")
    os.makedirs(folder)
    pod_resources = os.path.join(root, route, "pod-resources", "kubelet.sock")
    port = free_port()
    src = os.environ.get("SIDECAR_SRC", "")
    # `python -m` puts its working folder first on sys.path: another checkout's runs from that checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.getcwd()) if p)}
    cwd = src or None
    with contextlib.ExitStack() as stack:
        node = stack.enter_context(Netns())
        pod = node if route == "sock_diag" else stack.enter_context(Netns())
        subprocess.run(in_ns(pod, [sys.executable, "-c", LOOPBACK_UP]), check=True, timeout=30)
        stack.enter_context(filled(node, SOCKETS))
        kubelet = Held(in_ns(node, [sys.executable, "-c", KUBELET, folder, pod_resources, KUBELET_NAME]), env)
        stack.callback(kubelet.stop)
        plugin = PluginProcess.start(pod, folder)
        stack.callback(plugin.stop)
        argv = [sys.executable, "-m", "sidecar", "--device-plugin-dir", folder]
        argv += ["--pod-resources-socket", pod_resources, "--listen", f"127.0.0.1:{port}"]
        argv += ["--probe-interval", "2", "--probe-timeout", "1.5", "--kubelet-process-name", KUBELET_NAME]
        log = open(os.path.join(root, f"{route}.log"), "wb")  # noqa: SIM115
        stack.callback(log.close)
        sidecar = subprocess.Popen(
            in_ns(pod, [*PRIORITY, *ROOT_NO_CAPS, *argv]), stderr=log, env=env, cwd=cwd
        )

        def end() -> None:
            sidecar.terminate()
            try:
                sidecar.wait(20)
            except subprocess.TimeoutExpired:
                sidecar.kill()
                sidecar.wait()

        stack.callback(end)
        # Ready once /healthz answers 200 (the plugin registered, the first rounds ran).
        wait = [sys.executable, "-c", CLIENT, str(port), "0.2", "10"]
        deadline = time.monotonic() + 60
        while True:
            done = subprocess.run(in_ns(pod, wait), capture_output=True, text=True, timeout=60)
            if done.returncode == 0 and json.loads(done.stdout)["codes"] == {"200": 2}:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"/healthz never answered 200 ({route}): {done.stdout[-300:]} {done.stderr[-300:]}"
                )
            time.sleep(0.5)
        in_table = sockets_in(node)
        ask = [*PRIORITY, sys.executable, "-c", CLIENT, str(port), str(SECONDS), str(RATE)]
        done = subprocess.run(in_ns(pod, ask), capture_output=True, text=True, timeout=SECONDS * 3 + 60)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        rss, peak = memory(sidecar.pid)
        with open(f"/proc/{sidecar.pid}/stat") as f:
            cpu = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) / os.sysconf("SC_CLK_TCK")
        time.sleep(1)  # /status is rate limited: not right after the load
        ask = [sys.executable, "-c", STATUS, str(port)]
        status = subprocess.run(in_ns(pod, ask), capture_output=True, text=True, timeout=60)
        try:
            doc = json.loads(status.stdout)
        except ValueError:
            doc = {"error": (status.stdout + status.stderr)[-300:]}
    if "checks" not in doc or doc.get("config_error"):
        raise RuntimeError(f"the sidecar did not judge ({route}): {json.dumps(doc)[:500]}")
    lat: list[float] = result["latencies"]
    return {
        "route": route,
        "sockets": in_table,
        "from": doc.get("kubelet_connections_from", doc.get("error", "?")),
        "rounds": doc.get("probe_rounds", "?"),
        "read_s": doc.get("socket_table_read_seconds", "?"),
        "codes": result["codes"],
        "p50_ms": round(statistics.median(lat) * 1000, 2),
        "p99_ms": round(percentile(lat, 99) * 1000, 2),
        "max_ms": round(max(lat) * 1000, 2),
        "over_20ms": sum(1 for x in lat if x > 0.020),
        "cpu_s": round(cpu, 2),
        "rss_mib": round(rss, 1),
        "peak_rss_mib": round(peak, 1),
    }


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("needs root: unshare --net, nsenter, setpriv")
    root = tempfile.mkdtemp(prefix="hg-table-")
    os.chmod(root, 0o755)
    try:
        for route in ROUTES:
            r = run(route, root)
            print(
                f"{r['route']:9} sockets in the kubelet's namespace {r['sockets']:>7,}  "
                f"/healthz {r['codes']} p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms max {r['max_ms']} ms "
                f"({r['over_20ms']} over 20 ms)  CPU {r['cpu_s']} s  "
                f"RSS {r['rss_mib']} MiB (peak {r['peak_rss_mib']} MiB)  rounds {r['rounds']} "
                f"(last table read {r['read_s']} s)  "
                f"from {r['from']}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
