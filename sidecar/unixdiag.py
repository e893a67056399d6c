"""Who holds a Unix socket: the kernel's table of Unix sockets, read without privileges.

Two readers. `sock_diag` (netlink, man 7 sock_diag) answers for this process's network
namespace with each socket's bound file (device and inode), its peer and its shutdown state:
exact. `/proc/<pid>/net/unix` answers for the namespace of any visible process, with the
path as the listener bound it and the state only. A connection's accepted end lives in the
*connecting* process's network namespace, so the kubelet's connections to a plugin are seen
where the kubelet runs, not in the plugin's pod (docs/kubelet.md#live-connection).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from initcheck.checks import try_connect

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_VFS, UDIAG_SHOW_PEER = 0x1, 0x2, 0x4
UNIX_DIAG_NAME, UNIX_DIAG_VFS, UNIX_DIAG_PEER, UNIX_DIAG_SHUTDOWN = 0, 1, 2, 6
ESTABLISHED, LISTEN = 1, 10  # the kernel's TCP_* states, which Unix stream sockets reuse
PROC_CONNECTED, PROC_UNCONNECTED = "03", "01"  # /proc/net/unix's SS_* states

_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBHIII2I")
_MSG = struct.Struct("=BBBBI2I")
_RTA = struct.Struct("=HH")
_VFS = struct.Struct("=II")


class DiagUnavailable(Exception):
    """The kernel does not answer sock_diag for Unix sockets here."""


@dataclass(frozen=True)
class UnixSocket:
    ino: int  # the socket's own inode
    state: int  # ESTABLISHED or LISTEN
    path: str  # as bound ("" for unnamed), normalised
    vfs: tuple[int, int] | None  # (st_dev, st_ino) of the bound file; accepted sockets share it
    peer: int  # the peer socket's inode, 0 when none
    shutdown: int  # 3 when the peer has closed: a connection that is over


def normalise(path: str) -> str:
    """grpcio binds `unix:///abs/path` as `///abs/path`; Go binds `/abs/path`."""
    return "/" + path.lstrip("/") if path.startswith("/") else path


def _kdev_to_st_dev(kdev: int) -> int:
    """sock_diag reports the kernel's dev_t (major << 20 | minor), not stat's encoding."""
    return os.makedev(kdev >> 20, kdev & 0xFFFFF)


def diag_dump(files: Collection[tuple[int, int]] | None = None) -> list[UnixSocket]:
    """Every listening and connected Unix socket of this network namespace; with `files`, only those
    bound to one of these (st_dev, st_ino) (a host's namespace holds thousands: keep what matters)."""
    states = (1 << ESTABLISHED) | (1 << LISTEN)
    show = UDIAG_SHOW_NAME | UDIAG_SHOW_VFS | UDIAG_SHOW_PEER
    body = _REQ.pack(socket.AF_UNIX, 0, 0, states, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
    header = _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise DiagUnavailable(f"netlink sock_diag: {e.strerror}") from None
    with s:
        s.settimeout(1.0)
        try:
            s.send(header + body)
            out: list[UnixSocket] = []
            while True:
                data = s.recv(1 << 16)
                for kind, payload in _messages(data):
                    if kind == NLMSG_DONE:
                        return out
                    if kind == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", payload)[0]
                        raise DiagUnavailable(f"sock_diag: {os.strerror(code or errno.EIO)}")
                    if kind == SOCK_DIAG_BY_FAMILY:
                        sock = _parse(payload)
                        if files is None or sock.vfs in files:
                            out.append(sock)
        except OSError as e:
            raise DiagUnavailable(f"sock_diag: {e.strerror or e}") from None


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            return
        yield kind, data[off + _NLMSG.size : off + length]
        off += (length + 3) & ~3


def _parse(payload: bytes) -> UnixSocket:
    _family, _type, state, _pad, ino, _c0, _c1 = _MSG.unpack_from(payload)
    path, vfs, peer, shutdown = "", None, 0, 0
    off = _MSG.size
    while off + _RTA.size <= len(payload):
        length, kind = _RTA.unpack_from(payload, off)
        if length < _RTA.size:
            break
        value = payload[off + _RTA.size : off + length]
        if kind == UNIX_DIAG_NAME:
            path = "" if value[:1] == b"\0" else normalise(value.rstrip(b"\0").decode(errors="replace"))
        elif kind == UNIX_DIAG_VFS and len(value) >= _VFS.size:
            vino, vdev = _VFS.unpack_from(value)
            vfs = (_kdev_to_st_dev(vdev), vino)
        elif kind == UNIX_DIAG_PEER and len(value) >= 4:
            peer = struct.unpack_from("=I", value)[0]
        elif kind == UNIX_DIAG_SHUTDOWN and value:
            shutdown = value[0]
        off += (length + 3) & ~3
    return UnixSocket(ino, state, path, vfs, peer, shutdown)


def proc_net_unix(proc: str = "/proc/self", paths: Collection[str] | None = None) -> list[UnixSocket]:
    """The Unix sockets of `proc`'s network namespace, from `<proc>/net/unix` (paths, no inodes);
    with `paths`, only those bound to one of them."""
    out: list[UnixSocket] = []
    with open(os.path.join(proc, "net", "unix"), encoding="utf-8", errors="replace") as f:
        next(f, None)  # the header
        for line in f:
            fields = line.split(None, 7)
            if len(fields) < 7:
                continue
            state = {PROC_CONNECTED: ESTABLISHED, PROC_UNCONNECTED: LISTEN}.get(fields[5])
            flags = int(fields[3], 16) if _hex(fields[3]) else 0
            if state is None or (state == LISTEN and not flags & 0x10000):  # __SO_ACCEPTCON
                continue
            path = normalise(fields[7].rstrip("\n")) if len(fields) > 7 else ""
            if paths is None or path in paths:
                out.append(UnixSocket(int(fields[6]), state, path, None, 0, 0))
    return out


def _hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


# The kubelet binds this path whatever its --root-dir (pkg/kubelet/apis/deviceplugin/v1beta1/constants.go).
KUBELET_BOUND_PATH = "/var/lib/kubelet/device-plugins/kubelet.sock"
KUBELET_PROCESS_NAMES = frozenset({"kubelet", "k3s-server", "k3s-agent", "k3s", "kubelite"})


@dataclass(frozen=True)
class Connections:
    """A snapshot of the kubelet's network namespace: who is connected to which socket file."""

    source: str
    sockets: tuple[UnixSocket, ...]
    exact: bool  # by the bound file's inode (sock_diag), else by path

    def to(self, path: str, bound_as: tuple[str, ...] = ()) -> int:
        """Open connections accepted on the listener that owns the socket file at `path` now."""
        return len(self.ids(path, bound_as))

    def ids(self, path: str, bound_as: tuple[str, ...] = ()) -> frozenset[int]:
        """Those connections' accepted sockets, by inode: which one came or went between two reads."""
        if self.exact:
            try:
                st = os.stat(path)
            except OSError:
                return frozenset()
            vfs = (st.st_dev, st.st_ino)
            return frozenset(
                s.ino for s in self.sockets if s.state == ESTABLISHED and s.vfs == vfs and not s.shutdown
            )
        names = {normalise(path), *bound_as}
        return frozenset(s.ino for s in self.sockets if s.state == ESTABLISHED and s.path in names)


def kubelet_connections(
    kubelet_path: str,
    proc: str = "/proc",
    names: Collection[str] = KUBELET_PROCESS_NAMES,
    mine: Sequence[UnixSocket] | str | None = None,
    paths: Collection[str] | None = None,
) -> Connections | str:
    """The Unix sockets of the kubelet's network namespace, or why they cannot be seen.

    This process's namespace when the kubelet's listener on `kubelet_path` is in it (a pod
    with the host network, or a test); else the namespace of a visible kubelet process
    (`hostPID`; its process named one of `names`), read from its `/proc/<pid>/net/unix`; else
    none can be seen. `mine` is this namespace's `diag_dump()` (or why it failed) when the
    caller has one; `paths`, the plugin sockets' paths as bound, keeps only their entries of a
    kubelet's `/proc/<pid>/net/unix`.
    """
    try:
        st = os.stat(kubelet_path)
    except OSError:
        return f"{kubelet_path} is missing"
    if mine is None:
        try:
            mine = diag_dump()
        except DiagUnavailable as e:
            mine = str(e)
    why, own = (mine, ()) if isinstance(mine, str) else ("", mine)
    vfs = (st.st_dev, st.st_ino)
    if any(s.state == LISTEN and s.vfs == vfs for s in own):
        return Connections("this network namespace (sock_diag)", tuple(own), exact=True)
    # Every namespace where a kubelet-named process listens on the kubelet's path counts: on a node
    # that is one, but the path is the same in every mount namespace, so a path cannot pick one out
    # (several kubelets run side by side in tests), and connections to this plugin's socket are only
    # in the namespace of the kubelet that holds it. A namespace is taken once, by its listener.
    bound = {KUBELET_BOUND_PATH, normalise(kubelet_path)}
    listeners: set[int] = set()
    found: list[UnixSocket] = []
    pids: list[str] = []
    for pid in _kubelet_pids(proc, names) or ["1"]:
        try:
            theirs = proc_net_unix(os.path.join(proc, pid), None if paths is None else {*paths, *bound})
        except OSError:
            continue
        listener = next((s.ino for s in theirs if s.state == LISTEN and s.path in bound), None)
        if listener is not None and listener not in listeners:
            listeners.add(listener)
            found += theirs
            pids.append(pid)
    if pids:
        where = ", ".join(f"{proc}/{pid}/net/unix" for pid in pids)
        return Connections(f"the kubelet's network namespace ({where})", tuple(found), exact=False)
    return why or (
        "the kubelet's network namespace is not visible from this pod (neither hostNetwork nor a "
        "kubelet process under hostPID)"
    )


_PID_CACHE: dict[tuple[str, frozenset[str]], list[str]] = {}


def _kubelet_pids(proc: str, names: Collection[str] = KUBELET_PROCESS_NAMES) -> list[str]:
    """The pids of visible kubelet processes (`comm` is cut to 15 characters, so are the names).

    The last answer is kept while each of its processes still bears its name: a scan of /proc is
    done when a kubelet restarts, not every probe round.
    """
    wanted = frozenset(n[:15] for n in names)
    key = (proc, wanted)
    cached = _PID_CACHE.get(key)
    if cached and all(_comm(proc, pid) in wanted for pid in cached):
        return cached
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    pids = [pid for pid in entries if pid.isdigit() and _comm(proc, pid) in wanted]
    _PID_CACHE[key] = pids
    return pids


def _comm(proc: str, pid: str) -> str:
    try:
        with open(os.path.join(proc, pid, "comm"), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


# -- who serves a socket file: this pod, or another process --------------------------------------------
Owner = Literal["this-pod", "elsewhere", "unknown"]


@dataclass(frozen=True)
class SocketOwner:
    """Whose listener stands behind a socket file, as seen from this network namespace."""

    verdict: Owner
    reason: str
    listener: int = 0  # the listening socket's inode, when it is in this namespace


def _netns_inode(proc: str) -> int | None:
    try:
        return os.stat(os.path.join(proc, "ns", "net")).st_ino
    except OSError:
        return None


def socket_owner(
    path: str,
    kubelet_path: str | None = None,
    sockets: Sequence[UnixSocket] | None = None,
    proc: str = "/proc",
    names: Collection[str] = KUBELET_PROCESS_NAMES,
) -> SocketOwner:
    """Does the listener behind the socket file at `path` belong to this pod?

    Containers of a pod share its network namespace, and a listener lives in the namespace of
    the process that bound it; sock_diag lists this namespace's listeners with the device and
    inode of the file each is bound to. So a listener here bound to the file now at `path` is this
    pod's ("this-pod"); none here while something accepts connections on the file means another
    process, in another namespace, serves it ("elsewhere": a second device plugin that re-bound
    the same path, which a kubelet up to 1.36 keeps if it registered last). Where this namespace is the
    host's (the kubelet's listener on `kubelet_path` is here too, or a visible kubelet process
    runs in it), every hostNetwork process shares it and the answer is "unknown". `sockets` is a
    `diag_dump()` taken by the caller, else one is taken here.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        return SocketOwner("unknown", f"{path}: {e.strerror or e}")
    if not stat.S_ISSOCK(st.st_mode):
        return SocketOwner("unknown", f"{path} is not a socket")
    if sockets is None:
        try:
            sockets = diag_dump()
        except DiagUnavailable as e:
            return SocketOwner("unknown", f"this network namespace's listeners cannot be read: {e}")
    vfs = (st.st_dev, st.st_ino)
    mine = [s for s in sockets if s.state == LISTEN and s.vfs == vfs]
    host = _host_namespace(kubelet_path, sockets, proc, names)
    name = os.path.basename(path)
    if host:
        return SocketOwner(
            "unknown",
            f"host network: {host}; every hostNetwork process listens in it, so whose listener serves "
            f"{name} cannot be told",
            mine[0].ino if mine else 0,
        )
    if mine:
        return SocketOwner(
            "this-pod",
            f"this pod's network namespace holds the listener of {name} (socket {mine[0].ino})",
            mine[0].ino,
        )
    if try_connect(path, timeout=0.2) is not None:
        return SocketOwner("unknown", f"nothing listens on {name}: no process serves it")
    return SocketOwner(
        "elsewhere",
        f"another device plugin serves {name}: its listener is in another network namespace, not this "
        "pod's (it re-bound the socket file after this pod's plugin did)",
    )


def _host_namespace(
    kubelet_path: str | None, sockets: Sequence[UnixSocket], proc: str, names: Collection[str]
) -> str:
    """Why this network namespace is the host's, or "" when it is not known to be."""
    if kubelet_path is not None:
        try:
            st = os.stat(kubelet_path)
        except OSError:
            pass
        else:
            kvfs = (st.st_dev, st.st_ino)
            if any(s.state == LISTEN and s.vfs == kvfs for s in sockets):
                return "the kubelet's listener on kubelet.sock is in this network namespace"
    mine = _netns_inode(os.path.join(proc, "self"))
    for pid in _kubelet_pids(proc, names):
        if mine is not None and _netns_inode(os.path.join(proc, pid)) == mine:
            return f"the kubelet's process (pid {pid}) runs in this network namespace"
    return ""
