"""A plugin socket's listener: found by the file it bound, then asked for by its own inode.

The kernel keeps a socket's bound file identity after the file is unlinked (UNIX_DIAG_VFS), so a
listener found while the file was there can be asked for after it is gone: whether the plugin still
serves a socket someone else removed (docs/design.md#rule-families, S4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hami_guard.node.netunix import LISTEN
from hami_guard.node.unixdiag import DiagUnavailable, diag_dump, diag_one


@dataclass(frozen=True)
class PluginListener:
    """A plugin socket's listener: the file it bound (st_dev, st_ino) and its own socket inode."""

    bound: tuple[int, int]
    ino: int | None  # None: no listener bound to that file in this network namespace


def listener_of(bound: tuple[int, int]) -> int | None:
    """The socket inode of the listener bound to the file `bound` in this network namespace (the pod's,
    which the plugin shares), or None."""
    try:
        found = diag_dump({bound})
    except DiagUnavailable:
        return None
    return next((u.ino for u in found if u.state == LISTEN and u.vfs == bound), None)


def still_listening(listener: PluginListener | None) -> bool | None:
    """Is this listener still open? The kernel keeps a socket's bound file identity after the file is
    unlinked (UNIX_DIAG_VFS). Asked by the socket's own inode, never by the file's: a file's inode number
    is free for another file the moment the listener closes (ext4 hands it out again at once), and the
    next socket bound to that file would pass for this one. None: unknown."""
    if listener is None or listener.ino is None:
        return None
    try:
        found = diag_one(listener.ino)
    except DiagUnavailable:
        return None
    return found is not None and found.state == LISTEN and found.vfs == listener.bound


def file_id(path: str) -> tuple[int, int] | None:
    """The file at `path` as (st_dev, st_ino), or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
