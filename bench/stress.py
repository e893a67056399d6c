"""`make stress`: the floods of the serving-limits issue against the real sidecar, on loopback only.

Each phase starts a fresh `hami-sidecar` process (a simulated kubelet and plugin in this process),
floods its port from a second process, samples `/healthz` from a third (a new connection per
request, as the kubelet's prober does, with its 2 s timeout), and watches the sidecar's RSS, fds and
CPU. The flood runs FLOOD_SECONDS, stops, and after SETTLE_SECONDS the RSS is read again; then the
flood starts again and the sidecar gets SIGTERM under it: the time to exit and the exit code.

| phase | flood |
|---|---|
| fd-limit | the sidecar under `ulimit -n 256`; 1,000 idle TCP connections |
| keep-alive | 12,000 connections attempted, each sends one keep-alive GET /healthz, reads it, idles |
| slowloris | 500 connections sending a request head a byte every 100 ms, reopened when closed |
| pipelined | 2,000 connections each pipelining 200 GET /metrics, never reading an answer |

Bounded: about a minute in all (STRESS_SECONDS, STRESS_PHASES=slowloris,pipelined to shorten).
Goals (the issue's): no abort; /healthz p99 <= 50 ms in every phase; peak RSS below the manifests'
limit (128 MiB); exit 0 within 2 s of SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import psutil

from bench.common import percentile, sidecar_argv
from testing import FakeDevicePlugin, FakeKubelet, free_port

FLOOD_SECONDS = float(os.environ.get("STRESS_SECONDS", "8"))
# STRESS_CPU_LIMIT=0.2 runs the sidecar under a CFS quota of 0.2 CPU, as `limits: {cpu: 200m}` does in
# a container (needs a writable cgroup v1 cpu controller or cgroup v2 with cpu delegated; else skipped).
CPU_LIMIT = float(os.environ.get("STRESS_CPU_LIMIT", "0") or 0)
CFS_PERIOD_US = 100_000
SETTLE_SECONDS = 3.0
SIGTERM_AFTER = 1.5  # seconds of the second flood before SIGTERM
SAMPLE_RATE = 25.0  # /healthz per second (the kubelet probes every 5 s; more samples, a real p99)
PROBE_TIMEOUT = 2.0  # the livenessProbe's timeoutSeconds
MEMORY_LIMIT_MIB = 128  # manifests/hami-patch/patch.yaml: the hami-sidecar container's limit
GOAL_P99_MS = 50.0
GOAL_EXIT_S = 2.0


ALL_GOALS = ("no abort", "p99", "no failed probe", "peak RSS", "exit")


@dataclass(frozen=True)
class Phase:
    name: str
    flood: str
    connections: int
    nofile: int | None = None  # RLIMIT_NOFILE of the sidecar
    what: str = ""
    goals: tuple[str, ...] = ALL_GOALS


PHASES = (
    Phase("fd-limit", "idle", 1000, nofile=256, what="1,000 idle connections, sidecar under ulimit -n 256"),
    # A connection-rate flood of valid requests as much as a memory one: its goals are the issue's
    # (memory, exit); its /healthz figures are printed, bounded by CPU rather than by these limits.
    Phase(
        "keep-alive",
        "keepalive",
        12000,
        what="12,000 keep-alive connections attempted, held idle",
        goals=("no abort", "peak RSS", "exit"),
    ),
    Phase("slowloris", "slowloris", 500, what="500 slow-header connections, reopened when closed"),
    Phase("pipelined", "pipelined", 2000, what="2,000 connections x 200 pipelined GET /metrics, unread"),
)

HEAD = b"GET /healthz HTTP/1.1\r\nHost: stress\r\nUser-Agent: kube-probe/1.33\r\nAccept: */*\r\n\r\n"
METRICS = b"GET /metrics HTTP/1.1\r\nHost: stress\r\n\r\n"


# -- the flood (its own process) ---------------------------------------------------------------
@dataclass
class _Conn:
    sock: socket.socket
    state: str = "connecting"  # connecting | sent | held
    sent: int = 0  # bytes of the slow head sent
    next_at: float = 0.0


@dataclass
class FloodCounts:
    attempted: int = 0
    connected: int = 0
    closed_by_server: int = 0
    refused: int = 0
    answered: int = 0
    peak_open: int = 0


def flood(kind: str, port: int, connections: int, seconds: float) -> FloodCounts:
    """Open `connections` to 127.0.0.1:port and behave as `kind` for `seconds`; plain selectors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, connections + 256)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    connections = min(connections, want - 64)
    counts = FloodCounts()
    sel = selectors.DefaultSelector()
    conns: dict[int, _Conn] = {}
    in_flight = 0
    max_in_flight = 512
    reopen = kind == "slowloris"
    deadline = time.monotonic() + seconds
    slow_head = HEAD + b"X-Pad: " + b"a" * 4000  # never finished: a byte per tick
    pipeline = METRICS * 200

    def open_one() -> None:
        nonlocal in_flight
        s = socket.socket()
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        counts.attempted += 1
        err = s.connect_ex(("127.0.0.1", port))
        if err not in (0, errno.EINPROGRESS):
            counts.refused += 1
            s.close()
            return
        conns[s.fileno()] = _Conn(s)
        sel.register(s, selectors.EVENT_WRITE)
        in_flight += 1

    def drop(c: _Conn, by_server: bool) -> None:
        nonlocal in_flight
        if c.state == "connecting":
            in_flight -= 1
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(c.sock)
        conns.pop(c.sock.fileno(), None)
        c.sock.close()
        if by_server:
            counts.closed_by_server += 1

    while time.monotonic() < deadline:
        target = connections if reopen else connections - counts.attempted + len(conns)
        while (
            len(conns) < target and in_flight < max_in_flight and (reopen or counts.attempted < connections)
        ):
            open_one()
        counts.peak_open = max(counts.peak_open, len(conns))
        now = time.monotonic()
        for key, events in sel.select(timeout=0.02):
            c = conns.get(key.fd)
            if c is None:
                continue
            if c.state == "connecting":
                err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                in_flight -= 1
                if err:
                    c.state = "failed"
                    counts.refused += 1
                    with contextlib.suppress(KeyError, ValueError):
                        sel.unregister(c.sock)
                    conns.pop(key.fd, None)
                    c.sock.close()
                    continue
                counts.connected += 1
                c.state = "sent"
                with contextlib.suppress(OSError):
                    if kind == "keepalive":
                        c.sock.send(HEAD)
                    elif kind == "pipelined":
                        c.sock.send(pipeline)
                    elif kind == "slowloris":
                        c.sock.send(slow_head[:1])
                        c.sent, c.next_at = 1, now + 0.1
                # Watch for the server's close (and, for keep-alive, its answer); pipelined never reads
                # but still learns of a reset from a failing send below.
                sel.modify(c.sock, selectors.EVENT_READ)
                continue
            if events & selectors.EVENT_READ:
                if kind == "pipelined":
                    # Never read an answer: peek only, to learn whether the server closed.
                    try:
                        data = c.sock.recv(1, socket.MSG_PEEK)
                    except OSError:
                        data = b""
                    if data:
                        sel.unregister(c.sock)  # answers wait unread; stop watching
                        c.state = "held"
                        continue
                    drop(c, by_server=True)
                    continue
                try:
                    data = c.sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    drop(c, by_server=True)
                    continue
                if kind == "keepalive" and data.startswith(b"HTTP/1.1 200"):
                    counts.answered += 1
        if kind == "slowloris":
            for c in list(conns.values()):
                if c.state == "sent" and now >= c.next_at and c.sent < len(slow_head):
                    try:
                        c.sock.send(slow_head[c.sent : c.sent + 1])
                    except OSError:
                        drop(c, by_server=True)
                        continue
                    c.sent += 1
                    c.next_at = now + 0.1
    for c in list(conns.values()):
        c.sock.close()
    return counts


# -- the prober (its own process) ---------------------------------------------------------------
def probe_once(port: int) -> tuple[float, int]:
    """One kubelet-style probe: a new connection, GET /healthz, read to the end; (seconds, status)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as s:
            s.settimeout(max(0.001, PROBE_TIMEOUT - (time.perf_counter() - t0)))
            s.sendall(HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            data = b""
            while chunk := s.recv(4096):
                data += chunk
                if b"\r\n\r\nok" in data:
                    break
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    except OSError:
        status = 0
    return time.perf_counter() - t0, status


def sample(port: int, seconds: float, rate: float) -> list[tuple[float, int]]:
    results = []
    start = time.perf_counter()
    for i in range(int(seconds * rate)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        results.append(probe_once(port))
    return results


# -- the sidecar and its watcher (this process) --------------------------------------------------
class CpuLimit:
    """A cgroup with a CFS quota for the sidecar's process, as the kubelet sets for a CPU limit."""

    def __init__(self, cpus: float) -> None:
        self.cpus = cpus
        self.path: str | None = None
        self.why = ""

    def __enter__(self) -> CpuLimit:
        name = f"hami-guard-stress-{os.getpid()}"
        v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
        try:
            if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
                self.path = os.path.join(v1, name)
                os.mkdir(self.path)
                _write(os.path.join(self.path, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(int(self.cpus * CFS_PERIOD_US)))
            else:
                self.path = os.path.join(v2, name)
                os.mkdir(self.path)
                _write(
                    os.path.join(self.path, "cpu.max"), f"{int(self.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}"
                )
        except OSError as e:
            self.why = f"no CPU limit: cannot make a cgroup ({e.strerror})"
            self.__exit__()
        return self

    def add(self, pid: int) -> None:
        if self.path:
            _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def __exit__(self, *exc: object) -> None:
        if self.path:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # empty once the sidecar has exited
            self.path = None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class Watch:
    proc: psutil.Process
    rss: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def tick(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.rss.append(self.proc.memory_info().rss / 2**20)
            self.fds.append(self.proc.num_fds())

    def cpu(self) -> float:
        try:
            t = self.proc.cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)


async def watch_while(w: Watch, aw: asyncio.Future[object] | asyncio.Task[object]) -> None:
    while not aw.done():
        w.tick()
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def sidecar(
    nofile: int | None, cpu: CpuLimit | None = None
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, str]]:
    root = tempfile.mkdtemp(prefix="hg-stress-")
    folder = os.path.join(root, "device-plugins")
    pod_resources = os.path.join(root, "pod-resources", "kubelet.sock")
    port = free_port()
    log = os.path.join(root, "sidecar.log")
    argv = sidecar_argv(folder, pod_resources, port, "--log-format", "json", cpu=0)
    if nofile is not None:
        # The shell's ulimit, not preexec_fn: forking this process (gRPC's threads in it) to run
        # Python before exec is what gRPC warns against, and it crashes now and then.
        argv = ["sh", "-c", f'ulimit -n {nofile} && exec "$0" "$@"', *argv]

    try:
        async with (
            FakeKubelet(folder, pod_resources, dial_timeout=1.0),
            FakeDevicePlugin(folder, register_timeout=5, retry_interval=3600),
        ):
            with open(log, "wb") as stderr:
                proc = await asyncio.create_subprocess_exec(*argv, stderr=stderr)
                try:
                    if cpu is not None:
                        cpu.add(proc.pid)
                    for _ in range(400):  # until /healthz answers 200 (or the sidecar exits)
                        if (await asyncio.to_thread(probe_once, port))[
                            1
                        ] == 200 or proc.returncode is not None:
                            break
                        await asyncio.sleep(0.025)
                    if proc.returncode is not None:
                        with open(log, errors="replace") as f:
                            raise RuntimeError(f"the sidecar exited {proc.returncode}:\n{f.read()[-2000:]}")
                    yield proc, port, log
                finally:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def run_in(argv: list[str]) -> str:
    """Another process of this module (flood or prober), pinned away from the sidecar's core."""
    if shutil.which("taskset"):
        argv = ["taskset", "-c", "1", *argv]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()


def _me(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.stress", *args]


@dataclass
class Result:
    phase: Phase
    latencies: list[float]
    failures: int
    rss_before: float
    rss_peak: float
    rss_after: float
    fds_peak: int
    cpu_share: float
    counts: dict[str, int]
    exit_seconds: float
    exit_code: int | None
    aborted: bool
    log_tail: str


async def run_phase(phase: Phase, cpu: CpuLimit | None) -> Result:
    async with sidecar(phase.nofile, cpu) as (proc, port, log):
        w = Watch(psutil.Process(proc.pid))
        await asyncio.sleep(0.5)
        w.tick()
        rss_before = w.rss[-1]
        w.rss.clear()
        cpu0, t0 = w.cpu(), time.monotonic()
        flood_args = ["--flood", phase.flood, "--port", str(port), "--connections", str(phase.connections)]
        flood_task = asyncio.ensure_future(run_in(_me(*flood_args, "--seconds", str(FLOOD_SECONDS))))
        await asyncio.sleep(0.3)  # the flood under way
        probe_args = ["--sample", "--port", str(port), "--seconds", str(FLOOD_SECONDS - 0.8)]
        sampler = asyncio.ensure_future(run_in(_me(*probe_args)))
        watcher = asyncio.ensure_future(watch_while(w, flood_task))
        samples = json.loads(await sampler)
        counts = json.loads(await flood_task)
        await watcher
        cpu_share = (w.cpu() - cpu0) / (time.monotonic() - t0)
        rss_peak, fds_peak = max(w.rss, default=0.0), max(w.fds, default=0)
        await asyncio.sleep(SETTLE_SECONDS)
        w.tick()
        rss_after = w.rss[-1] if proc.returncode is None else 0.0
        # SIGTERM under the same flood.
        again = asyncio.ensure_future(
            run_in(_me(*flood_args, "--seconds", str(SIGTERM_AFTER + GOAL_EXIT_S + 1)))
        )
        await asyncio.sleep(SIGTERM_AFTER)
        exit_code: int | None = proc.returncode
        exit_seconds = float("nan")
        aborted = exit_code is not None
        if exit_code is None:
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                exit_code = None
            exit_seconds = time.monotonic() - sent
        await again
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-5:])
    latencies = [t for t, _ in samples]
    failures = sum(1 for _, status in samples if status != 200)
    return Result(
        phase,
        latencies,
        failures,
        rss_before,
        rss_peak,
        rss_after,
        fds_peak,
        cpu_share,
        counts,
        exit_seconds,
        exit_code,
        aborted,
        tail,
    )


def report(r: Result) -> list[str]:
    p = r.phase
    lat = r.latencies or [float("nan")]
    return [
        f"{p.name}: {p.what}",
        f"  /healthz ({len(r.latencies)} probes, a new connection each): "
        f"p50 {percentile(lat, 50) * 1000:.1f} ms, "
        f"p99 {percentile(lat, 99) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms, failed {r.failures}",
        f"  sidecar: RSS {r.rss_before:.1f} -> peak {r.rss_peak:.1f} -> {r.rss_after:.1f} MiB "
        f"({SETTLE_SECONDS:g} s after); fds peak {r.fds_peak}"
        + (f" of {p.nofile}" if p.nofile else "")
        + f"; CPU {r.cpu_share * 100:.0f} % of a core during the flood",
        "  flood: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.counts.items()),
        f"  SIGTERM under the flood: exit {r.exit_code} after {r.exit_seconds:.2f} s"
        + ("  ** the sidecar died during the flood **" if r.aborted else ""),
    ]


def verdicts(results: list[Result]) -> list[str]:
    out = []
    for r in results:
        p99 = percentile(r.latencies, 99) * 1000 if r.latencies else float("inf")
        checks: list[tuple[str, Callable[[], bool]]] = [
            ("no abort", lambda r=r: not r.aborted),  # type: ignore[misc]
            (f"p99 <= {GOAL_P99_MS:g} ms", lambda p99=p99: p99 <= GOAL_P99_MS),  # type: ignore[misc]
            ("no failed probe", lambda r=r: r.failures == 0),  # type: ignore[misc]
            (f"peak RSS < {MEMORY_LIMIT_MIB} MiB", lambda r=r: r.rss_peak < MEMORY_LIMIT_MIB),  # type: ignore[misc]
            (
                f"exit 0 within {GOAL_EXIT_S:g} s",
                lambda r=r: r.exit_code == 0 and r.exit_seconds <= GOAL_EXIT_S,  # type: ignore[misc]
            ),
        ]
        missed = [name for name, ok in checks if not ok() and name.startswith(r.phase.goals)]
        judged = ", ".join(g for g in ALL_GOALS if g in r.phase.goals)
        verdict = "met" if not missed else "MISSED: " + ", ".join(missed)
        out.append(f"  {r.phase.name:11s} ({judged}): {verdict}")
    return out


async def main() -> int:
    wanted = os.environ.get("STRESS_PHASES")
    phases = [p for p in PHASES if not wanted or p.name in wanted.split(",")]
    print(
        f"{os.cpu_count()} cores; sidecar pinned to core 0, flood and prober to core 1; "
        f"{FLOOD_SECONDS:g} s of flood per phase, /healthz {SAMPLE_RATE:g}/s; "
        f"load average {os.getloadavg()[0]:.2f} before"
    )
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(CpuLimit(CPU_LIMIT)) if CPU_LIMIT else None
        if cpu is not None:
            print(cpu.why or f"sidecar under a CPU limit of {CPU_LIMIT:g} CPU (CFS quota, {cpu.path})")
        return await run_phases(phases, cpu if cpu and cpu.path else None)


async def run_phases(phases: list[Phase], cpu: CpuLimit | None) -> int:
    results = []
    for phase in phases:
        r = await run_phase(phase, cpu)
        results.append(r)
        print("\n".join(report(r)), flush=True)
        if r.aborted:
            print(r.log_tail)
    print(f"load average {os.getloadavg()[0]:.2f} after (other work on the machine shows in the figures)")
    print("goals: no abort, /healthz p99 <= 50 ms, no failed probe, peak RSS below the limit, exit 0 <= 2 s")
    lines = verdicts(results)
    print("\n".join(lines))
    return 0 if all(line.endswith(": met") for line in lines) else 1


def cli() -> int:
    p = argparse.ArgumentParser(prog="bench.stress")
    p.add_argument("--flood", choices=("idle", "keepalive", "slowloris", "pipelined"))
    p.add_argument("--sample", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--connections", type=int, default=0)
    p.add_argument("--seconds", type=float, default=FLOOD_SECONDS)
    args = p.parse_args()
    if args.flood:
        print(json.dumps(vars(flood(args.flood, args.port, args.connections, args.seconds))))
        return 0
    if args.sample:
        print(json.dumps(sample(args.port, args.seconds, SAMPLE_RATE)))
        return 0
    return asyncio.run(main())


if __name__ == "__main__":
    raise SystemExit(cli())
