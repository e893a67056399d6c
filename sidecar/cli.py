"""hami-sidecar's command line: settings, logging, the HTTP server and a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence

from sidecar.app import Sidecar
from sidecar.config import Settings, parse_settings
from sidecar.http import build_app
from sidecar.serving import BoundedServer

logger = logging.getLogger("sidecar")


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

    HTTP is served within sidecar/serving.py's bounds (connections, descriptors, deadlines) and is
    closed first on the way out, so that no client can hold the exit.
    """
    sidecar = sidecar or Sidecar(settings)
    http = BoundedServer(build_app(sidecar), settings.host, settings.port)
    try:
        await http.start()
        await sidecar.start()
        logger.info("serving /healthz /readyz /status /metrics on %s:%d", settings.host, settings.port)
        await stop.wait()
    finally:
        await http.close()
        await sidecar.stop()
    return sidecar


async def _main(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)
    logger.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    setup_logging(settings.log_format, settings.log_level)
    try:
        asyncio.run(_main(settings))
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", settings.host, settings.port, e.strerror)
        return 1
    return 0


def run() -> None:
    """Console-script entry point."""
    raise SystemExit(main())
