"""The only repairs hami-doctor makes: removing plugin sockets that nothing listens on.

Never `kubelet.sock`, never the checkpoint; permission fixes on `kubelet.sock` are printed
as commands, not applied. `plan` reads the evidence only: a socket is planned for removal when
the same file (device, inode, modification and change time) refused a connection and is older
than `MIN_AGE` (a plugin re-binding its socket makes a new file). `apply` makes sure again, and
never unlinks a path a plugin may have re-bound in between: it renames the file to a private
name first (atomic: whichever file is at the path then is the one moved), then checks that the
moved file is the judged one and still refuses, and only then removes it; any other file is put
back where it was (link, which never replaces a file that appeared meanwhile).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import replace

from doctor.shell import command
from doctor.types import NodeEvidence, Repair
from hami_guard.node.sockets import try_connect
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME

STALE = "a plugin socket nothing listens on (the plugin died)"
MIN_AGE = 5.0  # seconds: a younger socket may be a plugin's between bind() and listen()


def removal(path: str, identity: tuple[int, int, int, int] | None = None) -> Repair:
    """The repair that removes the socket file at `path`, judged as `identity`."""
    return Repair(path, STALE, command("rm", "--", path), identity=identity)


def plan(e: NodeEvidence) -> list[Repair]:
    """A removal for each old socket file in the folder that refused a connection, but the kubelet's own."""
    names = {os.path.basename(e.kubelet_path), CHECKPOINT_NAME}

    def protected(path: str) -> bool:
        return os.path.basename(path) in names or os.path.abspath(path) == os.path.abspath(e.kubelet_path)

    return [
        removal(s.path, s.identity)
        for s in e.folder_sockets
        if not s.listening and s.identity is not None and s.age >= MIN_AGE and not protected(s.path)
    ]


def apply(repairs: Iterable[Repair]) -> list[Repair]:
    """Each repair carried out, or why not."""
    done = []
    for r in repairs:
        try:
            error = _remove(r)
        except OSError as e:
            error = e.strerror or str(e)
        done.append(replace(r, applied=not error, error=error))
    return done


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return st.st_dev, st.st_ino, -1, -1  # never equal to a judged socket's identity
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def _remove(r: Repair) -> str:
    """ "" when removed, else why not. The path is only ever renamed, never unlinked."""
    if r.identity is None:
        return "skipped: the file was not judged"
    now = _identity(r.path)
    if now is None:
        return "skipped: it is gone already"
    if now != r.identity:
        return "skipped: another file is there now (a plugin re-created it)"
    if try_connect(r.path, timeout=0.2) != errno.ECONNREFUSED:
        return "skipped: it no longer refuses connections"
    folder, name = os.path.split(r.path)
    aside = os.path.join(folder, f".hami-doctor-{os.getpid()}-{name}.removing")
    try:
        os.rename(r.path, aside)  # atomic: what is at the path now is what moves
    except FileNotFoundError:
        return "skipped: it vanished (a plugin is re-creating it)"
    moved = _identity(aside)
    judged = r.identity[:3]  # a rename changes the change time, not the device, inode or mtime
    if moved is not None and moved[:3] == judged and try_connect(aside, timeout=0.2) == errno.ECONNREFUSED:
        os.unlink(aside)  # the private name: nothing else can be there
        return ""
    # Another file was at the path by the time of the rename: put it back, never over a newer one.
    try:
        os.link(aside, r.path)
    except FileExistsError:
        if try_connect(aside, timeout=0.2) == errno.ECONNREFUSED:
            os.unlink(aside)
            return "skipped: a plugin re-created it during the removal"
        return f"skipped: a plugin re-created it during the removal; the socket it moved is at {aside}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return "skipped: a plugin re-created it during the removal (put back)"
