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

from sidecar.deviceplugin.hostdevices import file_kind

CHECKPOINT_NAME = "kubelet_internal_checkpoint"
# Bounds on what a kubelet's checkpoint can be, generous for the largest node HAMi serves:
# 256 GPUs split 100 ways register 25,600 device IDs (`GPU-<uuid>-<n>`, ~50 bytes each in JSON), and
# allocating all of them lists each once more in PodDeviceEntries; those entries are one per container
# that got devices: at most 1,024 (four times the 250-pod maximum nodes are tuned to, each with
# devices), each with a base64 AllocateResponse of at most 4 KiB (HAMi's envs and mounts for
# 8 GPUs are ~1.5 KiB). 2 x 25,600 x 50 B + 1,024 x (4 KiB + 200 B of names) = 6.7 MiB: 8 MiB
# bounds the bytes. The same node holds ~62,000 values, counted as commas and colons (an array item
# costs one, an object member, dearer to parse, two): 131,072 bounds them. Parse cost goes with
# values, not bytes: within the bounds the worst case parses in tens of milliseconds
# (bench/checkpoint_parse.py), where 1e6 empty keys in 12 MiB took seconds and 200+ MiB, holding
# the GIL, in a sidecar whose manifests cap its memory at 128 MiB.
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024
MAX_CHECKPOINT_VALUES = 131_072
# One resource per device plugin (and a few per DRA-less vendor): a node has tens, not thousands.
MAX_CHECKPOINT_RESOURCES = 1024


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
            raise CheckpointError(
                f"the checkpoint is {st.st_size} bytes, over the {max_bytes}-byte bound: "
                "too large to be a kubelet's"
            )
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
    if len(raw) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"the checkpoint is {len(raw)} bytes, over the {MAX_CHECKPOINT_BYTES}-byte bound: "
            "too large to be a kubelet's"
        )
    if raw.count(b",") + raw.count(b":") >= MAX_CHECKPOINT_VALUES:  # C loops: no parse to pay for
        raise CheckpointError(
            f"the checkpoint holds over {MAX_CHECKPOINT_VALUES} values: too large to be a kubelet's"
        )
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
    if len(registered) > MAX_CHECKPOINT_RESOURCES:
        raise CheckpointError(
            f"the checkpoint registers {len(registered)} resources, over {MAX_CHECKPOINT_RESOURCES}: "
            "too large to be a kubelet's"
        )
    return {
        str(resource): tuple(d for d in (ids or ()) if isinstance(d, str))
        for resource, ids in registered.items()
        if ids is None or isinstance(ids, list)
    }
