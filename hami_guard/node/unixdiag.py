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
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hami_guard.node.netunix import (
    ESTABLISHED,
    LISTEN,
    UnixSocket,
    normalise,
    proc_net_unix,
    read_proc_net_unix,
    socket_inodes,
)
from hami_guard.node.proc import (
    KUBELET_PROCESS_NAMES,
    KubeletProcesses,
    kubelet_pids,
    kubelet_processes,
    listener_pid,
    trusted_process,
)
from hami_guard.node.sockets import try_connect

# The /proc reader lives in hami_guard.node.netunix (the init container reads where the kubelet listens with
# it), which process is the kubelet in hami_guard.node.proc (the rule all three programs share); these of
# their names are this module's too.
__all__ = [
    "ESTABLISHED",
    "KUBELET_PROCESS_NAMES",
    "LISTEN",
    "KubeletProcesses",
    "UnixSocket",
    "kubelet_processes",
    "listener_pid",
    "normalise",
    "proc_net_unix",
]

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_VFS, UDIAG_SHOW_PEER = 0x1, 0x2, 0x4
UNIX_DIAG_NAME, UNIX_DIAG_VFS, UNIX_DIAG_PEER, UNIX_DIAG_SHUTDOWN = 0, 1, 2, 6
PROC_CONNECTED, PROC_UNCONNECTED = "03", "01"  # /proc/net/unix's SS_* states

_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBHIII2I")
_MSG = struct.Struct("=BBBBI2I")
_RTA = struct.Struct("=HH")
_VFS = struct.Struct("=II")


class DiagUnavailable(Exception):
    """The kernel does not answer sock_diag for Unix sockets here."""


def _kdev_to_st_dev(kdev: int) -> int:
    """sock_diag reports the kernel's dev_t (major << 20 | minor), not stat's encoding."""
    return os.makedev(kdev >> 20, kdev & 0xFFFFF)


# -- sock_diag -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """One datagram of a sock_diag dump, decoded. Whatever the bytes, decoding gives one of these."""

    sockets: tuple[UnixSocket, ...] = ()
    done: bool = False  # NLMSG_DONE: the dump is complete
    error: str = ""  # NLMSG_ERROR, or a datagram that cannot be a reply: the dump is unusable
    skipped: int = 0  # messages that do not decode (too short, another family, a broken attribute)


DIAG_DEADLINE = 2.0  # seconds for a whole dump (the kernel answers a host's thousands in milliseconds)


def _diag_socket() -> socket.socket:
    """A netlink socket for sock_diag requests; DiagUnavailable where the kernel gives none."""
    try:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise DiagUnavailable(f"netlink sock_diag: {e.strerror}") from None


def diag_dump(files: Collection[tuple[int, int]] | None = None) -> list[UnixSocket]:
    """Every listening and connected Unix socket of this network namespace; with `files`, only those
    bound to one of these (st_dev, st_ino) (a host's namespace holds thousands: keep what matters),
    and the peers of those (the other end of each connection, unbound).

    With `files`, the dump asks for the bound file alone, so that the message of an unbound socket
    (nearly all of a busy host's) is passed over undecoded; the sockets kept, and their peers, are then
    asked for one by one with everything (`diag_get`). A socket gone in between is not in the answer.
    """
    s = _diag_socket()
    deadline = time.monotonic() + DIAG_DEADLINE
    with s:
        if files is None:
            return _dump(s, diag_request(), deadline)
        wanted = set(files)
        bound = [
            x for x in _dump(s, diag_request(UDIAG_SHOW_VFS), deadline, bound_only=True) if x.vfs in wanted
        ]
        out = [x for x in (diag_get(s, b.ino, deadline) for b in bound) if x is not None and x.vfs in wanted]
        peers = {x.peer for x in out if x.state == ESTABLISHED and x.peer} - {x.ino for x in out}
        out += [
            x for x in (diag_get(s, p, deadline) for p in sorted(peers)) if x is not None and x.vfs is None
        ]
        return out


def _dump(s: socket.socket, request: bytes, deadline: float, *, bound_only: bool = False) -> list[UnixSocket]:
    """The sockets of one dump on `s`; with `bound_only`, only those with a bound file."""
    out: list[UnixSocket] = []
    try:
        s.send(request)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DiagUnavailable(f"sock_diag: no complete answer within {DIAG_DEADLINE:g}s")
            s.settimeout(left)
            reply = decode_reply(s.recv(1 << 16), bound_only=bound_only)
            out += reply.sockets
            if reply.error:
                raise DiagUnavailable(f"sock_diag: {reply.error}")
            if reply.done:
                return out
    except OSError as e:
        raise DiagUnavailable(f"sock_diag: {e.strerror or e}") from None


def diag_get(s: socket.socket, ino: int, deadline: float) -> UnixSocket | None:
    """One socket of this namespace by its inode, with name, bound file, peer and shutdown state; None
    when it is gone (man 7 sock_diag: a request without NLM_F_DUMP, naming udiag_ino)."""
    show = UDIAG_SHOW_NAME | UDIAG_SHOW_VFS | UDIAG_SHOW_PEER  # the shutdown state comes always
    body = _REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino, show, 0xFFFFFFFF, 0xFFFFFFFF)
    header = _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 2, 0)
    try:
        s.send(header + body)
        left = deadline - time.monotonic()
        if left <= 0:
            raise DiagUnavailable(f"sock_diag: no complete answer within {DIAG_DEADLINE:g}s")
        s.settimeout(left)
        reply = decode_reply(s.recv(1 << 16))
    except OSError as e:
        raise DiagUnavailable(f"sock_diag: {e.strerror or e}") from None
    found = [x for x in reply.sockets if x.ino == ino]
    return found[0] if found else None  # an error (ENOENT: closed since the dump) is no socket


def diag_one(ino: int) -> UnixSocket | None:
    """One socket of this network namespace by its inode (None: it is closed). Raises DiagUnavailable."""
    s = _diag_socket()
    with s:
        return diag_get(s, ino, time.monotonic() + DIAG_DEADLINE)


def diag_alive(inodes: Collection[int]) -> set[int]:
    """Which of these sockets of this network namespace are still open and not shut down: one request
    each, microseconds however many sockets the namespace holds. Raises DiagUnavailable."""
    s = _diag_socket()
    deadline = time.monotonic() + DIAG_DEADLINE
    alive = set()
    with s:
        for ino in inodes:
            found = diag_get(s, ino, deadline)
            if found is not None and not found.shutdown:
                alive.add(ino)
    return alive


def diag_request(show: int = UDIAG_SHOW_NAME | UDIAG_SHOW_VFS | UDIAG_SHOW_PEER) -> bytes:
    """The dump request: listening and connected Unix sockets, with (by default) name, bound file and
    peer."""
    states = (1 << ESTABLISHED) | (1 << LISTEN)
    body = _REQ.pack(socket.AF_UNIX, 0, 0, states, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
    header = _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
    return header + body


def decode_reply(data: bytes, *, bound_only: bool = False) -> Reply:
    """Decode one datagram of a dump. Total: a message that does not decode is skipped and counted.
    With `bound_only`, a socket's message without a bound file (`UNIX_DIAG_VFS`) is passed over
    undecoded, uncounted: at 100,000 sockets, decoding each costs a quarter of a second."""
    sockets: list[UnixSocket] = []
    skipped = 0
    off = 0
    unpack, attribute = _NLMSG.unpack_from, _RTA.unpack_from
    while off + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = unpack(data, off)
        if (
            bound_only
            and kind == SOCK_DIAG_BY_FAMILY
            and _NLMSG.size + _MSG.size <= length <= len(data) - off
        ):
            at, end = off + _NLMSG.size + _MSG.size, off + length
            while at + _RTA.size <= end:
                size, name = attribute(data, at)
                if name == UNIX_DIAG_VFS or size < _RTA.size:
                    break
                at += (size + 3) & ~3
            else:
                off += (length + 3) & ~3  # no bound file: not one of the sockets asked for
                continue
        if length < _NLMSG.size or off + length > len(data):
            return Reply(tuple(sockets), error=f"a netlink message of {length} bytes in {len(data) - off}")
        payload = data[off + _NLMSG.size : off + length]
        off += (length + 3) & ~3
        if kind == NLMSG_DONE:
            return Reply(tuple(sockets), done=True, skipped=skipped)
        if kind == NLMSG_ERROR:
            return Reply(tuple(sockets), error=_error_text(payload), skipped=skipped)
        sock = _parse(payload) if kind == SOCK_DIAG_BY_FAMILY else None
        if sock is None:
            skipped += 1
        else:
            sockets.append(sock)
    if off < len(data):
        skipped += 1  # a tail shorter than a message header
    return Reply(tuple(sockets), skipped=skipped)


def _error_text(payload: bytes) -> str:
    """An NLMSG_ERROR's errno (negated in the message), as text."""
    if len(payload) < 4:
        return f"an error message of {len(payload)} bytes"
    code = -struct.unpack_from("=i", payload)[0]
    if code == 0:
        code = errno.EIO  # an acknowledgement, where a dump was asked for
    if 0 < code < 4096:  # the kernel's errno range (MAX_ERRNO)
        try:
            return os.strerror(code)
        except (ValueError, OverflowError):
            pass
    return f"error {code}"


def _parse(payload: bytes) -> UnixSocket | None:
    """One `unix_diag_msg` with its attributes, or None when it is not one (man 7 sock_diag)."""
    if len(payload) < _MSG.size:
        return None
    family, _type, state, _pad, ino, _c0, _c1 = _MSG.unpack_from(payload)
    if family != socket.AF_UNIX:
        return None
    path, vfs, peer, shutdown = "", None, 0, 0
    off = _MSG.size
    while off + _RTA.size <= len(payload):
        length, kind = _RTA.unpack_from(payload, off)
        if length < _RTA.size or off + length > len(payload):
            return None
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


KUBELET_BOUND_PATH = "/var/lib/kubelet/device-plugins/kubelet.sock"


@dataclass(frozen=True)
class Connections:
    """A snapshot of the kubelet's network namespace: who is connected to which socket file."""

    source: str
    sockets: tuple[UnixSocket, ...]
    exact: bool  # by the bound file's inode (sock_diag), else by path
    doubtful: tuple[UnixSocket, ...] = ()  # /proc lines that may be a part of another socket's name
    owned: frozenset[int] | None = None  # the kubelet's own sockets (its descriptors), where readable
    # /proc: by socket file (normalised path, as this process sees it), the sockets held by the process
    # that listens on it (its descriptors), or why they cannot be read: an accepted end counts only there.
    vouched: Mapping[str, frozenset[int] | str] = field(default_factory=dict, compare=False)
    # Processes that bear a kubelet's name and are not the kubelet: "pid N (name): why".
    ignored: tuple[str, ...] = ()
    tables: tuple[str, ...] = ()  # /proc: the `<proc>/<pid>/net/unix` files read

    def to(self, path: str, bound_as: tuple[str, ...] = ()) -> int:
        """Open connections accepted on the listener that owns the socket file at `path` now (0 where
        that cannot be told: see `held`)."""
        held = self.held(path, bound_as)
        return held if isinstance(held, int) else 0

    def held(self, path: str, bound_as: tuple[str, ...] = ()) -> int | str:
        """Open connections accepted on the listener that owns the socket file at `path` now, or why
        they cannot be told (see `accepted`)."""
        ids = self.accepted(path, bound_as)
        return ids if isinstance(ids, str) else len(ids)

    def listed(self, path: str, bound_as: tuple[str, ...] = ()) -> frozenset[int]:
        """/proc: the inodes of every open connection whose own line names `path` (or `bound_as`), the
        kubelet's or not: what a later look at the same table can see go (the lines that may be a part
        of another socket's name are left out). sock_diag: `accepted`'s."""
        if self.exact:
            found = self.accepted(path, bound_as)
            return found if isinstance(found, frozenset) else frozenset()
        names = {normalise(path), *bound_as}
        return frozenset(s.ino for s in self.sockets if s.state == ESTABLISHED and s.path in names)

    def accepted(
        self,
        path: str,
        bound_as: tuple[str, ...] = (),
        gone_as: tuple[tuple[int, int], int] | None = None,
        *,
        strict: bool = False,
    ) -> frozenset[int] | str:
        """The accepted ends (by inode: which one came or went between two reads) of the open
        connections on the listener that owns the socket file at `path` now, or why they cannot be
        told.

        sock_diag: an accepted end bound to that very file (device and inode: no name can forge it),
        not shut down, whose peer is in this namespace and names it back; where the kubelet's
        descriptors can be read, that peer must be one of them. /proc: lines the kernel printed as
        lines whose path is `path` (or `bound_as`), each among the descriptors of the process that
        listens on the file at `path` (it accepted them: a neighbour's look-alike pair, bound at that
        path in a mount namespace of its own, is its own); where those cannot be read, none is a
        count of 0 and some are no count at all (a neighbour can add a line, never hide the
        kubelet's). None, while a line that may be a part of another socket's name claims one, or
        while a listener is bound at that path in the kubelet's own namespace (not this pod's plugin:
        whose connection is whose cannot be told by path), is no count either.

        sock_diag matches the file by its identity, never through a symbolic link (a link at the path
        to another plugin's socket is not this one's). Once the file is gone, the identity it had still
        matches, under the plugin's own name (`gone_as`: the file the plugin's listener bound, and that
        listener's inode; the kernel keeps a socket's bound identity after an unlink): the kubelet's
        connections to a listener someone else unlinked, or none once the plugin stopped. Without it,
        `strict` (a caller that follows the listener): whose connections are whose cannot be told, no
        count, never 0; not `strict`, none.
        """
        if self.exact:
            vfs, named = _socket_file(path), None
            if vfs is None and gone_as is not None:
                # The file the plugin's listener bound, which the kernel keeps while that listener or an
                # end it accepted lives: its ends under the plugin's own name (an inode number freed once
                # they all closed may be another file's, never under that name on that device).
                vfs, named = gone_as[0], {normalise(path), *bound_as}
            if vfs is None and not strict:
                return frozenset()
            if vfs is None:
                name = os.path.basename(path)
                return f"{name} is gone (or not a socket): whose connections are whose cannot be told"
            ends = {s.ino: s for s in self.sockets}
            ids: set[int] = set()
            for s in self.sockets:
                if s.state != ESTABLISHED or s.vfs != vfs or s.shutdown:
                    continue
                if named is not None and s.path not in named:
                    continue
                peer = ends.get(s.peer)
                if peer is None or peer.peer != s.ino or peer.state != ESTABLISHED:
                    continue
                if self.owned is not None and peer.ino not in self.owned:
                    continue
                ids.add(s.ino)
            return frozenset(ids)
        names = {normalise(path), *bound_as}
        name = os.path.basename(path)
        if any(s.state == LISTEN and s.path in names for s in self.sockets):
            return (
                f"a listener is bound at {name}'s path in the kubelet's network namespace, not this pod's: "
                "whose connections are whose cannot be told by path"
            )
        found = frozenset(s.ino for s in self.sockets if s.state == ESTABLISHED and s.path in names)
        if not found and any(s.state == ESTABLISHED and s.path in names for s in self.doubtful):
            return (
                f"a line of the kubelet's net/unix that may be a part of another socket's name shows a "
                f"connection to {name}: it is not counted, and none other is seen"
            )
        if not found:
            return found
        held = self.vouched.get(normalise(path), f"the process that listens on {name} was not asked")
        if isinstance(held, str):
            return (
                f"the kubelet's net/unix shows {len(found)} connection(s) to {name} by path only, and "
                f"whose they are cannot be told: {held}"
            )
        return found & held


def kubelet_connections(
    kubelet_path: str,
    proc: str = "/proc",
    names: Collection[str] = KUBELET_PROCESS_NAMES,
    mine: Sequence[UnixSocket] | str | None = None,
    paths: Collection[str] | None = None,
    *,
    served: Collection[str] = (),
    kubelets: KubeletProcesses | None = None,
) -> Connections | str:
    """The Unix sockets of the kubelet's network namespace, or why they cannot be seen.

    This process's namespace when the kubelet's listener on `kubelet_path` is in it (a pod
    with the host network, or a test); else the namespace of the visible kubelet process
    (`hostPID`; see `kubelet_processes`), read from its `/proc/<pid>/net/unix`; else none can be
    seen. `mine` is this namespace's `diag_dump()` (or why it failed) when the caller has one;
    `paths`, the plugin sockets' paths as bound, keeps only their entries of a kubelet's
    `/proc/<pid>/net/unix`; `served`, the plugin sockets' paths as this process sees them, whose
    listening processes' descriptors are read (/proc) to tell their accepted ends from a neighbour's;
    `kubelets`, the caller's `kubelet_processes()`.
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
    if kubelets is None:
        kubelets = kubelet_processes(kubelet_path, proc, names)
    why, own = (mine, ()) if isinstance(mine, str) else ("", mine)
    vfs = (st.st_dev, st.st_ino)
    listener = next((s.ino for s in own if s.state == LISTEN and s.vfs == vfs), None)
    if listener is not None:
        owned = next(
            (fds for pid in kubelets.trusted if (fds := socket_inodes(proc, pid)) and listener in fds),
            None,
        )
        return Connections(
            "this network namespace (sock_diag)",
            tuple(own),
            exact=True,
            owned=owned,
            ignored=kubelets.ignored,
        )
    # The namespace of the process that listens on this very kubelet.sock (several kubelets run side by
    # side in tests, each on its own file), taken by its listener; where the process's descriptors can
    # be read, only when that listener is one of them. With no process of a kubelet's name that is
    # the kubelet, the namespace of the process that listens on kubelet.sock if it runs as root outside
    # any pod (the kubelet under another name); else, with no process of a kubelet's name at all, pid
    # 1's (the host's, under hostPID), by path; else none.
    listening = kubelets.listener
    if kubelets.trusted:
        pids = kubelets.trusted
    elif isinstance(listening, int) and listening and trusted_process(proc, str(listening)):
        pids = (str(listening),)
    elif kubelets.ignored:
        return f"no kubelet process is known: {'; '.join(kubelets.ignored)}"
    else:
        pids = ("1",)
    bound = {KUBELET_BOUND_PATH, normalise(kubelet_path)}
    listeners: set[int] = set()
    found: list[UnixSocket] = []
    doubtful: list[UnixSocket] = []
    read: list[str] = []
    for pid in pids:
        try:
            table = read_proc_net_unix(os.path.join(proc, pid), None if paths is None else {*paths, *bound})
        except OSError:
            continue
        theirs = next((s.ino for s in table.sockets if s.state == LISTEN and s.path in bound), None)
        if theirs is None or theirs in listeners:
            continue
        fds = socket_inodes(proc, pid) if pid != "1" else None
        if fds is not None and theirs not in fds:
            continue
        listeners.add(theirs)
        found += table.sockets
        doubtful += table.doubtful
        read.append(pid)
    if read:
        where = ", ".join(f"{proc}/{pid}/net/unix" for pid in read)
        # Read after the table: an accepted end it shows is counted only if still held then.
        vouched = {normalise(p): _listener_sockets(p, proc) for p in served}
        return Connections(
            f"the kubelet's network namespace ({where})",
            tuple(found),
            exact=False,
            doubtful=tuple(doubtful),
            vouched=vouched,
            ignored=kubelets.ignored,
            tables=tuple(os.path.join(proc, pid, "net", "unix") for pid in read),
        )
    return why or (
        "the kubelet's network namespace is not visible from this pod (neither hostNetwork nor a "
        "kubelet process under hostPID)"
    )


def _socket_file(path: str) -> tuple[int, int] | None:
    """The socket file at `path` as (st_dev, st_ino), not following a symbolic link; None when there is
    no socket file there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _listener_sockets(path: str, proc: str) -> frozenset[int] | str:
    """The sockets held by the process that listens on the socket file at `path`, or why they cannot be
    read."""
    pid = listener_pid(path)
    if isinstance(pid, str):
        return pid
    if pid == 0:
        return f"the process that listens on {os.path.basename(path)} is not visible from this pod"
    fds = socket_inodes(proc, str(pid))
    if fds is None:
        return (
            f"the descriptors of pid {pid}, which listens on {os.path.basename(path)}, cannot be read "
            "(that needs CAP_SYS_PTRACE)"
        )
    return fds


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
    *,
    kubelets: KubeletProcesses | None = None,
) -> SocketOwner:
    """Does the listener behind the socket file at `path` belong to this pod?

    Containers of a pod share its network namespace, and a listener lives in the namespace of
    the process that bound it; sock_diag lists this namespace's listeners with the device and
    inode of the file each is bound to. So a listener here bound to the file now at `path` is this
    pod's ("this-pod"); none here while something accepts connections on the file means another
    process, in another namespace, serves it ("elsewhere": a second device plugin that re-bound
    the same path, which a kubelet up to 1.36 keeps if it registered last). Where this namespace is the
    host's (the kubelet's listener on `kubelet_path` is here too, or the kubelet's process runs in it:
    the one that listens on `kubelet_path`, `kubelet_processes`, the caller's `kubelets` when given),
    every hostNetwork process shares it and the answer is "unknown". `sockets` is a `diag_dump()` taken
    by the caller, else one is taken here.
    """
    try:
        st = os.lstat(path)  # never through a symbolic link: a link's target is not this socket
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
    host = _host_namespace(kubelet_path, sockets, proc, names, kubelets)
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
    kubelet_path: str | None,
    sockets: Sequence[UnixSocket],
    proc: str,
    names: Collection[str],
    kubelets: KubeletProcesses | None,
) -> str:
    """Why this network namespace is the host's, or "" when it is not known to be."""
    if kubelet_path is None:
        return ""
    try:
        st = os.stat(kubelet_path)
    except OSError:
        return ""
    kvfs = (st.st_dev, st.st_ino)
    if any(s.state == LISTEN and s.vfs == kvfs for s in sockets):
        return "the kubelet's listener on kubelet.sock is in this network namespace"
    # The kubelet's process only (the one that listens on kubelet.sock): another of its name may run in
    # any namespace. Which one listens is asked (a connection) only when one of them runs in this one.
    mine = _netns_inode(os.path.join(proc, "self"))
    if mine is None or not any(
        _netns_inode(os.path.join(proc, p)) == mine for p in kubelet_pids(proc, names)
    ):
        return ""
    if kubelets is None:
        kubelets = kubelet_processes(kubelet_path, proc, names)
    for pid in kubelets.trusted:
        if _netns_inode(os.path.join(proc, pid)) == mine:
            return f"the kubelet's process (pid {pid}) runs in this network namespace"
    return ""
