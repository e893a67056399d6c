"""A Unix socket the simulator owns, forwarding bytes to a gRPC server on a private socket.

grpcio binds and unlinks its own sockets. The simulator needs what a real
process does to its socket file: keep it as a dead file when it dies (same
inode, connections refused), or accept connections and never answer a frame
(a hung process). Owning the listening socket and forwarding bytes gives both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from typing import Any

from sidecar.tasks import TaskSet


class SocketFront:
    """Listens on `path` as a Go server does (`net.Listen("unix")`): bind(2), then listen(2) `listen_delay`
    later (the file exists, and its creation event fires, before anything listens: connections to it
    are refused meanwhile); and, when it stops, unlinks the file before it closes the socket
    (`UnixListener.Close`: remove, then close)."""

    def __init__(self, path: str, backend: str, listen_delay: float = 0.0) -> None:
        self.path = path
        self.backend = backend
        self.listen_delay = listen_delay
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._tasks = TaskSet()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def hung(self) -> bool:
        return not self._flowing.is_set()

    @hung.setter
    def hung(self, value: bool) -> None:
        """Hung: connections are accepted, nothing is read from them or answered."""
        if value:
            self._flowing.clear()
        else:
            self._flowing.set()

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            if self.listen_delay:
                await asyncio.sleep(self.listen_delay)
            sock.listen(128)
        except (OSError, asyncio.CancelledError):
            sock.close()
            raise
        extra: dict[str, Any] = {"cleanup_socket": False} if sys.version_info >= (3, 13) else {}
        self._server = await asyncio.start_unix_server(self._accept, sock=sock, **extra)

    async def close(self, unlink: bool) -> None:
        """Stop listening: the file unlinked first, as Go's listener does; without unlink it stays behind,
        refusing connections (a process that died)."""
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        await self._tasks.cancel()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.spawn(self._serve(reader, writer))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._flowing.wait()
            b_reader, b_writer = await asyncio.open_unix_connection(self.backend)
            self._writers.add(b_writer)
            pumps = [
                asyncio.ensure_future(self._pump(reader, b_writer)),
                asyncio.ensure_future(self._pump(b_reader, writer)),
            ]
            try:
                # Either side closing ends the connection, as a process closing its socket does.
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                self._writers.discard(b_writer)
                b_writer.close()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
