"""One bounded GET from the API server: the answer's status and body, or why there is none.

The project's own reader (no client library: the sidecar's measured cost, BENCHMARKS.md#api-client):
aiohttp, which the sidecar already runs, a token re-read on every request (a projected ServiceAccount
token rotates hourly), the CA's or the kubeconfig's trust, a body read up to a bound. Never an
exception: a 401, a 403, no token, a timeout or a refused connection is an `Answer` with its `why`,
which callers take as "no evidence", never as a failure.

What an answer costs is bounded before it is parsed, and paid off the event loop, where `/healthz` is
answered: the body as sent (gzip or deflate, which the API server uses past 128 KiB) is read up to
its bound, then inflated on a worker thread up to the same bound (zlib lets go of the GIL), and
its JSON values counted (commas and colons: a cheap count that is never below the values);
`off_loop` runs the caller's parse on that thread too, one answer at a time. A parse in C holds the
GIL still, so the count bounds what it holds: about 12 ms for 65,536 values at worst
(BENCHMARKS.md#api-answers).
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import aiohttp

from sidecar.kube.access import ApiAccess

MAX_TOKEN = 16384
# JSON values an answer may hold (commas and colons counted), unless the caller says otherwise. A Node
# holds a few thousand (50 images, its managedFields, HAMi's annotation); its parse costs about 0.1 ms
# per thousand, 12 ms at this bound with 4 MiB of escaped strings.
MAX_VALUES = 65536
# The encodings asked for and inflated here (aiohttp's own inflating happens on the event loop).
ENCODINGS = "gzip, deflate"

_P = ParamSpec("_P")
_T = TypeVar("_T")
# One worker: one answer inflated or parsed at a time, whatever asks (the Node, the ResourceSlices).
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-kube-decode")


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

    async def get(self, path: str, timeout: float, max_body: int, max_values: int = MAX_VALUES) -> Answer:
        """GET `path` (with its query), its body read and inflated up to `max_body` bytes, holding at most
        `max_values` JSON values."""
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
        headers = {"Accept": "application/json", "Accept-Encoding": ENCODINGS}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = f"{access.server.rstrip('/')}{path}"
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(auto_decompress=False)
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
                encoding = r.headers.get(aiohttp.hdrs.CONTENT_ENCODING, "")
                body = await _read_body(r.content, max_body)
        except TimeoutError:
            return Answer(None, why=f"the API server did not answer within {timeout:g}s")
        except (aiohttp.ClientError, OSError, ValueError, ssl.SSLError) as e:
            return Answer(None, why=f"the API server cannot be asked: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            raise
        if len(body) > max_body:
            return Answer(200, why=f"the answer exceeds {max_body} bytes (not read)")
        return await off_loop(bounded, body, encoding, max_body, max_values)

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_body(content: aiohttp.StreamReader, max_body: int) -> bytes:
    """The whole body, or its first `max_body` + 1 bytes: one `read(n)` returns what has arrived so far
    (the first chunk of a chunked answer: a Node of 5 KB came back short 26 times in 40). Joined once
    at the end: one copy of a large body, not a buffer grown and copied again."""
    chunks: list[bytes] = []
    size = 0
    while size <= max_body:
        chunk = await content.read(max_body + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)  # one chunk: that chunk itself


async def off_loop(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`fn(*args)` on the worker thread, one at a time: what an answer's inflating and parsing cost
    is not paid on the event loop."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_worker, call)


def bounded(body: bytes, encoding: str, max_body: int, max_values: int) -> Answer:
    """A 200's body as sent (`encoding`, its Content-Encoding), inflated to at most `max_body` bytes and
    holding at most `max_values` JSON values (commas and colons counted); or why not."""
    inflated = inflate(body, encoding, max_body)
    if isinstance(inflated, str):
        return Answer(200, why=inflated)
    values = inflated.count(b",") + inflated.count(b":")
    if values > max_values:
        return Answer(200, why=f"the answer holds over {max_values} JSON values ({values}): not parsed")
    return Answer(200, inflated)


def inflate(body: bytes, encoding: str, max_body: int) -> bytes | str:
    """`body` decoded from its Content-Encoding (none, gzip or deflate, zlib's or raw, as aiohttp takes
    them) to at most `max_body` bytes; or why not."""
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        return body if len(body) <= max_body else f"the answer exceeds {max_body} bytes (not read)"
    if coding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif coding == "deflate":  # zlib's format, or (as some servers send) raw deflate
        zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        return f"the answer's encoding {encoding[:40]!r} was not asked for (not read)"
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, max_body + 1)
    except zlib.error as e:
        return f"the answer does not inflate ({coding}: {e})"
    if len(out) > max_body or inflater.unconsumed_tail:
        return f"the answer inflates past {max_body} bytes (not read)"
    if not inflater.eof:
        return f"the answer's {coding} stream is cut short (not read)"
    return out


async def get(
    access: ApiAccess, path: str, timeout: float, max_body: int, max_values: int = MAX_VALUES
) -> Answer:
    """One GET with a session of its own (a reader that asks rarely: the ResourceSlices, hami-doctor)."""
    reader = Reader(access)
    try:
        return await reader.get(path, timeout, max_body, max_values)
    finally:
        await reader.close()
