"""The kubelet's device manager checkpoint, `kubelet_internal_checkpoint` (docs/kubelet.md#checkpoint).

Read defensively: whatever is on the node (and whatever the path), the reader returns a `Checkpoint` or
raises `CheckpointError` with a reason an operator can act on, and nothing else (fuzz/fuzz_checkpoint.py).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.deviceplugin.hamiconfig import file_kind

CHECKPOINT_NAME = "kubelet_internal_checkpoint"
# A real checkpoint holds one entry per allocated container: well under 1 MiB on a full node.
MAX_CHECKPOINT_BYTES = 16 * 1024 * 1024


class CheckpointError(Exception):
    """The checkpoint could not be read as the kubelet writes it."""


@dataclass(frozen=True)
class Checkpoint:
    registered: Mapping[str, tuple[str, ...]]  # resource -> healthy device IDs at the last write
    mtime_ns: int

    def devices(self, resource: str) -> tuple[str, ...] | None:
        """The resource's devices, or None when the kubelet does not list the resource at all."""
        return self.registered.get(resource)


def read_checkpoint(path: str, max_bytes: int = MAX_CHECKPOINT_BYTES) -> Checkpoint:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError("no checkpoint: the kubelet has not recorded any device plugin") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError("the checkpoint is a symbolic link, not followed") from None
        raise CheckpointError(f"cannot open the checkpoint: {e.strerror}") from None
    except ValueError as e:  # a path no file can have (a NUL byte)
        raise CheckpointError(f"cannot open the checkpoint: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"the checkpoint is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise CheckpointError(f"the checkpoint is {st.st_size} bytes, over the {max_bytes}-byte bound")
        # The kubelet replaces the file (rename), never writes into it: its size is what there is to
        # read. Asking for the bound instead would have Python allocate 16 MiB for every read.
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(st.st_size + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read the checkpoint: {e.strerror}") from None
    finally:
        os.close(fd)
    return Checkpoint(registered=parse_registered(raw), mtime_ns=st.st_mtime_ns)


def parse_registered(raw: bytes) -> dict[str, tuple[str, ...]]:
    """`RegisteredDevices`: each resource's device IDs (an entry that is not a list of strings, or the
    part of it that is not, is left out); `CheckpointError` for a file that is not the kubelet's JSON."""
    if not raw.strip():
        raise CheckpointError("the checkpoint is empty")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError("the checkpoint is not valid JSON (truncated or corrupt)") from None
    data = doc.get("Data") if isinstance(doc, dict) else None
    if not isinstance(data, dict):
        raise CheckpointError("the checkpoint has no Data object")
    registered = data.get("RegisteredDevices")
    if registered is None:
        return {}
    if not isinstance(registered, dict):
        raise CheckpointError("the checkpoint's RegisteredDevices is not an object")
    return {
        str(resource): tuple(d for d in (ids or ()) if isinstance(d, str))
        for resource, ids in registered.items()
        if ids is None or isinstance(ids, list)
    }
