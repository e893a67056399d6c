"""The DRA drivers' evidence: the sidecar's DRA evidence of one moment, and the kubelet's DRA log lines.

The same code as the sidecar's (`sidecar.dra.watch`), one round of it, judged with no grace: a
snapshot, so "not registered" may be a registration under way (the rules' fix says to look again).
The kubelet's log is read as --kubelet-log names it, scanned for the catalogue's DRA lines only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from doctor.logscan import kubelet_logs, scan
from doctor.patterns import DRA_PATTERNS
from doctor.types import DraReading, LogFindings
from hami_guard.node.unixdiag import KUBELET_PROCESS_NAMES
from sidecar.dra.slices import ApiAccess
from sidecar.dra.spec import DraSpec
from sidecar.dra.watch import DraWatch


async def gather_dra(
    specs: Sequence[DraSpec],
    kubelet_socket: str,
    timeout: float,
    names: frozenset[str] | None = None,
    *,
    api: ApiAccess | None = None,
    node: str = "",
) -> list[DraReading]:
    """One round of the sidecar's DRA evidence, judged with no grace (a snapshot); the node's
    ResourceSlices too when `api` is given."""
    watch = DraWatch(
        specs,
        kubelet_socket,
        grace=0.0,
        timeout=timeout,
        names=names or KUBELET_PROCESS_NAMES,
        api=api,
        node=node,
    )
    try:
        found = await watch.round()
    finally:
        watch.close()  # a DRA service call still in flight is not waited for
    return [DraReading(s, *found[s.name]) for s in specs]


def dra_kubelet_logs(where: str, since: float) -> list[LogFindings]:
    """The kubelet's log (as hami-doctor's --kubelet-log reads it), scanned for the DRA lines only."""
    return kubelet_logs(where, since, DRA_PATTERNS)


def scan_dra_log(data: bytes, source: str, since: float | None = None) -> LogFindings:
    """The DRA lines of a log's bytes, as of now."""
    return scan(data, DRA_PATTERNS, source, since, time.time())
