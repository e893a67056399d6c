"""The `/proc/<pid>/net/unix` parser (hami_guard/node/netunix.py): `parse_proc_net_unix` turns any bytes into
a `ProcTable` (sockets, doubtful lines, lines skipped), with and without a filter of paths, and the
sidecar's count of the kubelet's connections over it never fails."""

from __future__ import annotations

from hami_guard.node.netunix import parse_proc_net_unix
from hami_guard.node.unixdiag import Connections

PATHS = (
    "/var/lib/kubelet/device-plugins/kubelet.sock",
    "/var/lib/kubelet/device-plugins/nvidia-gpu.sock",
    "/tmp/hg-abcdefgh/device-plugins/nvidia-gpu.sock",
)


def TestOneInput(data: bytes) -> None:
    lines = data.splitlines(keepends=True)
    table = parse_proc_net_unix(lines)
    assert table.skipped >= 0 and len(table.sockets) + len(table.doubtful) + table.skipped <= len(lines)
    kept = parse_proc_net_unix(lines, PATHS)
    assert set(kept.sockets) <= set(table.sockets) and set(kept.doubtful) <= set(table.doubtful)
    seen = Connections("fuzz", table.sockets, exact=False, doubtful=table.doubtful)
    for path in PATHS:
        held = seen.held(path)
        assert isinstance(held, str) or held >= 0
