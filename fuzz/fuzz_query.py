"""Fuzz the HTTP query handling: request targets (paths, ?exclude=, ?verbose, /healthz/<check>) through
the real stack, socket to view: sidecar/server/serving.py's front and limits, aiohttp's parser, the views of
sidecar/server/views.py, for a sidecar before and after its first probe round and for a bad configuration.

Fails (an escaping exception) when a view raises (a 500: the serving middleware counts it), when
the liveness answer is not the view's (a /healthz that is neither 200 nor 503, a 404 or 400 aside), or
when a GET of a probe path that closes its connection (answered at the front where it reads as a probe)
is answered otherwise than the same GET kept alive (always aiohttp's).

Input: the first byte picks the app and the method, the rest is the request target.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading

from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config import BadConfig, Settings
from sidecar.server.metrics import Metrics
from sidecar.server.serving import BoundedServer, ProbeAnswer, is_probe_path
from sidecar.server.views import build_app, build_error_app, probe_answers

_METHODS = (b"GET", b"HEAD", b"POST", b"OPTIONS")


class _Stack:
    """Three servers on loopback, in a loop on a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: list[BoundedServer] = []
        self.sidecars: list[Sidecar] = []
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True, name="fuzz-http").start()
        started.wait(30)
        assert len(self.servers) == 3, "the fuzz servers did not start"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        settings = Settings(host="127.0.0.1", port=0)
        apps: list[tuple[web.Application, ProbeAnswer | None]] = []
        for ready in (False, True):
            sidecar = Sidecar(settings)
            sidecar.rounds = int(ready)
            self.sidecars.append(sidecar)
            apps.append((build_app(sidecar), probe_answers(sidecar)))
        problem = BadConfig(
            "hami-sidecar: error: unrecognized arguments: x", "127.0.0.1", 0, "", "text", "INFO"
        )
        apps.append((build_error_app(problem, Metrics()), None))
        for app, answer in apps:
            server = BoundedServer(app, "127.0.0.1", 0, work_rate=1e9, answer=answer)
            await server.start()
            server.port = server.sockets[0].getsockname()[1]
            self.servers.append(server)


_stacks: list[_Stack] = []  # started on the first input, not at import


def _parse_first(raw: bytes) -> tuple[int, bytes] | None:
    """The first answer's status and body, or None when the server closed without one."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    return int(head.split(b" ", 2)[1]), rest[: _length(head)]


def TestOneInput(data: bytes) -> None:
    if not _stacks:
        _stacks.append(_Stack())
    if not data:
        return
    pick, target = data[0], data[1:]
    server = _stacks[0].servers[pick % 3]
    method = _METHODS[(pick // 3) % len(_METHODS)]
    errors = server.stats.errors
    request = method + b" /" + target + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    answer = _exchange(server.port, request)
    if server.stats.errors != errors:
        raise AssertionError(f"a view raised on {request!r}: {answer!r}")
    if answer is None:
        return  # closed by the serving limits (an oversized or pipelined head)
    status, body = answer
    if status == 500:
        raise AssertionError(f"500 for {request!r}: {body!r}")
    path = b"/" + target.split(b"?", 1)[0]
    if method == b"GET" and path in (b"/healthz", b"/livez") and status not in (200, 503, 400):
        raise AssertionError(f"{status} for {request!r}: liveness answers 200 or 503")
    if method == b"GET" and is_probe_path(path.decode("latin-1")):  # the paths the front may answer
        kept = _exchange(server.port, request.replace(b"Connection: close", b"X-Kept: alive"), kept=True)
        if _timeless(kept) != _timeless(answer):
            raise AssertionError(f"{request!r}: {answer!r} closing, {kept!r} kept alive")


def _exchange(port: int, request: bytes, kept: bool = False) -> tuple[int, bytes] | None:
    """Send `request` on a new connection; its first answer, read to the server's close or, `kept`
    alive, to the end of the answer's body (the client closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        raw = b""
        try:
            while chunk := s.recv(65536):
                raw += chunk
                if kept and (answer := _parse_first(raw)) is not None and len(answer[1]) == _length(raw):
                    return answer
        except ConnectionResetError:
            pass
    return _parse_first(raw)


def _length(raw: bytes) -> int:
    """The first answer's Content-Length (0 without one)."""
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _timeless(answer: tuple[int, bytes] | None) -> tuple[int, bytes] | None:
    """The answer without the seconds of grace left, which may tick between the two requests."""
    return answer and (answer[0], re.sub(rb"\(grace: \d+s left\)", b"(grace: ...)", answer[1]))
