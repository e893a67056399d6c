"""Which process is the kubelet: one rule for hami-initcheck, hami-sidecar and hami-doctor.

Among the visible processes that bear a kubelet's name (`KUBELET_PROCESS_NAMES` and the configured
name), run by root outside any pod's cgroup, the kubelet is the one that listens on the kubelet.sock
this process sees: the kernel names it (`listener_pid`, SO_PEERCRED). The others are ignored, each
with why: anyone may name a process `kubelet` (a CI runner's kind, a virtual-kubelet-style tool, a
container under `hostPID`), and none of them is the kubelet the plugin registers with. With none that
listens there, no kubelet is known, as when none is visible.

The kubelet is not always a process of its own: k3s runs it inside the `k3s` process
(`k3s-server` or `k3s-agent`), microk8s inside `kubelite`; RKE2 starts the real `kubelet`
binary from its own data folder.

Standard library only, and cheap: initcheck runs this at every plugin start on every node.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Collection
from typing import NamedTuple

DEFAULT_NAME = "kubelet"
# The names of the processes that run a kubelet: its own, and those that embed it (k3s, microk8s).
KUBELET_PROCESS_NAMES = frozenset({"kubelet", "k3s-server", "k3s-agent", "k3s", "kubelite"})
COMM_LENGTH = 15  # the kernel keeps 15 characters of a process name


def kubelet_names(name: str = DEFAULT_NAME) -> frozenset[str]:
    """The names a kubelet's process may bear: the known ones and the configured `name`."""
    return KUBELET_PROCESS_NAMES | {name}


def shown(names: Collection[str]) -> str:
    """The names as a sentence says them: "kubelet, k3s or kubelite"."""
    ordered = sorted(names, key=lambda n: (n != DEFAULT_NAME, n))
    return ordered[0] if len(ordered) == 1 else f"{', '.join(ordered[:-1])} or {ordered[-1]}"


def no_kubelet(names: Collection[str]) -> str:
    """Why no kubelet's process is known: none of these names is visible."""
    return (
        f"no process named {shown(names)} is visible, so where the kubelet listens was not checked "
        "(the pod needs hostPID: true; HAMi's DaemonSet has it)"
    )


def not_listening(names: Collection[str]) -> str:
    """Why no kubelet's process is known: those visible do not listen on kubelet.sock."""
    return (
        f"no process named {shown(names)} listens on kubelet.sock as this pod sees it, so where the "
        "kubelet listens was not checked"
    )


def distribution(comm: str, cmdline: list[str]) -> str:
    """Which Kubernetes distribution runs this kubelet process: kubelet, k3s, rke2 or microk8s."""
    if comm.startswith("k3s"):
        return "k3s"
    if comm == "kubelite":
        return "microk8s"
    if any("/rancher/rke2/" in part for part in cmdline[:1]):
        return "rke2"
    return "kubelet"


_PEERCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def listener_pid(path: str, timeout: float = 0.2) -> int | str:
    """The process that listens on the socket file at `path` (its pid in this reader's pid namespace,
    0 where it is not visible there), or why it cannot be told.

    The kernel's word, for any user: a connection's SO_PEERCRED on the connecting side is the
    process that called listen() (man 7 unix). The connection is closed at once, unused.
    """
    name = os.path.basename(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        except (TimeoutError, BlockingIOError):
            return f"{name} accepts no connection now (its backlog is full): who listens cannot be told"
        except OSError as e:
            return f"{name} refuses a connection ({e.strerror or e}): nothing listens on it"
    pid: int = _PEERCRED.unpack(raw)[0]
    return pid


class KubeletProcesses(NamedTuple):
    """The visible processes that bear a kubelet's name and run as root outside any pod: the one that
    listens on the kubelet.sock this process sees, and the others, ignored, with why."""

    trusted: tuple[str, ...] = ()  # the kubelet: at most one pid
    ignored: tuple[str, ...] = ()  # "pid N (name): why"
    listener: int | str = 0  # the pid that listens on kubelet.sock (0: not visible), or why not known


def kubelet_processes(
    kubelet_path: str,
    proc: str = "/proc",
    names: Collection[str] = KUBELET_PROCESS_NAMES,
) -> KubeletProcesses:
    """The kubelet's process: of the processes `kubelet_pids` finds, the one that listens on the
    socket file at `kubelet_path` (`listener_pid`). A name, root and a cgroup outside the pods' are no
    proof: a root process named kubelet in a container another runtime runs listens on a kubelet.sock
    of its own mount namespace, not the host's."""
    listening = listener_pid(kubelet_path)
    # The last scan's answer holds while it holds the listener: else the kubelet, or the process that
    # listens in its stead, may have started since (and other processes of its name with it).
    held = str(listening) if isinstance(listening, int) and listening > 0 else ""
    candidates = kubelet_pids(proc, names, must_hold=held)
    if not candidates:
        return KubeletProcesses(listener=listening)
    trusted = tuple(
        pid for pid in candidates if isinstance(listening, int) and listening and int(pid) == listening
    )
    if isinstance(listening, str):
        why = f"which process listens on kubelet.sock cannot be told: {listening}"
    elif listening == 0:
        why = "the process that listens on kubelet.sock is not visible from this pod"
    else:
        why = f"it does not listen on kubelet.sock as this pod sees it (pid {listening} does)"
    ignored = tuple(f"pid {pid} ({comm(proc, pid)}): {why}" for pid in candidates if pid not in trusted)
    return KubeletProcesses(trusted, ignored, listening)


_PID_CACHE: dict[tuple[str, frozenset[str]], list[str]] = {}


def kubelet_pids(proc: str, names: Collection[str] = KUBELET_PROCESS_NAMES, must_hold: str = "") -> list[str]:
    """The pids of visible kubelet processes (`comm` is cut to 15 characters, so are the names).

    A process counts when it bears one of the names, runs as root, and is not in a pod's cgroup:
    anyone may name a process "kubelet", and root in a container may bind any path in a network
    namespace of its own. The last answer is kept while each of its processes still qualifies and it
    holds `must_hold` (the pid that listens on kubelet.sock): a scan of /proc is done when the kubelet
    restarts, not every probe round.
    """
    wanted = frozenset(n[:COMM_LENGTH] for n in names)
    key = (proc, wanted)
    cached = _PID_CACHE.get(key)
    if (
        cached
        and (not must_hold or must_hold in cached)
        and all(comm(proc, pid) in wanted and trusted_process(proc, pid) for pid in cached)
    ):
        return cached
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    pids = [
        pid for pid in entries if pid.isdigit() and comm(proc, pid) in wanted and trusted_process(proc, pid)
    ]
    _PID_CACHE[key] = pids
    return pids


def trusted_process(proc: str, pid: str) -> bool:
    """Run by root (real and effective uid 0, as this reader's user namespace sees it) and not in a
    pod's cgroup (every pod's cgroup path holds "kubepods", with the cgroupfs and systemd drivers)."""
    try:
        with open(os.path.join(proc, pid, "status"), encoding="utf-8", errors="replace") as f:
            uids = next((line.split()[1:3] for line in f if line.startswith("Uid:")), [])
        with open(os.path.join(proc, pid, "cgroup"), encoding="utf-8", errors="replace") as f:
            cgroups = f.read(1 << 16)
    except OSError:
        return False
    return uids == ["0", "0"] and "kubepods" not in cgroups


def comm(proc: str, pid: str) -> str:
    """The process's name (`<proc>/<pid>/comm`), "" where it cannot be read."""
    try:
        with open(os.path.join(proc, pid, "comm"), encoding="utf-8", errors="replace") as f:
            return f.read(64).strip()
    except OSError:
        return ""


def cmdline(proc: str, pid: str) -> list[str]:
    """The process's arguments (`<proc>/<pid>/cmdline`, at most 64 KiB), [] where they cannot be read."""
    try:
        with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
