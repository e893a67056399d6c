"""One bounded GET from the API server: the answer's status and body, or why there is none.

The project's own reader (no client library: the sidecar's measured cost, BENCHMARKS.md#api-client):
aiohttp, which the sidecar already runs, a token re-read on every request (a projected ServiceAccount
token rotates hourly), the CA's or the kubeconfig's trust, a body read up to a bound. Never an
exception: a 401, a 403, no token, a timeout or a refused connection is an `Answer` with its `why`,
which callers take as "no evidence", never as a failure.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
from dataclasses import dataclass

import aiohttp

from sidecar.kube.access import ApiAccess

MAX_TOKEN = 16384


@dataclass(frozen=True)
class Answer:
    """The API server's answer: its status and body; status None when it gave none (`why` says why)."""

    status: int | None
    body: bytes = b""
    why: str = ""

    @property
    def ok(self) -> bool:
        """A 200 with a body read whole."""
        return self.status == 200 and not self.why

    @property
    def denied(self) -> bool:
        """401 or 403: the credentials are missing, expired or not allowed (RBAC)."""
        return self.status in (401, 403)


def _token(access: ApiAccess) -> tuple[str, str]:
    """The bearer token (re-read from its file each time), or "" and why there is none."""
    if access.token:
        return access.token, ""
    if not access.token_file:
        return "", ""  # a client certificate alone (a kubelet's kubeconfig)
    try:
        return access.read_token(MAX_TOKEN), ""
    except OSError as e:
        return "", f"no ServiceAccount token ({access.token_file}: {e.strerror or e})"


def ssl_context(access: ApiAccess) -> ssl.SSLContext:
    """The trust and the client certificate of `access`. Raises OSError, ssl.SSLError or ValueError."""
    if access.ca_data:
        ctx = ssl.create_default_context(cadata=access.ca_data)
    else:
        ca = access.ca_file if access.ca_file and os.path.exists(access.ca_file) else None
        ctx = ssl.create_default_context(cadata=access.read_ca() if ca else None)
    if access.cert_file or access.cert_data:
        if access.cert_data:  # load_cert_chain reads files only: a private folder, removed at once
            with tempfile.TemporaryDirectory(prefix="hami-kube-") as d:
                cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
                for path, data in ((cert, access.cert_data), (key, access.key_data)):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "w") as f:
                        f.write(data)
                ctx.load_cert_chain(cert, key if access.key_data else None)
        else:
            access.check_client_files()
            ctx.load_cert_chain(access.cert_file, access.key_file or None)
    return ctx


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Reader:
    """GETs from one API server over a session kept open (keep-alive: one TLS handshake, not one per GET:
    a quarter of the CPU, BENCHMARKS.md#api-client), the token re-read on every GET, the trust rebuilt
    only when its files change. `close()` when done."""

    def __init__(self, access: ApiAccess) -> None:
        self.access = access
        self._session: aiohttp.ClientSession | None = None
        self._ctx: tuple[object, ssl.SSLContext] | None = None

    def _context(self) -> ssl.SSLContext:
        a = self.access
        key = tuple(_stat(f) if f else None for f in (a.ca_file, a.cert_file, a.key_file))
        if self._ctx is None or self._ctx[0] != key:
            self._ctx = (key, ssl_context(a))
        return self._ctx[1]

    async def get(self, path: str, timeout: float, max_body: int) -> Answer:
        """GET `path` (with its query), its body read up to `max_body` bytes."""
        access = self.access
        token, why = _token(access)
        if why:
            return Answer(None, why=why)
        try:
            ctx = self._context()
        except (OSError, ssl.SSLError, ValueError) as e:
            where = access.ca_file or access.source or "the kubeconfig"
            return Answer(
                None, why=f"the API server's CA or the client certificate cannot be read ({where}: {e})"
            )
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = f"{access.server.rstrip('/')}{path}"
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(
                url,
                headers=headers,
                ssl=ctx,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                if r.status != 200:
                    return Answer(r.status, why=f"the API server answered {r.status}")
                body = await _read_body(r.content, max_body)
        except TimeoutError:
            return Answer(None, why=f"the API server did not answer within {timeout:g}s")
        except (aiohttp.ClientError, OSError, ValueError, ssl.SSLError) as e:
            return Answer(None, why=f"the API server cannot be asked: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            raise
        if len(body) > max_body:
            return Answer(200, why=f"the answer exceeds {max_body} bytes (not read)")
        return Answer(200, body)

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_body(content: aiohttp.StreamReader, max_body: int) -> bytes:
    """The whole body, or its first `max_body` + 1 bytes: one `read(n)` returns what has arrived so far
    (the first chunk of a chunked answer: a Node of 5 KB came back short 26 times in 40)."""
    body = bytearray()
    while len(body) <= max_body:
        chunk = await content.read(max_body + 1 - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


async def get(access: ApiAccess, path: str, timeout: float, max_body: int) -> Answer:
    """One GET with a session of its own (a reader that asks rarely: the ResourceSlices, hami-doctor)."""
    reader = Reader(access)
    try:
        return await reader.get(path, timeout, max_body)
    finally:
        await reader.close()
