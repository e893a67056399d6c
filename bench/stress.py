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

The probe phases (`STRESS_PHASES=probes`) ask /healthz every 10 ms instead, and judge its p99 against
20 ms, beside the quiet figure:

| phase | flood |
|---|---|
| quiet | none |
| busy-core | a process spinning on the sidecar's core |
| reconnect | 10,000 idle connections, each opened again as soon as it is closed |
| slowloris-2k | 2,000 slow-header connections, reopened when closed |
| half-open | 1,000 connections that send half a head and shut their side (FIN), reopened when closed |

Bounded: about a minute for each group (STRESS_SECONDS, STRESS_PHASES=slowloris,pipelined or a
group's name, `limits` or `probes`, to choose). Goals (the issues'): no abort; /healthz p99 <= 50 ms
in every limits phase and < 20 ms in every probe phase; peak RSS below the manifests' limit
(128 MiB); exit 0 within 2 s of SIGTERM. STRESS_PRIORITY="chrt -f 10" runs the sidecar and the
prober in the real-time class (on a machine shared with other work, the figures are otherwise the
machine's load); SIDECAR_SRC=/path/to/checkout runs another checkout's sidecar (before and after).
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
PROBE_RATE = 100.0  # the probe phases': every 10 ms
PROBE_TIMEOUT = 2.0  # the livenessProbe's timeoutSeconds
MEMORY_LIMIT_MIB = 128  # manifests/hami-patch/patch.yaml: the hami-sidecar container's limit
GOAL_P99_MS = 50.0
GOAL_PROBE_P99_MS = 20.0
GOAL_EXIT_S = 2.0
# On a machine shared with other work, a process of ordinary weight waits its turn for tens of ms, which
# no change of the sidecar's can show through: STRESS_PRIORITY="chrt -f 10" runs the sidecar in the
# real-time class, STRESS_PROBER_PRIORITY (default the same) the prober, STRESS_FLOOD_PRIORITY
# (e.g. "nice -n -19") the flood, which must get its core to flood as hard as on an idle machine.
PRIORITY = os.environ.get("STRESS_PRIORITY", "").split()
PROBER_PRIORITY = os.environ.get("STRESS_PROBER_PRIORITY", " ".join(PRIORITY)).split()
FLOOD_PRIORITY = os.environ.get("STRESS_FLOOD_PRIORITY", "").split()
# The prober's core: the flood's by default. On loopback each sender's packets are processed on its own
# core, so that a prober there waits behind the flood's packets in the kernel too.
PROBER_CORE = os.environ.get("STRESS_PROBER_CORE", "1")
# STRESS_HOG=1: a process spins on the sidecar's core (with the flood's priority) through every probe
# phase, so that the sidecar has about half a core and a flood can outrun it, as on a node's busy core.
HOG = os.environ.get("STRESS_HOG", "") == "1"
# STRESS_SHARES=1: the sidecar, the flood and the spinning process in a cgroup of the largest CPU weight.
SHARES = os.environ.get("STRESS_SHARES", "") == "1"
_groups: list[CpuLimit] = []  # the one of STRESS_SHARES, while it exists
SIDECAR_SRC = os.environ.get("SIDECAR_SRC", "")


ALL_GOALS = ("no abort", "p99", "no failed probe", "peak RSS", "exit")


@dataclass(frozen=True)
class Phase:
    name: str
    flood: str
    connections: int
    nofile: int | None = None  # RLIMIT_NOFILE of the sidecar
    what: str = ""
    goals: tuple[str, ...] = ALL_GOALS
    group: str = "limits"
    rate: float = SAMPLE_RATE  # /healthz per second

    @property
    def goal_p99_ms(self) -> float:
        return GOAL_PROBE_P99_MS if self.group == "probes" else GOAL_P99_MS


PHASES = (
    Phase(
        "fd-limit",
        "idle",
        1000,
        nofile=256,
        what="1,000 connections idle after one byte, sidecar under ulimit -n 256",
    ),
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
    Phase("quiet", "none", 0, what="no flood", group="probes", rate=PROBE_RATE),
    Phase(
        "busy-core",
        "hog",
        1,
        what="a process spinning on the sidecar's core",
        group="probes",
        rate=PROBE_RATE,
    ),
    Phase(
        "reconnect",
        "reconnect",
        10000,
        what="10,000 idle connections, each opened again as soon as it is closed",
        group="probes",
        rate=PROBE_RATE,
    ),
    Phase(
        "slowloris-2k",
        "slowloris",
        2000,
        what="2,000 slow-header connections, reopened when closed",
        group="probes",
        rate=PROBE_RATE,
    ),
    Phase(
        "half-open",
        "halfopen",
        1000,
        what="1,000 connections sending half a head, then FIN, reopened when closed",
        group="probes",
        rate=PROBE_RATE,
    ),
)

HEAD = b"GET /healthz HTTP/1.1\r\nHost: stress\r\nUser-Agent: kube-probe/1.33\r\nAccept: */*\r\n\r\n"
METRICS = b"GET /metrics HTTP/1.1\r\nHost: stress\r\n\r\n"
HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: stress\r\n"


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
    seconds: float = 0.0


def _raise_file_limit(connections: int) -> int:
    """Room for `connections` open sockets (and the process's own files); how many fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, connections + 256)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return min(connections, want - 64)


class _Flood:
    """`connections` to 127.0.0.1:port behaving as `kind` (keepalive, idle, pipelined, slowloris) for
    `seconds`, on plain selectors; slowloris reopens what the server closes."""

    MAX_IN_FLIGHT = 512  # connects under way at once

    def __init__(self, kind: str, port: int, connections: int) -> None:
        self.kind, self.port = kind, port
        self.connections = _raise_file_limit(connections)
        self.counts = FloodCounts()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.in_flight = 0
        self.reopen = kind == "slowloris"
        self.slow_head = HEAD + b"X-Pad: " + b"a" * 4000  # never finished: a byte per tick
        self.pipeline = METRICS * 200

    def run(self, seconds: float) -> FloodCounts:
        start = time.monotonic()
        deadline = start + seconds
        while time.monotonic() < deadline:
            self._fill()
            now = time.monotonic()
            for key, events in self.sel.select(timeout=0.02):
                c = self.conns.get(key.fd)
                if c is None:
                    continue
                if c.state == "connecting":
                    self._connected(key.fd, c, now)
                elif events & selectors.EVENT_READ:
                    self._readable(c)
            if self.kind == "slowloris":
                self._drip(now)
        for c in list(self.conns.values()):
            c.sock.close()
        self.counts.seconds = round(time.monotonic() - start, 3)
        return self.counts

    def _fill(self) -> None:
        """Open connections up to the target (slowloris: again for each the server closed)."""
        counts = self.counts
        target = self.connections if self.reopen else self.connections - counts.attempted + len(self.conns)
        while (
            len(self.conns) < target
            and self.in_flight < self.MAX_IN_FLIGHT
            and (self.reopen or counts.attempted < self.connections)
        ):
            self._open_one()
        counts.peak_open = max(counts.peak_open, len(self.conns))

    def _open_one(self) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.counts.attempted += 1
        err = s.connect_ex(("127.0.0.1", self.port))
        if err not in (0, errno.EINPROGRESS):
            self.counts.refused += 1
            s.close()
            return
        self.conns[s.fileno()] = _Conn(s)
        self.sel.register(s, selectors.EVENT_WRITE)
        self.in_flight += 1

    def _drop(self, c: _Conn, by_server: bool) -> None:
        if c.state == "connecting":
            self.in_flight -= 1
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(c.sock)
        self.conns.pop(c.sock.fileno(), None)
        c.sock.close()
        if by_server:
            self.counts.closed_by_server += 1

    def _connected(self, fd: int, c: _Conn, now: float) -> None:
        """A connect finished: count it, send what `kind` sends first, then watch for the server."""
        err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        self.in_flight -= 1
        if err:
            c.state = "failed"
            self.counts.refused += 1
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(c.sock)
            self.conns.pop(fd, None)
            c.sock.close()
            return
        self.counts.connected += 1
        c.state = "sent"
        with contextlib.suppress(OSError):
            if self.kind == "keepalive":
                c.sock.send(HEAD)
            elif self.kind == "idle":  # one byte: a silent connection would stay in the kernel
                c.sock.send(HEAD[:1])
            elif self.kind == "pipelined":
                c.sock.send(self.pipeline)
            elif self.kind == "slowloris":
                c.sock.send(self.slow_head[:1])
                c.sent, c.next_at = 1, now + 0.1
        # Watch for the server's close (and, for keep-alive, its answer); pipelined never reads but
        # still learns of a reset from a failing send.
        self.sel.modify(c.sock, selectors.EVENT_READ)

    def _readable(self, c: _Conn) -> None:
        if self.kind == "pipelined":
            # Never read an answer: peek only, to learn whether the server closed.
            try:
                data = c.sock.recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            if data:
                self.sel.unregister(c.sock)  # answers wait unread; stop watching
                c.state = "held"
                return
            self._drop(c, by_server=True)
            return
        try:
            data = c.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(c, by_server=True)
            return
        if self.kind == "keepalive" and data.startswith(b"HTTP/1.1 200"):
            self.counts.answered += 1

    def _drip(self, now: float) -> None:
        """Slowloris: one more byte of the never-finished head on each connection, every 0.1 s."""
        for c in list(self.conns.values()):
            if c.state == "sent" and now >= c.next_at and c.sent < len(self.slow_head):
                try:
                    c.sock.send(self.slow_head[c.sent : c.sent + 1])
                except OSError:
                    self._drop(c, by_server=True)
                    continue
                c.sent += 1
                c.next_at = now + 0.1


def flood(kind: str, port: int, connections: int, seconds: float) -> FloodCounts:
    """Open `connections` to 127.0.0.1:port and behave as `kind` for `seconds`; plain selectors."""
    return _Flood(kind, port, connections).run(seconds)


def run_flood(kind: str, port: int, connections: int, seconds: float) -> FloodCounts:
    if kind in ("none", "hog"):
        return idle_or_busy(kind, seconds)
    if kind in ("reconnect", "halfopen"):
        return churn(kind, port, connections, seconds)
    return flood(kind, port, connections, seconds)


def idle_or_busy(kind: str, seconds: float) -> FloodCounts:
    """No flood ("none"), or a busy core: the sidecar's (core 0), spun on at the flood's priority."""
    if kind == "hog":
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {0})
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    else:
        time.sleep(seconds)
    return FloodCounts()


def churn(kind: str, port: int, connections: int, seconds: float) -> FloodCounts:
    """`connections` held open, each opened again as soon as the server closes it: idle ("reconnect"),
    or after half a head and a FIN ("halfopen"). epoll itself, to reconnect as fast as a core allows."""
    import select  # noqa: PLC0415

    counts = FloodCounts()
    ep = select.epoll()
    socks: dict[int, socket.socket] = {}
    waiting: set[int] = set()  # connecting: the half head goes once writable
    addr = ("127.0.0.1", port)
    start = time.monotonic()
    deadline = start + seconds

    def open_one() -> None:
        s = socket.socket()
        s.setblocking(False)
        counts.attempted += 1
        err = s.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS):
            counts.refused += 1
            s.close()
            return
        fd = s.fileno()
        socks[fd] = s
        if kind == "halfopen":
            waiting.add(fd)
            ep.register(fd, select.EPOLLOUT | select.EPOLLIN)
        else:
            ep.register(fd, select.EPOLLIN | select.EPOLLRDHUP)

    while time.monotonic() < deadline:
        while len(socks) < connections:
            open_one()
            if counts.attempted % 256 == 0:
                break  # events between bursts: the server's closes come back too
        counts.peak_open = max(counts.peak_open, len(socks))
        for fd, ev in ep.poll(0.01, 1024):
            s = socks.get(fd)
            if s is None:
                continue
            if fd in waiting and ev & select.EPOLLOUT and not ev & (select.EPOLLERR | select.EPOLLHUP):
                waiting.discard(fd)
                counts.connected += 1
                with contextlib.suppress(OSError):
                    s.send(HALF_HEAD)
                    s.shutdown(socket.SHUT_WR)
                ep.modify(fd, select.EPOLLIN)
                continue
            if ev & (select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLERR | select.EPOLLHUP):
                ep.unregister(fd)
                del socks[fd]
                waiting.discard(fd)
                s.close()
                counts.closed_by_server += 1
    for s in socks.values():
        s.close()
    ep.close()
    counts.seconds = round(time.monotonic() - start, 3)
    counts.connected = counts.connected if kind == "halfopen" else counts.attempted - counts.refused
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


def sample(port: int, seconds: float, rate: float) -> list[tuple[float, int, float]]:
    """(seconds, status, when: seconds since the first) of a probe every 1/rate s, one after the other:
    a probe that is due while another is still waiting goes when that one ends."""
    results = []
    start = time.perf_counter()
    for i in range(int(seconds * rate)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        results.append((*probe_once(port), round(due - start, 3)))
    return results


async def sample_on_time(port: int, seconds: float, rate: float) -> list[tuple[float, int, float]]:
    """(seconds, status, when) of a probe every 1/rate s, each on a connection of its own opened when
    it is due, whatever the others wait for: a stall of 100 ms shows in the ten probes due in it, as
    in ten kubelets' (a client that waits for each answer before it asks again counts one slow probe,
    and falls behind for good once each takes longer than 1/rate)."""
    loop = asyncio.get_running_loop()
    request = HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")

    async def one(due: float) -> tuple[float, int]:
        started = loop.time()  # the prober's own lateness (its timer's ms granularity) is not counted
        try:
            async with asyncio.timeout_at(due + PROBE_TIMEOUT):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    writer.write(request)
                    data = await reader.read(4096)
                    while b"\r\n\r\n" not in data and (more := await reader.read(4096)):
                        data += more
                finally:
                    writer.close()
            status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
        except (OSError, TimeoutError, ValueError, IndexError):
            status = 0
        return loop.time() - started, status

    start = loop.time()
    tasks = []
    for i in range(int(seconds * rate)):
        due = start + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        tasks.append((asyncio.ensure_future(one(due)), round(due - start, 3)))
    return [(*(await task), when) for task, when in tasks]


# -- the sidecar and its watcher (this process) --------------------------------------------------
class CpuLimit:
    """A cgroup with a CFS quota for the sidecar's process, as the kubelet sets for a CPU limit; or
    (`shares`) with the largest CPU weight, so that the machine's other work (other sessions, each its
    own autogroup, where nice does not reach) takes little from the processes in it."""

    def __init__(self, cpus: float, shares: bool = False, name: str = "") -> None:
        self.cpus = cpus
        self.shares = shares
        self.name = name or f"hami-guard-stress-{os.getpid()}"
        self.path: str | None = None
        self.why = ""

    def __enter__(self) -> CpuLimit:
        v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
        try:
            if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
                self.path = os.path.join(v1, self.name)
                os.mkdir(self.path)
                if self.shares:
                    _write(os.path.join(self.path, "cpu.shares"), "262144")
                else:
                    _write(os.path.join(self.path, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
                    quota = str(int(self.cpus * CFS_PERIOD_US))
                    _write(os.path.join(self.path, "cpu.cfs_quota_us"), quota)
            else:
                self.path = os.path.join(v2, self.name)
                os.mkdir(self.path)
                if self.shares:
                    _write(os.path.join(self.path, "cpu.weight"), "10000")
                else:
                    quota = f"{int(self.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}"
                    _write(os.path.join(self.path, "cpu.max"), quota)
        except OSError as e:
            self.why = f"no CPU {'weight' if self.shares else 'limit'}: cannot make a cgroup ({e.strerror})"
            self.__exit__()
        return self

    def add(self, pid: int) -> None:
        if self.path:
            _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def __exit__(self, *exc: object) -> None:
        if self.path:
            for _ in range(50):  # empty once its processes have exited
                try:
                    os.rmdir(self.path)
                    break
                except OSError:
                    time.sleep(0.1)
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
        return sum(self.split())

    def split(self) -> tuple[float, float]:
        """CPU seconds in user space and in the kernel."""
        try:
            t = self.proc.cpu_times()
        except psutil.Error:
            return 0.0, 0.0
        return float(t.user), float(t.system)


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
    argv = [*PRIORITY, *sidecar_argv(folder, pod_resources, port, "--log-format", "json", cpu=0)]
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
                # `python -m` puts its working folder first on sys.path: another checkout's runs from it.
                env = {
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(p for p in (SIDECAR_SRC, os.getcwd()) if p),
                }
                proc = await asyncio.create_subprocess_exec(
                    *argv, stderr=stderr, env=env, cwd=SIDECAR_SRC or None
                )
                try:
                    for group in [cpu] if cpu is not None else _groups:
                        group.add(proc.pid)
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


async def run_in(argv: list[str], priority: list[str] | None = None, core: str = "1") -> str:
    """Another process of this module (flood or prober), pinned away from the sidecar's core."""
    if shutil.which("taskset"):
        argv = ["taskset", "-c", core, *argv]
    argv = [*(priority or []), *argv]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    for group in _groups:
        with contextlib.suppress(OSError):  # not a real-time process (the prober): it stays out
            group.add(proc.pid)
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
    kernel_share: float
    counts: dict[str, int]
    exit_seconds: float
    exit_code: int | None
    aborted: bool
    log_tail: str
    slowest: list[tuple[float, float]] = field(default_factory=list)  # (ms, s into the sampling)


async def run_phase(phase: Phase, cpu: CpuLimit | None) -> Result:
    async with sidecar(phase.nofile, cpu) as (proc, port, log):
        w = Watch(psutil.Process(proc.pid))
        await asyncio.sleep(0.5)
        w.tick()
        rss_before = w.rss[-1]
        w.rss.clear()
        (user0, sys0), t0 = w.split(), time.monotonic()
        flood_args = ["--flood", phase.flood, "--port", str(port), "--connections", str(phase.connections)]
        flood_task = asyncio.ensure_future(
            run_in(_me(*flood_args, "--seconds", str(FLOOD_SECONDS)), FLOOD_PRIORITY)
        )
        hog = None
        if HOG and phase.group == "probes" and phase.flood not in ("hog", "none"):
            hog_args = ["--flood", "hog", "--port", "0", "--seconds", str(FLOOD_SECONDS)]
            hog = asyncio.ensure_future(run_in(_me(*hog_args), FLOOD_PRIORITY))
        await asyncio.sleep(0.3)  # the flood under way
        probe_args = ["--sample", "--port", str(port), "--seconds", str(FLOOD_SECONDS - 0.8)]
        probe_args += ["--rate", str(phase.rate)] + (["--on-time"] if phase.group == "probes" else [])
        sampler = asyncio.ensure_future(run_in(_me(*probe_args), PROBER_PRIORITY, PROBER_CORE))
        watcher = asyncio.ensure_future(watch_while(w, flood_task))
        samples = json.loads(await sampler)
        counts = json.loads(await flood_task)
        if hog is not None:
            await hog
        await watcher
        user1, sys1 = w.split()
        elapsed = time.monotonic() - t0
        cpu_share = (user1 - user0 + sys1 - sys0) / elapsed
        kernel_share = (sys1 - sys0) / elapsed
        rss_peak, fds_peak = max(w.rss, default=0.0), max(w.fds, default=0)
        await asyncio.sleep(SETTLE_SECONDS)
        w.tick()
        rss_after = w.rss[-1] if proc.returncode is None else 0.0
        aborted = proc.returncode is not None
        exit_code, exit_seconds = await sigterm_under(proc, flood_args)
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-5:])
    latencies = [t for t, _, _ in samples]
    failures = sum(1 for _, status, _ in samples if status != 200)
    slowest = sorted(samples, reverse=True)[:5]
    return Result(
        phase,
        latencies,
        failures,
        rss_before,
        rss_peak,
        rss_after,
        fds_peak,
        cpu_share,
        kernel_share,
        counts,
        exit_seconds,
        exit_code,
        aborted,
        tail,
        [(round(t * 1000, 1), when) for t, _, when in slowest],
    )


async def sigterm_under(proc: asyncio.subprocess.Process, flood_args: list[str]) -> tuple[int | None, float]:
    """SIGTERM to the sidecar under the same flood: its exit code and how long it took to exit."""
    again = asyncio.ensure_future(
        run_in(_me(*flood_args, "--seconds", str(SIGTERM_AFTER + GOAL_EXIT_S + 1)), FLOOD_PRIORITY)
    )
    await asyncio.sleep(SIGTERM_AFTER)
    exit_code: int | None = proc.returncode
    exit_seconds = float("nan")
    if exit_code is None:
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            exit_code = None
        exit_seconds = time.monotonic() - sent
    await again
    return exit_code, exit_seconds


def report(r: Result) -> list[str]:
    p = r.phase
    lat = r.latencies or [float("nan")]
    return [
        f"{p.name}: {p.what}",
        f"  /healthz ({len(r.latencies)} probes, a new connection each): "
        f"p50 {percentile(lat, 50) * 1000:.1f} ms, "
        f"p99 {percentile(lat, 99) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms, failed {r.failures}"
        + (f"; slowest {', '.join(f'{ms:g} ms at {at:g} s' for ms, at in r.slowest)}" if r.slowest else ""),
        f"  sidecar: RSS {r.rss_before:.1f} -> peak {r.rss_peak:.1f} -> {r.rss_after:.1f} MiB "
        f"({SETTLE_SECONDS:g} s after); fds peak {r.fds_peak}"
        + (f" of {p.nofile}" if p.nofile else "")
        + f"; CPU {r.cpu_share * 100:.0f} % of a core during the flood"
        + f" ({r.kernel_share * 100:.0f} % in the kernel)"
        + (
            f", {r.cpu_share * 1e6 / (r.counts['attempted'] / r.counts['seconds']):.1f} us per connection"
            if p.group == "probes" and r.counts.get("attempted") and r.counts.get("seconds")
            else ""
        ),
        "  flood: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.counts.items())
        + (
            f" ({r.counts['attempted'] / r.counts['seconds']:,.0f} connects/s)"
            if r.counts.get("seconds")
            else ""
        ),
        f"  SIGTERM under the flood: exit {r.exit_code} after {r.exit_seconds:.2f} s"
        + ("  ** the sidecar died during the flood **" if r.aborted else ""),
    ]


def verdicts(results: list[Result]) -> list[str]:
    out = []
    for r in results:
        p99 = percentile(r.latencies, 99) * 1000 if r.latencies else float("inf")
        checks: list[tuple[str, Callable[[], bool]]] = [
            ("no abort", lambda r=r: not r.aborted),  # type: ignore[misc]
            (
                f"p99 {'<' if r.phase.group == 'probes' else '<='} {r.phase.goal_p99_ms:g} ms",
                lambda p99=p99, r=r: (
                    p99 < r.phase.goal_p99_ms
                    or (  # type: ignore[misc]
                        r.phase.group == "limits" and p99 == r.phase.goal_p99_ms
                    )
                ),
            ),
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
    # SIGTERM (a timeout's): the cgroups and the sidecar are cleaned up as on an error.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = os.environ.get("STRESS_PHASES")
    names = set(wanted.split(",")) if wanted else {"limits"}
    phases = [p for p in PHASES if p.name in names or p.group in names]
    print(
        f"{os.cpu_count()} cores; sidecar pinned to core 0, flood and prober to core 1; "
        f"{FLOOD_SECONDS:g} s of flood per phase, /healthz {SAMPLE_RATE:g}/s ({PROBE_RATE:g}/s in the "
        f"probe phases); priority: sidecar {' '.join(PRIORITY) or 'ordinary'}, "
        f"prober {' '.join(PROBER_PRIORITY) or 'ordinary'}, flood {' '.join(FLOOD_PRIORITY) or 'ordinary'}"
        f"{'; a busy core beside the sidecar' if HOG else ''}; sidecar from {SIDECAR_SRC or 'here'}; "
        f"load average {os.getloadavg()[0]:.2f} before"
    )
    with contextlib.ExitStack() as stack:
        if SHARES:
            group = stack.enter_context(CpuLimit(0, shares=True, name=f"hami-guard-stress-w{os.getpid()}"))
            print(group.why or f"the sidecar, the flood and the spinning process in {group.path}")
            _groups.append(group)
            stack.callback(_groups.clear)
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
    print(
        "goals: no abort, /healthz p99 <= 50 ms (< 20 ms in the probe phases), no failed probe, "
        "peak RSS below the limit, exit 0 <= 2 s"
    )
    lines = verdicts(results)
    print("\n".join(lines))
    return 0 if all(line.endswith(": met") for line in lines) else 1


def cli() -> int:
    p = argparse.ArgumentParser(prog="bench.stress")
    p.add_argument(
        "--flood",
        choices=("idle", "keepalive", "slowloris", "pipelined", "reconnect", "halfopen", "hog", "none"),
    )
    p.add_argument("--sample", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--connections", type=int, default=0)
    p.add_argument("--seconds", type=float, default=FLOOD_SECONDS)
    p.add_argument("--rate", type=float, default=SAMPLE_RATE)
    p.add_argument("--on-time", action="store_true", help="each probe when due, counted from then")
    args = p.parse_args()
    if args.flood:
        print(json.dumps(vars(run_flood(args.flood, args.port, args.connections, args.seconds))))
        return 0
    if args.sample:
        if args.on_time:
            print(json.dumps(asyncio.run(sample_on_time(args.port, args.seconds, args.rate))))
        else:
            print(json.dumps(sample(args.port, args.seconds, args.rate)))
        return 0
    return asyncio.run(main())


if __name__ == "__main__":
    raise SystemExit(cli())
