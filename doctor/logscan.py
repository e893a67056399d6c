"""Kubelet and plugin log lines that explain a missing registration, read from the end and bounded."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field

MAX_BYTES = 10 * 1024 * 1024  # per log: the newest 10 MiB, whatever the file's size

# The kubelet's own wording (docs/kubelet.md#log-lines).
KUBELET_ERRORS = (
    "Bad registration request from device plugin",
    "failed to dial device plugin",
    "failed to get device plugin options",
    "Unable to connect to device plugin client with socket path",
    "ListAndWatch ended unexpectedly for device plugin",
    "Failed to serve device plugin registration grpc server",
)
KUBELET_INFO = ("Got registration request from device plugin with resource", "Device plugin disconnected")
PLUGIN_ERRORS = (
    "Could not register device plugin",
    "context deadline exceeded",
    "Failed to start one or more plugins",
)
# klog's header: Lmmdd hh:mm:ss.uuuuuu
_KLOG_TIME = re.compile(rb"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})")
_RFC3339 = re.compile(rb"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})")


@dataclass
class LogFindings:
    source: str
    read: bool = False
    problem: str = ""  # why the log could not be read
    counts: dict[str, int] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)  # the newest line of each pattern

    @property
    def errors(self) -> int:
        return sum(self.counts.values())


def read_tail(path: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The last `max_bytes` of a file, from its first whole line: one seek, whatever its size."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    if start:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else b""
    return data


def scan(data: bytes, patterns: tuple[str, ...], source: str, since: float | None, now: float) -> LogFindings:
    found = LogFindings(source, read=True)
    alternation = re.compile(b"|".join(re.escape(p.encode()) for p in patterns))
    cutoff = None if since is None else time.localtime(now - since)
    for m in alternation.finditer(data):
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.end())
        line = data[start : end if end >= 0 else len(data)]
        if cutoff is not None and _older(line, cutoff):
            continue
        key = m.group().decode()
        found.counts[key] = found.counts.get(key, 0) + 1
        found.last[key] = line.decode(errors="replace").strip()[:300]
    return found


def _older(line: bytes, lt: time.struct_time) -> bool:
    """True when the line's own timestamp (klog or RFC 3339, as CRI logs have) is before `lt`."""
    if m := _KLOG_TIME.match(line):
        month, day, hh, mm, ss = (int(x) for x in m.groups())
        stamp = (lt.tm_year, month, day, hh, mm, ss)
    elif m := _RFC3339.match(line):
        stamp = tuple(int(x) for x in m.groups())  # type: ignore[assignment]
    else:
        return False  # no time to judge by: keep it
    return stamp < (lt.tm_year, lt.tm_mon, lt.tm_mday, lt.tm_hour, lt.tm_min, lt.tm_sec)


def scan_file(
    path: str, patterns: tuple[str, ...], since: float | None, now: float | None = None
) -> LogFindings:
    try:
        data = read_tail(path)
    except OSError as e:
        return LogFindings(path, problem=f"cannot read {path}: {e.strerror}")
    return scan(data, patterns, path, since, now if now is not None else time.time())


def scan_journal(unit: str, patterns: tuple[str, ...], since: float | None) -> LogFindings:
    source = f"journalctl -u {unit}"
    exe = shutil.which("journalctl")
    if exe is None:
        return LogFindings(source, problem="journalctl is not installed here")
    argv = [exe, "-u", unit, "--no-pager", "-o", "cat", "-n", "100000"]
    if since is not None:
        argv += ["--since", f"-{int(since)}s"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return LogFindings(source, problem=f"journalctl failed: {e}")
    if done.returncode != 0:
        return LogFindings(
            source, problem=done.stderr.decode(errors="replace").strip()[:200] or "journalctl failed"
        )
    return scan(done.stdout[-MAX_BYTES:], patterns, source, None, time.time())


def plugin_log_files(root: str = "/var/log/pods") -> list[str]:
    """The device plugin container's newest log under the kubelet's pod log folder."""
    files = glob.glob(os.path.join(root, "*device-plugin*", "device-plugin", "*.log"))
    return sorted(files, key=os.path.getmtime)[-1:]
