"""Where the kubelet really listens: its Unix sockets, read from the process (needs hostPID, and to read
another root process's descriptors CAP_SYS_PTRACE)."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

import psutil

from hami_guard.node.netunix import LISTEN, ProcTable, read_proc_net_unix, socket_inodes
from hami_guard.node.proc import distribution, no_kubelet, process_names


class KubeletLookupError(Exception):
    """No kubelet process could be inspected; the path check is skipped, not failed."""


@dataclass(frozen=True)
class KubeletSockets:
    pid: int
    paths: tuple[str, ...]
    process: str = "kubelet"  # the process name that holds the kubelet (k3s-server, kubelite, ...)
    distribution: str = "kubelet"  # kubelet, k3s, rke2 or microk8s

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
                theirs = os.stat(f"/proc/{self.pid}/root{p}")
            except OSError:
                continue
            if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
                return True
        return False


def find_kubelet(name: str) -> psutil.Process:
    """The kubelet's process: `kubelet` first, then the processes that embed it (k3s, microk8s)."""
    names = process_names(name)
    found: dict[str, psutil.Process] = {}
    try:
        for proc in psutil.process_iter(["name"]):
            pname = proc.info["name"]
            if pname in names and pname not in found:
                found[pname] = proc
    except psutil.Error as e:
        raise KubeletLookupError(f"the process table could not be read: {e}") from None
    for n in names:
        if n in found:
            return found[n]
    raise KubeletLookupError(no_kubelet(name))


def listening_paths(name: str) -> KubeletSockets:
    """Where the kubelet listens: the listeners among its own socket descriptors (`/proc/<pid>/fd`), by
    the lines of its `/proc/<pid>/net/unix` (its network namespace's, wherever this process runs) that
    the kernel printed as lines (a name bound to print a made-up line there is not one:
    `hami_guard.node.netunix`)."""
    proc = find_kubelet(name)
    try:
        comm = proc.name()
        try:
            cmdline = proc.cmdline()
        except psutil.AccessDenied:
            cmdline = []
    except psutil.NoSuchProcess:
        raise KubeletLookupError(f"kubelet pid {proc.pid} exited during the check") from None
    except (psutil.Error, OSError) as e:
        raise KubeletLookupError(f"kubelet pid {proc.pid} could not be read: {e}") from None
    held = socket_inodes("/proc", str(proc.pid))
    if held is None:
        raise KubeletLookupError(
            f"kubelet pid {proc.pid} is visible but its sockets cannot be read (needs root or CAP_SYS_PTRACE)"
        )
    try:
        table = read_proc_net_unix(f"/proc/{proc.pid}")
    except OSError as e:
        raise KubeletLookupError(f"kubelet pid {proc.pid} could not be read: {e.strerror or e}") from None
    paths = listeners(table, held)
    if isinstance(paths, str):
        raise KubeletLookupError(f"kubelet pid {proc.pid}: {paths}")
    return KubeletSockets(proc.pid, paths, comm, distribution(comm, cmdline))


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
