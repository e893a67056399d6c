"""Where the kubelet really listens: its Unix sockets, read from the process (needs hostPID, and to read
another root process's descriptors CAP_SYS_PTRACE).

The kubelet is the process `hami_guard.node.proc` names (the rule all three programs share): of those
bearing a kubelet's name, the one that listens on the kubelet.sock this process sees. Standard library
only.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

from hami_guard.node.netunix import LISTEN, ProcTable, read_proc_net_unix, socket_inodes
from hami_guard.node.proc import (
    KubeletProcesses,
    cmdline,
    comm,
    distribution,
    kubelet_names,
    kubelet_pids,
    kubelet_processes,
    no_kubelet,
    not_listening,
)


class KubeletLookupError(Exception):
    """No kubelet process could be inspected; the path check is skipped, not failed. `ignored` names
    the processes of a kubelet's name that are not the kubelet."""

    def __init__(self, why: str, ignored: tuple[str, ...] = ()) -> None:
        super().__init__(why)
        self.ignored = ignored


@dataclass(frozen=True)
class KubeletSockets:
    pid: int
    paths: tuple[str, ...]
    process: str = "kubelet"  # the process name that holds the kubelet (k3s-server, kubelite, ...)
    distribution: str = "kubelet"  # kubelet, k3s, rke2 or microk8s
    ignored: tuple[str, ...] = ()  # other processes of a kubelet's name: "pid N (name): why"
    proc: str = "/proc"

    def matches(self, path: str) -> bool:
        """True when the kubelet listens on `path`, by name or by inode through /proc/<pid>/root.

        The inode comparison holds where the plugin's container mounts the host folder at
        another path than the kubelet's.
        """
        if os.path.abspath(path) in self.paths:
            return True
        try:
            mine = os.stat(path)
        except OSError:
            return False
        for p in self.paths:
            try:
                theirs = os.stat(f"{self.proc}/{self.pid}/root{p}")
            except OSError:
                continue
            if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
                return True
        return False


def find_kubelet(
    kubelet_path: str, name: str, proc: str = "/proc", found: KubeletProcesses | None = None
) -> tuple[int, KubeletProcesses]:
    """The kubelet's pid, by the rule of `hami_guard.node.proc`: of the processes that bear a kubelet's
    name (the known ones and `name`), the one that listens on `kubelet_path` (`found`, the caller's
    `kubelet_processes`, else asked here). KubeletLookupError when none is visible, or none of them
    listens there."""
    names = kubelet_names(name)
    if found is None:
        if not kubelet_pids(proc, names):
            raise KubeletLookupError(no_kubelet(names))
        found = kubelet_processes(kubelet_path, proc, names)
    if not found.trusted:
        raise KubeletLookupError(not_listening(names), found.ignored)
    return int(found.trusted[0]), found


def listening_paths(
    kubelet_path: str, name: str, proc: str = "/proc", kubelets: KubeletProcesses | None = None
) -> KubeletSockets:
    """Where the kubelet (`find_kubelet`) listens: the listeners among its own socket descriptors
    (`/proc/<pid>/fd`), by the lines of its `/proc/<pid>/net/unix` (its network namespace's, wherever
    this process runs) that the kernel printed as lines (a name bound to print a made-up line there is
    not one: `hami_guard.node.netunix`)."""
    pid, found = find_kubelet(kubelet_path, name, proc, kubelets)
    ignored = found.ignored
    name_ = comm(proc, str(pid))
    if not name_:
        raise KubeletLookupError(f"kubelet pid {pid} exited during the check", ignored)
    held = socket_inodes(proc, str(pid))
    if held is None:
        raise KubeletLookupError(
            f"kubelet pid {pid} is visible but its sockets cannot be read (needs root or CAP_SYS_PTRACE)",
            ignored,
        )
    try:
        table = read_proc_net_unix(os.path.join(proc, str(pid)))
    except OSError as e:
        raise KubeletLookupError(f"kubelet pid {pid} could not be read: {e.strerror or e}", ignored) from None
    paths = listeners(table, held)
    if isinstance(paths, str):
        raise KubeletLookupError(f"kubelet pid {pid}: {paths}", ignored)
    dist = distribution(name_, cmdline(proc, str(pid)))
    return KubeletSockets(pid, paths, name_, dist, ignored, proc)


def listeners(table: ProcTable, held: Collection[int]) -> tuple[str, ...] | str:
    """The paths of the listeners among `held` (a process's socket inodes), or why they cannot be told:
    one of them is only on a line that may be a part of another socket's name (a made-up line may copy
    a real inode, and a short real line may follow such a name)."""
    certain = {s.ino for s in table.sockets}
    if any(s.state == LISTEN and s.ino in held and s.ino not in certain for s in table.doubtful):
        return (
            "a line of its net/unix that may be a part of another socket's name shows one of its listeners: "
            "where it listens cannot be told"
        )
    paths = {s.path for s in table.sockets if s.state == LISTEN and s.ino in held and s.path.startswith("/")}
    return tuple(sorted(paths))
