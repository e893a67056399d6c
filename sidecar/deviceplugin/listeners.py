"""A plugin socket's listener: found by the file it bound, then asked for by its own inode.

The kernel keeps a socket's bound file identity after the file is unlinked (UNIX_DIAG_VFS), so a
listener found while the file was there can be asked for after it is gone: whether the plugin still
serves a socket someone else removed (docs/design.md#rule-families, S4).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass

from hami_guard.node.netunix import LISTEN, normalise
from hami_guard.node.unixdiag import DiagUnavailable, diag_dump, diag_one
from sidecar.deviceplugin.probes import SocketId


@dataclass(frozen=True)
class PluginListener:
    """A plugin socket's listener: the file it bound (st_dev, st_ino) and its own socket inode."""

    bound: tuple[int, int]
    # None: not found (yet): a Go server binds its file before it listens, and a lookup between the two
    # finds no listener; the next round, and a verdict that rests on it, ask again.
    ino: int | None
    # The socket file as the probes know it (inode and mtime): a file re-created at once may be given the
    # inode number of the one before it, so the number alone does not tell a new file from the old.
    identity: SocketId | None = None


def listener_of(bound: tuple[int, int], names: Collection[str]) -> int | None:
    """The socket inode of the listener bound to the file `bound` in this network namespace (the pod's,
    which the plugin shares), or None (none, or it cannot be told: `find_listener` tells them apart)."""
    found = find_listener(bound, names)
    return None if found is None or found is False else found


def find_listener(bound: tuple[int, int], names: Collection[str]) -> int | bool | None:
    """The listener bound to the file `bound` in this network namespace: its socket inode; False when
    the kernel lists none; None when it cannot be asked. A listener bound to that file under another
    name than `names` (the plugin socket's paths as bound) is none: a file's inode number is free for
    another file the moment the listener that held it closes, and the next socket bound anywhere on that
    filesystem may carry it."""
    try:
        found = diag_dump({bound})
    except DiagUnavailable:
        return None
    wanted = {normalise(n) for n in names}
    for u in found:
        if u.state == LISTEN and u.vfs == bound and u.path in wanted:
            return u.ino
    return False


def still_listening(listener: PluginListener | None, names: Collection[str]) -> bool | None:
    """Is this listener still open? The kernel keeps a socket's bound file identity after the file is
    unlinked (UNIX_DIAG_VFS). Asked by the socket's own inode, never by the file's: a file's inode number
    is free for another file the moment the listener closes (ext4 hands it out again at once), and the
    next socket bound to that file would pass for this one. A listener never found (a lookup between its
    bind and its listen) is looked up again now by its file, under the plugin's own names. None: it
    cannot be told."""
    if listener is None:
        return None
    if listener.ino is not None:
        try:
            found = diag_one(listener.ino)
        except DiagUnavailable:
            return None
        if found is not None and found.state == LISTEN and found.vfs == listener.bound:
            return True
    # Never found, or closed: a plugin that re-served its file at once may have been given the same
    # inode number, and its new listener then holds the file that was removed.
    again = find_listener(listener.bound, names)
    return None if again is None else again is not False


def file_id(path: str) -> tuple[int, int] | None:
    """The file at `path` as (st_dev, st_ino), or None where there is none; never through a symbolic
    link (a link to another plugin's socket is not this plugin's)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if stat.S_ISLNK(st.st_mode) else (st.st_dev, st.st_ino)
