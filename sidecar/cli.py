"""hami-sidecar's command line: settings, logging, the HTTP server and a clean shutdown.

Two things here keep the sidecar's own failures from restarting the plugin, whose livenessProbe
points at the sidecar's port:

- a bad configuration (a flag or variable that does not parse) is served, not exited on: one line on
  stderr, then `/healthz` 200 (nothing is judged) and `/readyz`, `/sidecarz`, `/status` 503 with the
  error, on the configured port if that much could be read, else the default one;
- SIGTERM and SIGINT are caught before the heavy imports (grpc and aiohttp take over a second): one
  arriving during start-up stops the sidecar with one log line, not a traceback or a silent -15.

Only the standard library (and hami_guard.console, which imports nothing else) is imported at module
level, for that reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from hami_guard.console import tolerate_any_encoding

if TYPE_CHECKING:
    import asyncio
    import socket

    from sidecar.app import Sidecar
    from sidecar.config import BadConfig, Settings

logger = logging.getLogger("sidecar")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HANDLED = (*STOP_SIGNALS, signal.SIGHUP)
# Stop signals received (the first few: a storm must not grow it), and whether a SIGHUP came.
_received: list[int] = []
_hup = {"seen": False, "logged": False}
# Set while an event loop runs: schedules a call in it. Outside that window a signal is only recorded.
_post: Callable[[Callable[[], object]], object] | None = None
_stop: Callable[[], object] | None = None


def _record(signum: int, _frame: FrameType | None) -> None:
    if signum == signal.SIGHUP:
        _hup["seen"] = True
        _in_loop(_log_hup)
        return
    if len(_received) < 8:
        _received.append(signum)
    if _stop is not None:
        _in_loop(_stop)


def _in_loop(call: Callable[[], object]) -> None:
    """Schedule `call` in the running loop, if one runs; a loop that just closed is no error."""
    post = _post
    if post is not None:
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            post(call)


def _log_hup() -> None:
    if not _hup["logged"]:
        _hup["logged"] = True
        logger.warning("SIGHUP ignored (and any further one, silently): stop with SIGTERM or SIGINT")


def catch_stop_signals() -> None:
    """For the life of the process a stop signal is recorded (the loop acts on it), never fatal.

    Python's handlers stay in place: nothing installs them with the event loop, whose close would
    put the defaults back (a second SIGTERM during shutdown was a -15, a SIGINT a traceback). SIGHUP
    is caught too and ignored: a node's session hang-up must not end the plugin's probe target.
    Blocked while the handlers go in: a SIGINT between SIGTERM's handler and its own would otherwise
    meet Python's default one, a KeyboardInterrupt traceback. A blocked signal waits, then is recorded.
    """
    before = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        for sig in HANDLED:
            signal.signal(sig, _record)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ignore_signals_for_exit() -> None:
    """SIG_IGN from here on: Python's finalization resets its own handlers to SIG_DFL, not SIG_IGN."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("check", "status", "previous"):
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.formatter.converter = time.gmtime  # type: ignore[union-attr]
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def serve(settings: Settings, stop: asyncio.Event, sidecar: Sidecar | None = None) -> Sidecar:
    """Run until `stop` is set; returns the sidecar (for tests that look at it afterwards).

    HTTP is served within sidecar/server/serving.py's bounds (connections, descriptors, deadlines) and is
    closed first on the way out, so that no client can hold the exit.
    """
    from sidecar.app import Sidecar
    from sidecar.server.serving import BoundedServer
    from sidecar.server.views import build_app, probe_answers

    sidecar = sidecar or Sidecar(settings)
    http = BoundedServer(build_app(sidecar), settings.host, settings.port, answer=probe_answers(sidecar))
    try:
        await http.start()
        await sidecar.start()
        logger.info("serving /healthz /readyz /status /metrics on %s:%d", settings.host, settings.port)
        await stop.wait()
    finally:
        await http.close()
        await sidecar.stop()
    return sidecar


async def serve_error(problem: BadConfig, stop: asyncio.Event) -> None:
    """Serve a configuration the sidecar cannot run with until `stop` is set (sidecar/server/views.py)."""
    from sidecar.server.metrics import Metrics
    from sidecar.server.serving import BoundedServer
    from sidecar.server.views import build_error_app

    http = BoundedServer(build_error_app(problem, Metrics()), problem.host, problem.port)
    try:
        await http.start()
        if problem.listen_note:
            logger.error("%s", problem.listen_note)
        logger.error(
            "%s; judging nothing until it is fixed: /healthz 200, /readyz /sidecarz /status 503 on %s:%d",
            problem.error,
            problem.host,
            problem.port,
        )
        await stop.wait()
    finally:
        await http.close()


async def _run(body: Callable[[asyncio.Event], Awaitable[object]]) -> bool:
    """Run `body` until a stop signal; False when one came during start-up (nothing was served)."""
    import asyncio
    import socket

    global _post, _stop  # noqa: PLW0603 - the signal handler's way into the loop
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # A signal that lands just before the loop's epoll_wait would wait for its timeout: the wakeup
    # fd makes the C-level handler wake the loop, and Python's handler runs right after.
    rsock, wsock = socket.socketpair()
    rsock.setblocking(False)
    wsock.setblocking(False)
    loop.add_reader(rsock.fileno(), _drain, rsock)
    previous = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    _stop = stop.set
    _post = loop.call_soon_threadsafe
    try:
        if _received:
            return False
        if _hup["seen"]:
            _log_hup()
        await body(stop)
        return True
    finally:
        _post = _stop = None
        signal.set_wakeup_fd(previous)
        loop.remove_reader(rsock.fileno())
        rsock.close()
        wsock.close()


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


def _stopped_early() -> None:
    logger.info("stopped by %s during start-up", signal.Signals(_received[0]).name)


def main(argv: Sequence[str] | None = None) -> int:
    """0 after a stop signal; 2 after serving a bad configuration; 1 when the address cannot be served."""
    import asyncio

    from sidecar.config import BadConfig, read_settings
    from sidecar.watcher import InotifyUnavailable

    settings = read_settings(sys.argv[1:] if argv is None else argv)
    if isinstance(settings, BadConfig):
        if settings.log_format == "text":  # JSON logs get it as their first line instead
            print(f"{settings.error} (see hami-sidecar --help)", file=sys.stderr, flush=True)
        setup_logging(settings.log_format, settings.log_level)
        return _serve_error(settings)
    setup_logging(settings.log_format, settings.log_level)
    try:
        if not asyncio.run(_run(lambda stop: serve(settings, stop))):
            _stopped_early()
            return 0
    except InotifyUnavailable as e:
        folder = settings.device_plugin_dir
        problem = BadConfig(
            error=f"hami-sidecar: error: --watch-mode inotify: cannot watch {folder}: {e.strerror} "
            "(--watch-mode auto falls back to polling)",
            host=settings.host,
            port=settings.port,
            listen_note="",
            log_format=settings.log_format,
            log_level=settings.log_level,
        )
        return _serve_error(problem)
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", settings.host, settings.port, e.strerror or e)
        return 1
    logger.info("stopped")
    return 0


def _serve_error(problem: BadConfig) -> int:
    import asyncio

    try:
        if not asyncio.run(_run(lambda stop: serve_error(problem, stop))):
            _stopped_early()
            return 2
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", problem.host, problem.port, e.strerror or e)
        return 1
    logger.info("stopped")
    return 2


def run() -> None:
    """Console-script entry point (and `python -m sidecar`): stop signals are caught first."""
    catch_stop_signals()
    tolerate_any_encoding()
    code = main()
    ignore_signals_for_exit()
    raise SystemExit(code)
