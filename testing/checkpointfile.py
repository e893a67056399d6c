"""Writes a kubelet checkpoint, for the simulator: production code only reads it.

Never point this at a real kubelet's folder: the kubelet verifies a Go-specific checksum
and would reject the file as corrupt (docs/kubelet.md#checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from typing import Any


def write_checkpoint(
    path: str,
    registered: Mapping[str, Iterable[str]],
    pod_entries: list[dict[str, Any]] | None = None,
) -> None:
    """Write the checkpoint as the kubelet does: a `.`-prefixed temporary file, fsync, rename."""
    data = {
        "PodDeviceEntries": pod_entries,
        "RegisteredDevices": {r: list(ids) for r, ids in registered.items()},
    }
    # The real checksum is a Go-specific hash of the Go struct; nothing verifies it.
    body = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    doc = {"Data": data, "Checksum": zlib.crc32(body)}
    fd, tmp = tempfile.mkstemp(prefix=".", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(doc, separators=(",", ":")).encode())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
