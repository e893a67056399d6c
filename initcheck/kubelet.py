"""Where the kubelet really listens: its Unix sockets, read from the process (needs hostPID)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from initcheck.proc import distribution, no_kubelet, process_names


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
    proc = find_kubelet(name)
    try:
        conns = proc.net_connections(kind="unix")
        comm = proc.name()
        try:
            cmdline = proc.cmdline()
        except psutil.AccessDenied:
            cmdline = []
    except psutil.AccessDenied:
        raise KubeletLookupError(
            f"kubelet pid {proc.pid} is visible but its sockets cannot be read (needs root or CAP_SYS_PTRACE)"
        ) from None
    except psutil.NoSuchProcess:
        raise KubeletLookupError(f"kubelet pid {proc.pid} exited during the check") from None
    except (psutil.Error, OSError) as e:
        raise KubeletLookupError(f"kubelet pid {proc.pid} could not be read: {e}") from None
    paths: set[str] = set()
    for conn in conns:
        laddr: object = conn.laddr  # a Unix socket's address is its path (str)
        if isinstance(laddr, str) and laddr.startswith("/"):
            paths.add(laddr)
    paths |= namespace_unix_paths(proc.pid)
    return KubeletSockets(proc.pid, tuple(sorted(paths)), comm, distribution(comm, cmdline))


def namespace_unix_paths(pid: int, proc: str = "/proc") -> set[str]:
    """The paths of the Unix sockets `pid` holds, from the table of its own network namespace.

    psutil matches the process's socket inodes against /proc/net/unix, the table of the reader's
    network namespace; a plugin's pod without hostNetwork (HAMi's) has another one, where the
    kubelet's sockets are not listed. /proc/<pid>/net/unix is the kubelet's. Total: anything
    unreadable or malformed adds nothing.
    """
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(target[8:-1])
    if not inodes:
        return set()
    try:
        with open(f"{proc}/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 24).splitlines()
    except OSError:
        return set()
    paths: set[str] = set()
    for line in lines[1:]:
        # Num RefCount Protocol Flags Type St Inode Path (the path, when bound, is the rest of the line)
        parts = line.split(None, 7)
        if len(parts) == 8 and parts[6] in inodes and parts[7].startswith("/"):
            paths.add(parts[7])
    return paths
