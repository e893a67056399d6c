"""Which Kubernetes release the kubelet runs: the rules that differ between releases follow it.

The kubelet's version is in its own binary: Go records the main module and the build's
`-ldflags` (where Kubernetes' build sets `k8s.io/component-base/version.gitVersion`) in the
section `.go.buildinfo`, a few kilobytes near the start of the file. Only that section is
read, through `/proc/<pid>/exe`, which the kernel opens for a reader allowed to trace the
process (the same uid and capabilities, or CAP_SYS_PTRACE). Where it cannot be read, or a
build records neither (`-trimpath` drops the flags), the release is unknown and the caller
applies the newest rules it knows; a setting names it instead.

Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import dataclass

from hami_guard.node.proc import COMM_LENGTH, kubelet_processes, not_listening

MAX_BUILDINFO = 1 << 20  # the section holds the module list: kilobytes; never read more than this
MAX_SECTIONS = 4096
_RELEASE = re.compile(r"^v?(\d{1,3})\.(\d{1,3})(?:\.(\d{1,5}))?(?:[-+][0-9A-Za-z.+-]{0,64})?$")
# In the order they are trusted: the version the build stamped, then the module it was built from
# (a kubelet built as a module, as the node end-to-end's is) or depends on (a program embedding the
# device manager, k3s's fork).
_STAMPED = (
    re.compile(
        rb"k8s\.io/component-base/version\.gitVersion=(v\d{1,3}\.\d{1,3}\.\d{1,5}[0-9A-Za-z.+-]{0,64})"
    ),
    re.compile(rb"\nmod\tk8s\.io/kubernetes\t(v\d{1,3}\.\d{1,3}\.\d{1,5}[0-9A-Za-z.+-]{0,64})\t"),
    re.compile(rb"\ndep\tk8s\.io/kubernetes\t(v\d{1,3}\.\d{1,3}\.\d{1,5}[0-9A-Za-z.+-]{0,64})[\t\n]"),
)


@dataclass(frozen=True)
class Release:
    """A kubelet release as read: its version text, (major, minor), and where it came from."""

    version: str
    minor: tuple[int, int]
    source: str  # "setting", "binary /proc/<pid>/exe", …


def parse(text: str) -> tuple[int, int] | None:
    """(major, minor) of `v1.37.2`, `1.34`, `v1.30.2+k3s1`; None for anything else."""
    m = _RELEASE.match(text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def buildinfo(path: str) -> bytes:
    """The `.go.buildinfo` section of the ELF file at `path`, at most `MAX_BUILDINFO` bytes.

    Raises OSError (unreadable, not a regular file) or ValueError (not a 64-bit little-endian ELF
    file, or no such section)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        head = os.pread(fd, 64, 0)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        if shentsize < 64 or not 0 < shnum <= MAX_SECTIONS or shstrndx >= shnum:
            raise ValueError("no section table")
        table = os.pread(fd, shentsize * shnum, shoff)
        if len(table) < shentsize * shnum:
            raise ValueError("a truncated section table")

        def section(i: int) -> tuple[int, int, int]:
            (name,) = struct.unpack_from("<I", table, i * shentsize)
            offset, size = struct.unpack_from("<QQ", table, i * shentsize + 0x18)
            return name, offset, size

        _, names_at, names_size = section(shstrndx)
        names = os.pread(fd, min(names_size, 1 << 16), names_at)
        for i in range(shnum):
            name, offset, size = section(i)
            if names[name : name + 14] == b".go.buildinfo\0":
                return os.pread(fd, min(size, MAX_BUILDINFO), offset)
        raise ValueError("no .go.buildinfo section (not a Go binary)")
    finally:
        os.close(fd)


def from_buildinfo(info: bytes) -> str | None:
    """The Kubernetes version a Go binary's build information names, if any."""
    for pattern in _STAMPED:
        m = pattern.search(info)
        if m:
            return m.group(1).decode("ascii")
    return None


def kubelet_pids(names: set[str]) -> list[int]:
    """The processes whose name (/proc/<pid>/comm) is one of `names`, oldest first."""
    wanted = {n[:COMM_LENGTH] for n in names}
    found = []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
                if f.read(64).rstrip("\n") in wanted:
                    found.append(int(pid))
        except OSError:
            continue
    return sorted(found)


def from_process(names: set[str], kubelet_path: str | None = None, proc: str = "/proc") -> Release | str:
    """The release of the kubelet process among `names`, from its binary; or why it is not known.

    With `kubelet_path`, the kubelet is the process of those names that listens on it (the rule of
    `hami_guard.node.proc`): the others are not read. Without, every visible process of those names
    must be read and name the same release: anyone can name a process `kubelet`, and a look-alike whose
    binary can be read while the kubelet's cannot must not choose the rules."""
    if kubelet_path is not None:
        found = kubelet_processes(kubelet_path, proc, names)
        if not found.trusted and not found.ignored:
            return "no kubelet process is visible"
        if not found.trusted:
            return not_listening(names)
        pids = [int(found.trusted[0])]
    else:
        pids = kubelet_pids(names)
    if not pids:
        return "no kubelet process is visible"
    seen: dict[str, int] = {}
    for pid in pids:
        try:
            version = from_buildinfo(buildinfo(f"{proc}/{pid}/exe"))
        except (OSError, ValueError) as e:
            return f"{proc}/{pid}/exe: {getattr(e, 'strerror', None) or e}"
        if version is None:
            return f"{proc}/{pid}/exe names no Kubernetes version (a -trimpath build)"
        seen.setdefault(version, pid)
    if len(seen) > 1:
        return "processes of the kubelet's name name different releases: " + ", ".join(sorted(seen))
    ((version, pid),) = seen.items()
    minor = parse(version)
    if minor is None:
        return f"{proc}/{pid}/exe names {version!r}, not a release"
    return Release(version, minor, f"the binary of pid {pid}")
