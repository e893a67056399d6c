"""Bounded HTTP serving: the listening socket, every connection's lifetime, and what a flood may cost.

`/healthz` is the device plugin's livenessProbe: answered late or not at all, it restarts a healthy
GPU plugin. So nothing a client does may hold the loop, the memory or the file descriptors that
answer it. aiohttp parses HTTP and runs the views (sidecar/server/views.py); this module owns, below them:

- the accept loop (not asyncio's: that one accepts a whole backlog at once and, out of descriptors,
  retries a second later with the fd table full, which is when gRPC's core aborts the process);
- the kernel's wait (TCP_DEFER_ACCEPT): a connection that sends nothing is never accepted, so an idle
  flood, however it reconnects, costs nothing here and never queues ahead of a probe;
- the front: a new connection is read at once, and what needs no waiting never gets a reader (a
  probe's complete head is answered or handed to aiohttp; part of a head and a FIN is closed); until
  its first request head is complete, a connection is a bare socket in an epoll set of the front's
  own, which the loop watches as one reader (no transport, no task, no aiohttp handler, no handle of
  the loop's), so slow-header connections cost next to nothing and close at once; a complete head
  hands the socket to aiohttp;
- a probe answered at the front: a GET of a probe path whose client closes after the answer (the
  kubelet's httpGet and the exec probe's shell both do) is answered on the bare socket, from the
  same views, and closed. A transport, a task and aiohttp's handler for one request cost about
  three times the answer itself; the kubelet sends about 50 such requests a minute to each sidecar;
- a cap on open connections: past it, the least recently active are closed, so that a new
  connection (the kubelet's prober opens one per probe) always gets in; past the cap on fronts, a
  new one that sent part of a head is closed on arrival (a probe sends its whole head in one
  write), so that a slow-header flood that reconnects costs an accept and a close each time;
- a file-descriptor reserve: HTTP never takes the last FD_RESERVE descriptors of RLIMIT_NOFILE,
  which the gRPC probes, epoll, inotify and the checkpoint reads need;
- deadlines: a first request head within HEADER_TIMEOUT of the connection, and each next one
  within IDLE_TIMEOUT of the previous answer (a client that does not read its answers misses it);
- bounds on pipelined requests and on the size of a request head;
- the probe paths ahead of everything else: /metrics, /status and unknown paths share a budget of
  WORK_RATE requests per second, past which they are answered 503 and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import errno
import logging
import math
import os
import re
import resource
import select
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from multidict import MultiMapping
from yarl import URL

logger = logging.getLogger(__name__)

# The paths the kubelet probes (the plugin's liveness and readiness, the sidecar's own): never rate
# limited, answered from memory, and served before other work queued in the same turn of the loop.
# sidecar/server/views.py routes them; this is the one list of which are probes.
PROBE_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/sidecarz", "/sidecarz/live"})
PROBE_PREFIXES = ("/healthz/", "/readyz/")

# Who connects legitimately: the kubelet (a few probes, a new connection each, every few seconds),
# Prometheus (one or two scrapers) and an operator's curl. Past MAX_CONNECTIONS handlers (aiohttp's
# parser, task and buffers: about 20 KiB each), the least recently active is closed. The cap also sets
# the memory a flood leaves behind: what Python's allocator took at the peak stays mapped (bounded:
# it is reused by the next flood), about 3 MiB at 128 handlers and 5 MiB at 256 (BENCHMARKS.md).
MAX_CONNECTIONS = 128
# Connections still waiting for their first complete head: a bare socket and a few hundred bytes
# each, so that a slow-header flood of this many is held (and timed out) rather than churned.
MAX_FRONTS = 1024
# Descriptors HTTP never takes: a gRPC probe round needs a few (a socket per channel, the core's epoll
# and wakeup fds), plus inotify, the checkpoint reads and logging. A fourth of the limit below 256.
FD_RESERVE = 64
# A first request head must be complete this long after the connection opened; the kubelet's arrives
# within a millisecond. Slow-header (slowloris) and idle connections are closed.
HEADER_TIMEOUT = 5.0
# Once half the room for fronts is taken, a new connection gets this long for its first head. The
# kubelet's and Prometheus' requests come within a millisecond; a slow client past the held ones is
# closed soon, so that one that reconnects at once costs a few accepts a second, not a busy loop.
PROBATION = 0.25
# Keep-alive: the next request head must be complete this long after the previous answer was handed
# to the socket. Also what a client that does not read its answers gets: once the socket's buffers
# are full no answer is handed over, and the connection is closed at this deadline.
IDLE_TIMEOUT = 5.0
# Requests a client may send ahead of the answers; more and the connection is closed.
MAX_PIPELINED = 8
# A request head (request line and headers) larger than this closes the connection; no endpoint takes
# a body, so bytes that are not a head are not accepted either.
MAX_HEAD_BYTES = 8 * 1024
MAX_HEADERS = 32
# Answers waiting in user space for a client that does not read (the kernel's buffers come first).
WRITE_BUFFER_HIGH = 16 * 1024
# Non-probe requests (/metrics, /status, 404s) per second, with a burst of as many. Prometheus scrapes
# every 15 to 60 s; past the budget, 503 with Retry-After and the connection closed.
WORK_RATE = 100.0
# Connections accepted in one turn of the loop: short turns, so that a probe's few turns stay short.
ACCEPT_BATCH = 16
# Fronts read in one turn of the loop (their own epoll set, one reader of the loop's for all of them).
FRONT_BATCH = 64
# The kernel's queue of connections not yet accepted (clamped to net.core.somaxconn, 4096 by default
# since Linux 5.4). Past it the kernel drops the handshake and the client retries a second later: a
# burst of connections larger than the queue delays every probe in it by a second (measured with
# 512). A connection waiting in the queue is answered late but answered, within the probe's timeout,
# where one closed to shorten the queue would be a failed probe.
BACKLOG = 4096
# How often deadlines are checked while any connection is open (each check costs what expired).
SWEEP_INTERVAL = 0.05
# When nothing can be accepted (the reserve is reached and nothing can be closed): retry this later.
ACCEPT_PAUSE = 0.05
# Shutdown: answers in flight get this long, then every connection is aborted.
SHUTDOWN_GRACE = 0.2
# A warning about closed connections at most this often.
LOG_EVERY = 10.0

# The end of a request head: an empty line, with CRLF line ends or bare LF (which aiohttp answers 400,
# or serves: either way at once, not at the header deadline).
_TERMINATOR = re.compile(rb"\n\r?\n")
_RECV = 65536
# What the front answers itself: one head, `GET <path> HTTP/1.x`, its header lines in their plain form
# (CRLF line ends, no obsolete folding); anything else is aiohttp's to parse and answer.
_REQUEST_LINE = re.compile(rb"GET (/[!-~]*) HTTP/1\.([01])\r\n")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([\t -~\x80-\xff]*)\r\n")
_HEAD_END = re.compile(rb"\r\n")
# Headers that announce a body, a protocol switch or an interim answer: aiohttp's to handle.
_NOT_AT_FRONT = frozenset({b"content-length", b"transfer-encoding", b"upgrade", b"expect"})
# An answer the front sends must fit a fresh connection's send buffer (16 KiB by default) at once.
FRONT_ANSWER_MAX = 8 * 1024
_TCP_INFO_LEN = 104  # struct tcp_info up to tcpi_total_retrans (Linux 2.6.x on)
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def is_probe_path(path: str) -> bool:
    return path in PROBE_PATHS or path.startswith(PROBE_PREFIXES)


def fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def fd_reserve(limit: int) -> int:
    return min(FD_RESERVE, limit // 4)


def open_fds() -> int | None:
    """Descriptors open in this process (Linux; about 120 us for 250); None where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
    except OSError:
        return None


# A probe's answer from memory, (status, text/plain body), given its path and query; None: the app's.
ProbeAnswer = Callable[[str, MultiMapping[str]], "tuple[int, str] | None"]


def text_body(text: str) -> bytes:
    """A text/plain answer's body: UTF-8, where a name read from the node that is not (a file name
    undecodable as UTF-8 is kept with lone surrogates) shows its bytes escaped."""
    return text.encode("utf-8", "backslashreplace")


def closing_probe(head: bytes) -> tuple[str, str, int] | None:
    """(path, query string, HTTP minor version) of a probe's GET whose client closes the connection
    after the answer, where `head` is that one complete head and nothing more; else None."""
    line = _REQUEST_LINE.match(head)
    if line is None or len(head) > MAX_HEAD_BYTES:
        return None
    path, _, query = line.group(1).decode("ascii").partition("?")
    if path not in PROBE_PATHS or "#" in query:
        return None
    minor = int(line.group(2))
    close = keep = False
    hosts = 0
    pos = line.end()
    for _ in range(MAX_HEADERS + 1):
        end = _HEAD_END.match(head, pos)
        if end is not None:  # HTTP/1.1 keeps the connection unless told; 1.0 closes unless told
            closes = close or (minor == 0 and not keep)
            one_host = hosts == 1 or (minor == 0 and hosts == 0)  # aiohttp answers others 400
            return (path, query, minor) if closes and one_host and end.end() == len(head) else None
        header = _HEADER_LINE.match(head, pos)
        if header is None:
            return None
        name = header.group(1).lower()
        if name in _NOT_AT_FRONT:
            return None
        hosts += name == b"host"
        if name == b"connection":
            tokens = {t.strip().lower() for t in header.group(2).split(b",")}
            close |= b"close" in tokens
            keep |= b"keep-alive" in tokens
        pos = header.end()
    return None


@dataclass
class Stats:
    """Counters since start, for the log and tests."""

    accepted: int = 0
    answered: int = 0  # probes answered at the front, without aiohttp
    upgraded: int = 0  # connections whose first head completed: handed to aiohttp
    probation: int = 0  # accepted with the short deadline for a first head
    evicted: int = 0  # closed to make room past the cap
    turned_away: int = 0  # closed on arrival past the cap, with part of a head (never a probe's)
    header_timeout: int = 0
    idle_timeout: int = 0
    pipelined: int = 0  # closed for pipelining past MAX_PIPELINED
    oversized: int = 0  # closed for a head past MAX_HEAD_BYTES
    busy: int = 0  # non-probe requests answered 503 past WORK_RATE
    malformed: int = 0  # requests aiohttp could not parse: answered 400 and closed by aiohttp
    errors: int = 0  # requests a view failed on: answered 500 (a bug; logged with its traceback)
    accept_paused: int = 0  # times accepting waited for descriptors
    peak_connections: int = 0
    fd_limit: int = 0
    fd_reserve: int = 0


class _Bucket:
    """A token bucket: `rate` per second, a burst of `rate`."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.tokens = rate
        self.clock = clock
        self.last = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class _Front:
    """A connection before its first complete request head: a bare socket, and a reader callback once
    it has to wait for more of its head (`watched`)."""

    __slots__ = ("buf", "deadline", "fd", "sock", "watched")

    def __init__(self, sock: socket.socket, buf: bytes) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # -1 once closed or handed to aiohttp
        self.buf = buf
        self.deadline = 0.0
        self.watched = False


class _FrontSet:
    """The fronts waiting for (the rest of) their first head, in the order they came (so their
    deadlines are in order too): the held ones, and those on probation, with the short deadline. Their
    sockets are in an epoll set of this one's own, which the loop watches as one reader: registering
    one costs a system call, where the loop's `add_reader` and `remove_reader` cost 5.5 us together."""

    def __init__(self) -> None:
        self.held: OrderedDict[_Front, None] = OrderedDict()
        self.probation: OrderedDict[_Front, None] = OrderedDict()
        self._epoll: select.epoll | None = None
        self._by_fd: dict[int, _Front] = {}

    def __len__(self) -> int:
        return len(self.held) + len(self.probation)

    def open(self, loop: asyncio.AbstractEventLoop, readable: Callable[[_Front], None]) -> None:
        self._epoll = epoll = select.epoll()

        def ready() -> None:  # at most FRONT_BATCH a turn of the loop
            if not epoll.closed:
                for fd, _ in epoll.poll(0, FRONT_BATCH):
                    if (front := self._by_fd.get(fd)) is not None:
                        readable(front)

        loop.add_reader(epoll.fileno(), ready)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._epoll is not None:
            loop.remove_reader(self._epoll.fileno())
            self._epoll.close()

    def oldest(self) -> _Front | None:
        """The one to close first for room: on probation, else held."""
        return next(iter(self.probation), None) or next(iter(self.held), None)

    def watch(self, front: _Front, probation: bool) -> None:
        (self.probation if probation else self.held)[front] = None
        assert self._epoll is not None
        self._epoll.register(front.fd, select.EPOLLIN)
        self._by_fd[front.fd] = front
        front.watched = True

    def unwatch(self, front: _Front) -> None:
        if front in self.held:
            del self.held[front]
        else:
            self.probation.pop(front, None)
        if self._by_fd.pop(front.fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(front.fd)
        front.watched = False


class _Connection(asyncio.Protocol):
    """A connection handed to aiohttp: the transport's protocol, in front of aiohttp's own.

    aiohttp's `web.Server` is a protocol factory (its documented role); this wraps what it makes,
    counting request heads on their way in and answers on their way out (BoundedServer's
    middleware), with the deadline the server enforces. No aiohttp class is subclassed.
    """

    def __init__(self, owner: BoundedServer, prefix: bytes, inner: asyncio.Protocol) -> None:
        self.owner = owner
        self.inner = inner
        self.prefix = prefix  # what the front read: the first head, maybe more
        self.transport: asyncio.Transport | None = None
        self.deadline = owner.loop.time() + IDLE_TIMEOUT
        self.answered = 0
        self.heads = 0
        self.partial = 0  # bytes received since the last complete head
        self.tail = b""  # the last bytes of the previous chunk: a terminator may be split
        self.closing = False
        self.made = False  # aiohttp's protocol saw connection_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self.closing:  # closed before its transport existed
            transport.abort()
            return
        self.transport = transport
        self.owner._by_transport[transport] = self
        self.made = True
        self.inner.connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        prefix, self.prefix = self.prefix, b""
        self.data_received(prefix)  # before the transport's own reads, which start a turn later

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._forget(self)
        if self.made:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        chunk = self.tail + data
        # Terminators that end past the carried-over tail: one inside the tail was counted already.
        ends = [m.end() for m in _TERMINATOR.finditer(chunk) if m.end() > len(self.tail)]
        self.tail = chunk[-2:]
        if ends:
            self.heads += len(ends)
            self.partial = len(chunk) - ends[-1]
        else:
            self.partial += len(data)
        if self.heads - self.answered > MAX_PIPELINED:
            self.owner._close(self, "pipelined")
        elif self.partial > MAX_HEAD_BYTES:
            self.owner._close(self, "oversized")
        else:
            self.inner.data_received(data)

    def answer_sent(self) -> None:
        """An answer was handed to the transport: the next head has IDLE_TIMEOUT from now."""
        self.answered += 1
        self.deadline = self.owner.loop.time() + IDLE_TIMEOUT
        self.owner._active(self)


class _RequestLog(logging.Handler):
    """Where aiohttp's own log lines go (the `logger` argument of its server): a client's malformed
    request is one DEBUG line and a count in the serving limits' periodic warning, never a traceback."""

    def __init__(self, owner: BoundedServer) -> None:
        super().__init__(logging.DEBUG)
        self.owner = owner

    def emit(self, record: logging.LogRecord) -> None:
        """With an exception, a request aiohttp could not parse (answered 400 and closed by aiohttp):
        never a traceback, at most a DEBUG line, and a count."""
        exc = record.exc_info[1] if record.exc_info else None
        try:
            if exc is not None:
                self.owner.stats.malformed += 1
                self.owner._count("malformed")
            if logger.isEnabledFor(logging.DEBUG):
                what = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
                logger.debug("HTTP: %s", _printable(what)[:200])
        except Exception:  # a log line must never break serving
            pass


class BoundedServer:
    """Serves an aiohttp Application on host:port within the bounds above; owns its AppRunner."""

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_fronts: int = MAX_FRONTS,
        work_rate: float = WORK_RATE,
        nofile: int | None = None,
        answer: ProbeAnswer | None = None,
    ) -> None:
        """`nofile`: the descriptor limit to plan for (default: this process's RLIMIT_NOFILE).
        `answer`: the probes' answers the front sends itself to a client that closes after one; the
        app must answer the same on those paths (it does for every other client)."""
        self.host = host
        self.answer = answer
        self._date = (0, "")
        self.nofile = nofile
        self.port = port
        self.max_connections = max_connections
        self.max_fronts = max_fronts
        self.loop = asyncio.get_running_loop()
        self.stats = Stats()
        self.bucket = _Bucket(work_rate)
        app.middlewares.append(_middleware(self))
        # aiohttp's log lines (a malformed request is an exception with a traceback there) go to a
        # logger of this server's own, outside logging's tree: one DEBUG line each, and a count.
        self.request_log = logging.Logger(f"{__name__}.aiohttp", logging.DEBUG)
        self.request_log.addHandler(_RequestLog(self))
        self.request_log.propagate = False
        # Handler arguments (documented ones of AppRunner): aiohttp's keep-alive timer is a backstop
        # to the sweep. Checked on a handler at start-up (_check_limits).
        self._limits: dict[str, Any] = {
            "keepalive_timeout": 2 * IDLE_TIMEOUT,
            "max_headers": MAX_HEADERS,
            "logger": self.request_log,
        }
        self.runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE, **self._limits
        )
        self._listeners: list[socket.socket] = []
        self._deferred = False  # the kernel holds connections until their first bytes (_defer_accept)
        self._fronts = _FrontSet()
        # Handlers, least recently active first (their deadlines in order too): what the cap closes.
        self._conns: OrderedDict[_Connection, None] = OrderedDict()
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        # Aborted handlers whose descriptor the transport closes a turn later.
        self._dying: set[_Connection] = set()
        self._pending: set[asyncio.Task[Any]] = set()
        self._others = 0  # descriptors open that are not HTTP connections
        self._others_sampled = -1.0
        self._sweeper: asyncio.TimerHandle | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._reading = False
        self._started = False
        self._closed = False
        self._logged = -LOG_EVERY
        self._unlogged: dict[str, int] = {}
        self._errors_logged = -LOG_EVERY

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.runner.setup()
        self._started = True
        assert self.runner.server is not None
        _check_limits(self.runner.server(), self._limits)
        limit = self.nofile or fd_limit()
        self.stats.fd_limit = limit
        self.stats.fd_reserve = fd_reserve(limit)
        self._listeners = _listen(self.host, self.port)
        self._deferred = all([_defer_accept(s) for s in self._listeners])
        self._fronts.open(self.loop, self._front_readable)
        self._sample_fds(force=True)
        self._start_reading()

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._listeners)

    @property
    def connections(self) -> int:
        """Descriptors held by HTTP connections."""
        return len(self._fronts) + len(self._conns) + len(self._dying)

    async def close(self) -> None:
        """Stop accepting; give answers in flight SHUTDOWN_GRACE, then abort every connection."""
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        for handle in (self._resume, self._sweeper):
            if handle is not None:
                handle.cancel()
        for s in self._listeners:
            s.close()
        self._listeners = []
        for front in [*self._fronts.held, *self._fronts.probation]:
            self._drop(front)
        self._fronts.close(self.loop)
        for conn in list(self._conns):
            if conn.answered >= conn.heads:
                self._drop(conn)  # nothing in flight
        deadline = self.loop.time() + SHUTDOWN_GRACE
        while self._conns and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self._conns):
            self._drop(conn)
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=1.0)
        for _ in range(100):  # a transport closes its socket a turn after abort()
            if not self._dying:
                break
            await asyncio.sleep(0.005)
        self._log_closed(force=True)
        if self.stats.accepted:
            logger.info("HTTP serving: %s", ", ".join(f"{k} {v}" for k, v in vars(self.stats).items()))
        if self._started:
            await self.runner.cleanup()

    # -- connections ---------------------------------------------------------------------
    def _forget(self, conn: _Connection) -> None:
        self._conns.pop(conn, None)
        self._dying.discard(conn)
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)

    def _active(self, conn: _Connection) -> None:
        if conn in self._conns:
            self._conns.move_to_end(conn)

    def _drop(self, conn: _Front | _Connection) -> bool:
        """Close now: a front's descriptor at once, a handler's when its transport lets go of it."""
        if isinstance(conn, _Front):
            if conn.fd < 0:
                return False  # closed already, or aiohttp's now
            if conn.watched:
                self._fronts.unwatch(conn)
            conn.fd = -1
            conn.sock.close()
            return True
        if conn not in self._conns:
            return False
        del self._conns[conn]
        conn.closing = True
        self._dying.add(conn)
        if conn.transport is not None:
            conn.transport.abort()
        return True

    def _close(self, conn: _Front | _Connection, reason: str) -> None:
        if not self._drop(conn):
            return
        setattr(self.stats, reason, getattr(self.stats, reason) + 1)
        self._count(reason)

    def _log_closed(self, force: bool = False) -> None:
        now = self.loop.time()
        if not self._unlogged or (not force and now - self._logged < LOG_EVERY):
            return
        self._logged = now
        closed = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in sorted(self._unlogged.items()))
        self._unlogged.clear()
        logger.warning(
            "HTTP connections closed (bad requests and serving limits): %s; open %d (descriptor budget %d)",
            closed,
            self.connections,
            self.fd_budget(),
        )

    # -- descriptors -------------------------------------------------------------------
    def _sample_fds(self, force: bool = False) -> None:
        """Count the descriptors that are not HTTP connections (not on every accept: it costs)."""
        now = self.loop.time()
        if not force and now - self._others_sampled < ACCEPT_PAUSE:
            return
        self._others_sampled = now
        total = open_fds()
        self._others = 32 if total is None else max(0, total - self.connections)

    def fd_budget(self) -> int:
        """Descriptors HTTP connections may hold now."""
        return max(0, self.stats.fd_limit - self.stats.fd_reserve - self._others)

    # -- accepting ---------------------------------------------------------------------
    def _start_reading(self) -> None:
        if self._reading or self._closed:
            return
        for s in self._listeners:
            self.loop.add_reader(s.fileno(), self._on_readable, s)
        self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            for s in self._listeners:
                self.loop.remove_reader(s.fileno())
            self._reading = False

    def _pause(self) -> None:
        """Nothing can be accepted now: new connections wait a moment in the (bounded) backlog."""
        self.stats.accept_paused += 1
        self._stop_reading()
        self._resume = self.loop.call_later(ACCEPT_PAUSE, self._resume_reading)

    def _resume_reading(self) -> None:
        self._resume = None
        self._sample_fds(force=True)
        self._start_reading()

    def _fd_room(self) -> bool:
        """Whether one more descriptor may be taken; closes the oldest connection (on probation, else a
        front, else a handler) while none may."""
        if self.connections + self._others + ACCEPT_BATCH >= self.stats.fd_limit - self.stats.fd_reserve:
            self._sample_fds()
        while self.fd_budget() - self.connections <= 0:
            if self._dying:
                return False  # they free their descriptors a turn later: accept then
            victim: _Front | _Connection | None = self._fronts.oldest() or next(iter(self._conns), None)
            if victim is None:
                return False
            self._close(victim, "evicted")
        return True

    def _on_readable(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            if not self._fd_room():
                if not self._dying:
                    self._pause()  # the reserve is reached by others: nothing of ours to wait for
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _ACCEPT_RESOURCE_ERRORS:
                    self._sample_fds(force=True)
                    self._pause()
                    return
                continue  # ECONNABORTED and the like: that client is gone
            self.stats.accepted += 1
            self._triage(sock)

    def _triage(self, sock: socket.socket) -> None:
        """A new connection, read at once. A probe's request is usually there already: answered (or
        handed to aiohttp) without the connection ever being watched. Past the cap, one that sent part
        of a head is closed at once (a probe sends its whole head in one write); one that sent nothing
        may be a probe whose head is on its way, and the oldest front makes room for it."""
        buf = _recv_now(sock)
        if buf == b"":  # gone before a byte (or reset)
            sock.close()
            return
        if buf is None and self._deferred and _waited_in_kernel(sock):
            sock.close()  # silent through the kernel's whole wait: past its header deadline
            self.stats.header_timeout += 1
            self._count("header_timeout")
            return
        front = _Front(sock, buf or b"")
        if buf and self._consume(front):
            return
        full = len(self._fronts) >= self.max_fronts
        if buf and full:
            front.fd = -1
            sock.close()
            self.stats.turned_away += 1
            self._count("turned_away")
            return
        if buf:  # part of a head: a FIN right behind it (a client that shut its side) closes it now
            more = _recv_now(sock)
            if more == b"":
                front.fd = -1
                sock.close()
                return
            if more:
                front.buf += more
                if self._consume(front):
                    return
        if full and (victim := self._fronts.oldest()) is not None:
            self._close(victim, "evicted")
        self._hold(front)

    def _hold(self, front: _Front) -> None:
        """A front waiting for (the rest of) its head, watched, with its deadline."""
        front.sock.setblocking(False)
        now = self.loop.time()
        room = min(self.max_fronts, self.fd_budget() - len(self._conns) - len(self._dying))
        probation = len(self._fronts.held) >= room // 2
        front.deadline = now + (PROBATION if probation else HEADER_TIMEOUT)
        self.stats.probation += probation
        self._fronts.watch(front, probation)
        self._note_peak()

    def _note_peak(self) -> None:
        """A connection is held: the peak, and the sweep of deadlines running."""
        self.stats.peak_connections = max(self.stats.peak_connections, self.connections)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _front_readable(self, front: _Front) -> None:
        try:
            data = front.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(front)
            return
        start = max(0, len(front.buf) - 2)
        front.buf += data
        if _TERMINATOR.search(front.buf, start) is None:
            if len(front.buf) > MAX_HEAD_BYTES:
                self._close(front, "oversized")
            return
        self._consume(front)

    def _consume(self, front: _Front) -> bool:
        """What a front read: a complete head is answered here or handed to aiohttp (True); a head too
        large or pipelined too deep closes it (True); False while the head is not complete."""
        if _TERMINATOR.search(front.buf) is None:
            if len(front.buf) <= MAX_HEAD_BYTES:
                return False
            self._close(front, "oversized")
        elif len(_TERMINATOR.findall(front.buf)) > MAX_PIPELINED:
            self._close(front, "pipelined")
        elif self.answer is None or not self._answer_at_front(front):
            self._upgrade(front)
        return True

    def _answer_at_front(self, front: _Front) -> bool:
        """A probe whose client closes after the answer: answered on the bare socket, and closed."""
        assert self.answer is not None
        raw = front_answer(self.answer, front.buf, self._http_date)
        if raw is None:
            return False
        with contextlib.suppress(OSError):  # a client gone before its answer
            # Whole: a fresh connection's send buffer holds FRONT_ANSWER_MAX. Were it short, the
            # client reads a cut answer (the status line first) and the close.
            front.sock.send(raw, socket.MSG_DONTWAIT)
        self.stats.answered += 1
        self._drop(front)
        return True

    def _http_date(self) -> str:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True))
        return self._date[1]

    def _upgrade(self, front: _Front) -> None:
        """A complete head: the socket goes to aiohttp, with what the front read."""
        if front.watched:
            self._fronts.unwatch(front)
        front.fd = -1
        if len(self._conns) >= self.max_connections:
            self._close(next(iter(self._conns)), "evicted")
        server = self.runner.server
        assert server is not None
        conn = _Connection(self, front.buf, server())
        self._conns[conn] = None
        self.stats.upgraded += 1
        self._note_peak()
        task = self.loop.create_task(self._attach(conn, front.sock))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _attach(self, conn: _Connection, sock: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: conn, sock)
        except (OSError, RuntimeError):
            sock.close()
            self._forget(conn)

    def _sweep(self) -> None:
        """Close what missed its deadline; each queue is in deadline order, so this costs what expired."""
        self._sweeper = None
        now = self.loop.time()
        queues: tuple[OrderedDict[Any, None], ...] = (self._fronts.probation, self._fronts.held, self._conns)
        for queue in queues:
            while queue:
                oldest: _Front | _Connection = next(iter(queue))
                if oldest.deadline > now:
                    break
                self._close(oldest, "header_timeout" if isinstance(oldest, _Front) else "idle_timeout")
        self._log_closed()
        if self.connections + self._others >= (self.stats.fd_limit - self.stats.fd_reserve) // 2:
            self._sample_fds()
        if self.connections and not self._closed:
            self._sweeper = self.loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _count(self, reason: str) -> None:
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        self._log_closed()


# -- the probe paths first, and every answer counted -----------------------------------------------
def _middleware(owner: BoundedServer) -> Middleware:
    """aiohttp's middleware of a BoundedServer: the probe paths first, the other paths within the
    bucket, every answer handed to the transport here and counted (the keep-alive deadline)."""
    bucket, stats = owner.bucket, owner.stats

    @web.middleware
    async def bounded(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if is_probe_path(request.path):
                resp = await handler(request)
            elif not bucket.take():
                stats.busy += 1
                resp = web.Response(
                    status=503,
                    text=f"busy: more than {bucket.rate:g} requests per second besides the probes\n",
                    headers={"Retry-After": "1"},
                )
                resp.force_close()
            else:
                # One turn of the loop: probes parsed in the same turn are answered before this work.
                await asyncio.sleep(0)
                resp = await handler(request)
        except web.HTTPException as e:  # 404, 405: aiohttp's own answer, made here
            resp = web.Response(status=e.status, reason=e.reason, text=e.text, headers=e.headers)
        except Exception as e:
            resp = _view_error(owner, request, e)
        # The answer handed to the transport here (StreamResponse's documented streaming calls;
        # aiohttp's own prepare and write_eof after this are no-ops), so that it is counted.
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionError:
            return resp
        conn = owner._by_transport.get(request.transport) if request.transport else None
        if conn is not None:
            conn.answer_sent()
        return resp

    return bounded


def _view_error(owner: BoundedServer, request: web.Request, exc: Exception) -> web.Response:
    """A view raised: a bug of this program, not the client's. Logged with its traceback at most
    once per LOG_EVERY (counted in between), answered 500, the connection closed."""
    owner.stats.errors += 1
    now = owner.loop.time()
    if now - owner._errors_logged >= LOG_EVERY:
        owner._errors_logged = now
        logger.error("HTTP %s %s failed", request.method, _printable(request.path), exc_info=exc)
    else:
        owner._count("errors")
    resp = web.Response(status=500, text="internal error\n")
    resp.force_close()
    return resp


def front_answer(answer: ProbeAnswer, head: bytes, date: Callable[[], str]) -> bytes | None:
    """The whole answer the front sends to `head`, when it is a probe's GET whose client closes after
    the answer; None where aiohttp answers (any other head, the app's own answer, a view's bug, which
    aiohttp answers 500 and logs, rate-limited; an answer too long to send at once)."""
    request = closing_probe(head)
    if request is None:
        return None
    path, query, minor = request
    try:
        answered = answer(path, URL.build(path=path, query_string=query, encoded=True).query)
        if answered is None:
            return None
        status, body = answered[0], text_body(answered[1])
        raw = (
            f"HTTP/1.{minor} {status} {HTTPStatus(status).phrase}\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nDate: {date()}\r\nConnection: close\r\n\r\n"
        ).encode() + body
    except Exception:
        return None
    return raw if len(raw) <= FRONT_ANSWER_MAX else None


def _waited_in_kernel(sock: socket.socket) -> bool:
    """Whether the kernel handed this connection over silent because its wait ran out (the SYN-ACK
    it retransmitted meanwhile shows in tcp_info's total_retrans, at offset 100); a connection handed
    over at once (a SYN cookie's, when the kernel's queue of waiting ones is full) shows none."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        return len(info) >= _TCP_INFO_LEN and int.from_bytes(info[100:104], sys.byteorder) > 0
    except (OSError, AttributeError):
        return False


def _recv_now(sock: socket.socket) -> bytes | None:
    """What has arrived on a socket, without waiting: None nothing yet, b"" the client is gone."""
    try:
        return sock.recv(_RECV, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _printable(text: str) -> str:
    """One line: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _check_limits(handler: asyncio.Protocol, limits: dict[str, Any]) -> None:
    """Fail at start-up unless aiohttp's request handler holds the arguments it was given.

    aiohttp's Server drops every custom handler argument (with a warning) when one is unknown to its
    RequestHandler: the limits would silently be aiohttp's defaults, and its tracebacks back in the
    log. The logger given shows whether that happened (every aiohttp keeps it as `logger`); the
    others are compared where the handler exposes them (3.11 keeps max_headers to its parser). This
    refuses to serve instead; tests/test_serving.py runs on the oldest and newest aiohttp the project
    allows (make test-aiohttp-range).
    """
    missing = object()
    wrong = {}
    for name, want in limits.items():
        held = getattr(handler, name, missing)
        if held is want or (held is missing and name != "logger"):
            continue
        if held is missing or held != want:
            wrong[name] = "(missing)" if held is missing else held
    if wrong:
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__} did not take the serving limits "
            f"({', '.join(f'{k}={v!r}' for k, v in wrong.items())}); "
            "hami-guard supports the aiohttp range in its pyproject.toml"
        )


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address of `host`, as asyncio's create_server binds them."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, *addr[:2]) in seen:
                continue
            seen.add((family, *addr[:2]))
            s = socket.socket(family, type_, proto)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(BACKLOG)
            s.setblocking(False)
    except OSError:
        for s in sockets:
            s.close()
        raise
    return sockets


def _defer_accept(s: socket.socket) -> bool:
    """Connections that have sent nothing stay in the kernel, not in the accept queue (Linux's
    TCP_DEFER_ACCEPT): the kernel hands one over with its first bytes, or once it has waited
    HEADER_TIMEOUT (rounded up to its SYN-ACK retransmissions: 7 s for 5). An idle flood then costs the
    sidecar nothing, and a probe's connection is never queued behind idle ones. Elsewhere: not set."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is None:
        return False
    try:
        s.setsockopt(socket.IPPROTO_TCP, option, math.ceil(HEADER_TIMEOUT))
    except OSError:
        return False
    return True
