"""A process table of a test's own: pid 1, the test's process and the processes it started.

hami-initcheck, hami-doctor and hami-sidecar look for the kubelet among the processes of a kubelet's
name, and name the others as ignored; a test that reads the machine's process table would see whatever
else runs there (k3s or kind on a contributor's laptop, another test's stand-in). A test gives them
this one instead, which holds only its own processes:

- in the test's process, `own_proc()`: a folder of links to `/proc/<pid>` of those processes (and to
  every other entry of `/proc`, `self` included), for the `proc=` parameters of the code;
- for a program the test starts, `isolated(argv)`: the same folder mounted over `/proc` in a mount
  namespace of the program's own (`unshare --mount`), the machine's `/proc` under it. That needs root
  (CAP_SYS_ADMIN); where it cannot be had, the program reads the machine's table.

The processes are taken when the table is made: make it after the test's stand-ins have started.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Collection, Iterator, Sequence

# In the program's mount namespace: the machine's /proc under the table, then the table over /proc.
MOUNT = 'm="$1"; "$m" --rbind /proc "$2" && "$m" --bind "$3" /proc && shift 3 && exec "$@"'


def own_pids(extra: Collection[int] = (), exclude: Collection[int] = ()) -> set[int]:
    """pid 1 (the host's, where the code looks as under hostPID), this process, every process it
    started (children and theirs, whatever namespaces they entered) and `extra`, but `exclude`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone since the listing
        children.setdefault(ppid, []).append(int(entry))
    found = {1, os.getpid(), *extra}
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found - set(exclude)


def make_table(into: str, target: str, extra: Collection[int] = (), exclude: Collection[int] = ()) -> str:
    """A folder `into` that holds, as links into `target` (where the machine's /proc is), every entry of
    /proc but the processes `own_pids` leaves out."""
    os.mkdir(into)
    pids = {str(p) for p in own_pids(extra, exclude)}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry not in pids:
            continue
        os.symlink(os.path.join(target, entry), os.path.join(into, entry))
    return into


@contextlib.contextmanager
def own_proc(extra: Collection[int] = ()) -> Iterator[str]:
    """A process table of this test's own, for a `proc=` parameter; removed afterwards."""
    folder = tempfile.mkdtemp(prefix="hg-proc-")
    try:
        yield make_table(os.path.join(folder, "proc"), "/proc", extra)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def _tools() -> tuple[str, str, str] | None:
    """unshare, sh and mount, where a mount namespace of a program's own can be made here; else None."""
    found = (shutil.which("unshare"), shutil.which("sh"), shutil.which("mount"))
    if os.geteuid() != 0 or None in found:
        return None
    unshare, sh, mount = found
    assert unshare is not None and sh is not None and mount is not None
    with tempfile.TemporaryDirectory(prefix="hg-proc-") as d:
        table = make_table(os.path.join(d, "proc"), os.path.join(d, "host"))
        os.mkdir(os.path.join(d, "host"))
        probe = [unshare, "--mount", "--propagation", "private", "--", sh, "-c", MOUNT, "sh"]
        probe += [mount, os.path.join(d, "host"), table, "test", "-e", "/proc/self/status"]
        if subprocess.run(probe, capture_output=True, check=False, timeout=30).returncode != 0:
            return None
    return unshare, sh, mount


def can_isolate() -> bool:
    """Can `isolated` give a program a process table of its own here?"""
    return _tools() is not None


def isolated(
    argv: Sequence[str], into: str, extra: Collection[int] = (), exclude: Collection[int] = ()
) -> list[str]:
    """`argv` run with a process table of this test's own over /proc (in a new folder `into`), or `argv`
    itself where that cannot be had (see `can_isolate`)."""
    tools = _tools()
    if tools is None:
        return list(argv)
    unshare, sh, mount = tools
    os.mkdir(into)
    host = os.path.join(into, "host")
    os.mkdir(host)
    table = make_table(os.path.join(into, "proc"), host, extra, exclude)
    return [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "--",
        sh,
        "-c",
        MOUNT,
        "sh",
        mount,
        host,
        table,
        *argv,
    ]
