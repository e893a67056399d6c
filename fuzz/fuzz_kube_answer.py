"""Fuzz harness: an API server's answer as sent, inflated and bounded before any parse.

`sidecar.kube.client.bounded` takes any body and any Content-Encoding and returns an `Answer`: the body
inflated within its bound and holding at most its bound of JSON values, or why not; it never raises.
The first byte picks the encoding, and whether the rest is sent as it is or compressed first (so
that the inflater also sees valid streams, and streams that inflate past the bound). Any exception,
or a body past a bound, is a finding (`make fuzz`; seeds in fuzz/corpus/kube_answer/).
"""

from __future__ import annotations

import gzip
import zlib

from sidecar.kube.client import Answer, bounded

ENCODINGS = ("", "identity", "gzip", "deflate", "x-gzip", "br", "gzip, deflate", "DEFLATE")
MAX_BODY = 4096
MAX_VALUES = 64


def _deflate(data: bytes, wbits: int) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return c.compress(data) + c.flush()


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    pick, rest = data[0], data[1:]
    encoding = ENCODINGS[pick % len(ENCODINGS)]
    form = (pick >> 4) % 4
    if form == 1:
        rest = gzip.compress(rest)
    elif form == 2:
        rest = _deflate(rest, zlib.MAX_WBITS)
    elif form == 3:
        rest = _deflate(rest, -zlib.MAX_WBITS)
    answer = bounded(rest, encoding, MAX_BODY, MAX_VALUES)
    assert isinstance(answer, Answer) and answer.status == 200
    assert bool(answer.why) != answer.ok
    if answer.ok:
        assert len(answer.body) <= MAX_BODY
        assert answer.body.count(b",") + answer.body.count(b":") <= MAX_VALUES
    else:
        assert answer.body == b""
