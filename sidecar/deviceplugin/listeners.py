"""A plugin socket's listener: found by the file it bound, then asked for by its own inode.

The kernel keeps a socket's bound file identity after the file is unlinked (UNIX_DIAG_VFS), so a
listener found while the file was there can be asked for after it is gone: whether the plugin still
serves a socket someone else removed (docs/design.md#rule-families, S4).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

from hami_guard.node.netunix import LISTEN, normalise
from hami_guard.node.unixdiag import DiagUnavailable, diag_dump, diag_one


@dataclass(frozen=True)
class PluginListener:
    """A plugin socket's listener: the file it bound (st_dev, st_ino) and its own socket inode."""

    bound: tuple[int, int]
    # None: not found (yet): a Go server binds its file before it listens, and a lookup between the two
    # finds no listener; the next round, and a verdict that rests on it, ask again.
    ino: int | None


def listener_of(bound: tuple[int, int], names: Collection[str] = ()) -> int | None:
    """The socket inode of the listener bound to the file `bound` in this network namespace (the pod's,
    which the plugin shares), or None (none, or it cannot be told: `find_listener` tells them apart)."""
    found = find_listener(bound, names)
    return None if found is None or found is False else found


def find_listener(bound: tuple[int, int], names: Collection[str] = ()) -> int | bool | None:
    """The listener bound to the file `bound` in this network namespace: its socket inode; False when
    the kernel lists none; None when it cannot be asked. With `names` (the plugin socket's paths as
    bound), a listener bound to that file under another name is none: a file's inode number is free for
    another file the moment the listener that held it closes, and the next socket bound anywhere on that
    filesystem may carry it."""
    try:
        found = diag_dump({bound})
    except DiagUnavailable:
        return None
    wanted = {normalise(n) for n in names}
    for u in found:
        if u.state == LISTEN and u.vfs == bound and (not wanted or u.path in wanted):
            return u.ino
    return False


def still_listening(listener: PluginListener | None, names: Collection[str] = ()) -> bool | None:
    """Is this listener still open? The kernel keeps a socket's bound file identity after the file is
    unlinked (UNIX_DIAG_VFS). Asked by the socket's own inode, never by the file's: a file's inode number
    is free for another file the moment the listener closes (ext4 hands it out again at once), and the
    next socket bound to that file would pass for this one. A listener never found (a lookup between its
    bind and its listen) is looked up again now by its file, under the plugin's own names. None: it
    cannot be told."""
    if listener is None:
        return None
    if listener.ino is None:
        again = find_listener(listener.bound, names)
        return None if again is None else again is not False
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
