"""The kernel's table of Unix sockets as `/proc/<pid>/net/unix` prints it, and the sockets a process
holds (`/proc/<pid>/fd`). Standard library only: the init container reads where the kubelet listens
with it (`hami_guard.node.kubelet`), the sidecar and hami-doctor the kubelet's connections
(`hami_guard.node.unixdiag`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

ESTABLISHED, LISTEN = 1, 10  # the kernel's TCP_* states, which Unix stream sockets reuse


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


# The kernel prints a socket's name unescaped (af_unix.c, unix_seq_show): a name holding a newline
# prints what looks like more lines, and anyone may bind such an abstract name. A name is at most
# sizeof(sun_path) bytes as printed (an abstract name's leading NUL printed as "@"), so a line that ends
# within that many bytes of the start of a name printed before it may be a part of that name.
NAME_MAX = 108
PROC_HEADER = b"Num       RefCount Protocol Flags    Type St Inode Path"
# "%pK: %08X %08X %08X %04X %02X %5lu" and, when the socket has a name, " " and the name (%pK prints a
# placeholder for its first seconds after boot). Every line the kernel prints is in this format, so a
# line that is not, inside a name printed before it, is a part of that name.
_PROC_LINE = re.compile(
    rb"([0-9a-f]{8}|[0-9a-f]{16}|\(____ptrval____\)|\(ptrval\)): "
    rb"([0-9A-F]{8}) ([0-9A-F]{8}) ([0-9A-F]{8}) ([0-9A-F]{4}) ([0-9A-F]{2}) "
    rb"( {0,4})([0-9]{1,20})"
)
_ACCEPTCON = 0x10000  # __SO_ACCEPTCON: a listener
PROC_MAX_BYTES = 64 << 20  # a table larger than this is not read to its end (a host holds about 100 KiB)


@dataclass(frozen=True)
class ProcTable:
    """The sockets of a `/proc/<pid>/net/unix`, as its lines say."""

    sockets: tuple[UnixSocket, ...] = ()  # lines the kernel printed as lines
    doubtful: tuple[UnixSocket, ...] = ()  # lines that may be a part of a name printed before them
    skipped: int = 0  # lines that are not the kernel's format (parts of names that hold a newline)


def parse_proc_net_unix(lines: Iterable[bytes], paths: Collection[str] | None = None) -> ProcTable:
    """Parse the lines of a `/proc/<pid>/net/unix` (each with its newline, as a binary file yields
    them); with `paths`, keep only the sockets bound to one of them. Total: a line that does not
    parse is skipped and counted, and a line that may be a part of an earlier name is only doubtful."""
    wanted = None if paths is None else {p.encode("utf-8", "surrogateescape") for p in paths}
    sockets: list[UnixSocket] = []
    doubtful: list[UnixSocket] = []
    skipped = 0
    offset = 0  # of the line in the file
    reach = 0  # a line ending at or before this offset may be a part of a name printed before it
    for number, raw in enumerate(lines):
        start, offset = offset, offset + len(raw)
        line = raw[:-1] if raw.endswith(b"\n") else raw
        end = start + len(line)  # the offset of the line's newline
        if number == 0 and line == PROC_HEADER:
            continue
        inside = end <= reach
        m = _PROC_LINE.match(line)
        name_at = _name_at(line, m) if m is not None else -1
        if m is None or name_at == -1:
            skipped += 1
            if not inside:  # not the kernel's format, and no part of a name: its name may start in it
                reach = max(reach, end + NAME_MAX)
            continue
        if name_at:
            reach = max(reach, start + name_at + NAME_MAX)
        name = _normalised(line[name_at:]) if name_at else b""
        if wanted is not None and name not in wanted:
            continue
        sock = _socket(m, name)
        if sock is not None:
            (doubtful if inside else sockets).append(sock)
    return ProcTable(tuple(sockets), tuple(doubtful), skipped)


def _name_at(line: bytes, m: re.Match[bytes]) -> int:
    """Where the name starts in a line that matched `_PROC_LINE`: 0 without a name, -1 when the rest of
    the line is not in the kernel's format."""
    if len(m.group(7)) != max(0, 5 - len(m.group(8))):  # "%5lu": right-aligned in five columns
        return -1
    end = m.end()
    if end == len(line):
        return 0
    if len(line) - end < 2 or line[end : end + 1] != b" ":
        return -1
    return end + 1


def _normalised(name: bytes) -> bytes:
    return b"/" + name.lstrip(b"/") if name[:1] == b"/" else name


def _socket(m: re.Match[bytes], name: bytes) -> UnixSocket | None:
    """The socket of a line in the kernel's format; None for a state not kept here."""
    st = m.group(6)
    if st == b"03":
        state = ESTABLISHED
    elif st == b"01" and int(m.group(4), 16) & _ACCEPTCON:
        state = LISTEN
    else:
        return None
    return UnixSocket(int(m.group(8)), state, name.decode("utf-8", "surrogateescape"), None, 0, 0)


def read_proc_net_unix(proc: str = "/proc/self", paths: Collection[str] | None = None) -> ProcTable:
    """`<proc>/net/unix`, parsed (`parse_proc_net_unix`); OSError when it cannot be read."""
    with open(os.path.join(proc, "net", "unix"), "rb") as f:
        return parse_proc_net_unix(_bounded_lines(f, PROC_MAX_BYTES), paths)


def _bounded_lines(f: BinaryIO, limit: int) -> Iterator[bytes]:
    taken = 0
    for line in f:
        taken += len(line)
        if taken > limit:
            return
        yield line


_INODE = re.compile(
    rb"^[0-9A-Fa-f]+: [0-9A-Fa-f]+ [0-9A-Fa-f]+ [0-9A-Fa-f]+ [0-9A-Fa-f]+ [0-9A-Fa-f]+ +(\d+)", re.M
)


def listed_inodes(table: str) -> frozenset[int]:
    """Every socket inode a `/proc/<pid>/net/unix` file lists, read in one pass with no parse of the
    names: the cheap look between two reads of the table (a line forged in a name can add an inode,
    never remove one). OSError when it cannot be read."""
    with open(table, "rb", buffering=0) as f:
        # In 64 KiB reads: one read of PROC_MAX_BYTES maps a buffer that large every second.
        parts: list[bytes] = []
        taken = 0
        while taken < PROC_MAX_BYTES and (part := f.read(min(1 << 16, PROC_MAX_BYTES - taken))):
            parts.append(part)
            taken += len(part)
    return frozenset(int(m) for m in _INODE.findall(b"".join(parts)))


def proc_net_unix(proc: str = "/proc/self", paths: Collection[str] | None = None) -> list[UnixSocket]:
    """The Unix sockets of `proc`'s network namespace that its `<proc>/net/unix` shows as lines of their
    own (no inode of the bound file, no peer); with `paths`, only those bound to one of them."""
    return list(read_proc_net_unix(proc, paths).sockets)


# The kubelet binds this path whatever its --root-dir (pkg/kubelet/apis/deviceplugin/v1beta1/constants.go).
def socket_inodes(proc: str, pid: str) -> frozenset[int] | None:
    """The inodes of the sockets `pid` holds (its `socket:[inode]` descriptors), or None where they
    cannot be read. Reading a descriptor's link needs ptrace read access: the same uid and every
    capability the process has, or CAP_SYS_PTRACE. Root with its capabilities dropped may list the
    folder of a root process but not read one link."""
    fd_dir = os.path.join(proc, pid, "fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    out = set()
    for fd in fds:
        try:
            link = os.readlink(os.path.join(fd_dir, fd))
        except FileNotFoundError:
            continue  # closed since the listing
        except OSError:
            return None
        number = link[8:-1]
        if link.startswith("socket:[") and link.endswith("]") and number.isascii() and number.isdecimal():
            out.add(int(number))
    return frozenset(out)
