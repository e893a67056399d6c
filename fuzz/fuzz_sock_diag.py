"""The sock_diag reply decoder (hami_guard/node/unixdiag.py): `decode_reply` turns any datagram into a `Reply`
(sockets, done, an error's text, messages skipped), and the sidecar's count of connections over what it
decoded never fails."""

from __future__ import annotations

from hami_guard.node.unixdiag import Connections, decode_reply


def TestOneInput(data: bytes) -> None:
    reply = decode_reply(data)
    assert isinstance(reply.error, str) and reply.skipped >= 0
    assert not (reply.done and reply.error)
    for s in reply.sockets:
        assert isinstance(s.path, str) and s.ino >= 0 and s.peer >= 0
    seen = Connections("fuzz", reply.sockets, exact=True, owned=frozenset(s.peer for s in reply.sockets[:1]))
    assert isinstance(seen.held("/"), int)
