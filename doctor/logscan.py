"""The log scanner: what a log says of the patterns it is given, read from the end and bounded.

It knows nothing of the catalogue (doctor/patterns.toml, loaded by `doctor.patterns`): it takes
the patterns as an argument, so the same scan reads the kubelet's, the plugin's and the DRA
drivers' lines. A line is matched by the patterns' literal wording only; a pattern's `refine`
words inside a matched line only make its meaning more precise. An error followed by a later
successful registration is history, shown as such, not a problem.
"""

from __future__ import annotations

import calendar
import glob
import math
import os
import re
import shutil
import stat
import subprocess
import time

from doctor.types import LogFindings, LogHit, Pattern

MAX_BYTES = 10 * 1024 * 1024  # per log: the newest 10 MiB, whatever the file's size
MAX_LINE = 300  # of a line kept as evidence
# A line the container runtime split in CRI partial (P) lines (16 KiB each) is joined up to this; the
# rest of a longer one continues as a line of its own, so no byte goes unscanned and none is held twice.
MAX_JOINED = 1024 * 1024
HEAD = 256  # of a line: enough for its time (CRI prefix, then klog's header)


class NotRegularFile(OSError):
    """A log path that is not a regular file (a FIFO, a device, a folder): never read."""


def read_tail(path: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The last `max_bytes` of a regular file, from its first whole line: one seek, whatever its size.

    Opened without blocking and refused unless regular: a FIFO or a device would hang the read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"not a regular file ({_kind(st.st_mode)})")
        size = os.lseek(fd, 0, os.SEEK_END)
        start = max(0, size - max_bytes)
        os.lseek(fd, start, os.SEEK_SET)
        chunks, left = [], max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if start:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else b""
    return data


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


# The CRI log file format (/var/log/pods): "<RFC 3339 time> <stream> <P|F> <content>".
_CRI = re.compile(
    rb"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})) (?:stdout|stderr) ([PF]) ?"
)
# klog's header: Lmmdd hh:mm:ss.uuuuuu
_KLOG_TIME = re.compile(rb"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})")
_RFC3339 = re.compile(rb"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(Z|[+-]\d{2}:\d{2})?")


def lines_of(data: bytes) -> list[tuple[float | None, str]]:
    """Each logical line with its time (seconds since the epoch) when it carries one.

    CRI lines lose their prefix and partial (P) lines are joined to the line they continue, up to
    MAX_JOINED bytes: the rest of a longer one continues as a line of its own. klog and journal lines
    are kept whole. Bytes that are not UTF-8 are replaced, never an error.
    """
    out: list[tuple[float | None, str]] = []
    pending: list[bytes] = []
    pending_size = 0
    pending_time: float | None = None

    def flush() -> None:
        nonlocal pending, pending_size, pending_time
        joined = b"".join(pending)
        when = pending_time if pending_time is not None else _klog_time(joined[:HEAD])
        out.append((when, joined.decode(errors="replace")))
        pending, pending_size, pending_time = [], 0, None

    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        m = _CRI.match(raw)
        if not m:
            out.append((_time_of(raw[:HEAD]), raw.decode(errors="replace")))
            continue
        when = _rfc3339(m.group(1))
        content = raw[m.end() :]
        if pending and pending_size + len(content) > MAX_JOINED:
            flush()
        if m.group(2) == b"P":
            pending.append(content)
            pending_size += len(content)
            pending_time = pending_time if pending_time is not None else when
            continue
        if pending:
            pending.append(content)
            pending_time = pending_time if pending_time is not None else when
            flush()
            continue
        out.append(
            (when if when is not None else _klog_time(content[:HEAD]), content.decode(errors="replace"))
        )
    if pending:
        flush()
    return out


def _time_of(head: bytes) -> float | None:
    """The time a raw line starts with (its first HEAD bytes are enough): the CRI prefix's, else the
    klog or RFC 3339 time of the line (of a CRI line's content)."""
    m = _CRI.match(head)
    if m:
        when = _rfc3339(m.group(1))
        return when if when is not None else _klog_time(head[m.end() :])
    return _rfc3339(head) or _klog_time(head)


def _rfc3339(text: bytes) -> float | None:
    m = _RFC3339.match(text)
    if not m:
        return None
    year, month, day, hh, mm, ss = (int(x) for x in m.groups()[:6])
    zone = m.group(7)
    try:
        if zone is None:  # a local time
            return time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
        offset = (
            0
            if zone == b"Z"
            else (1 if zone[:1] == b"+" else -1) * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
        )
        return calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0)) - offset
    except (OverflowError, ValueError):
        return None


def _klog_time(text: bytes, now: float | None = None) -> float | None:
    """klog prints no year: the year that puts the line at most a day in the future."""
    m = _KLOG_TIME.match(text)
    if not m:
        return None
    month, day, hh, mm, ss = (int(x) for x in m.groups())
    now = time.time() if now is None else now
    year = time.localtime(now).tm_year
    try:
        when = time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
        if when > now + 86400:
            when = time.mktime((year - 1, month, day, hh, mm, ss, 0, 0, -1))
    except (OverflowError, ValueError):
        return None
    return when


_CRI_PARTIAL = re.compile(
    rb"^\d{4}-\d{2}-\d{2}T[0-9:.]+(?:Z|[+-]\d{2}:\d{2}) (?:stdout|stderr) P ", re.MULTILINE
)
_RESOURCE = re.compile(rb"resource(?:Name)?=\"([^\"]+)\"|'([\w.-]+/[\w.-]+)'")
_COMPILED: dict[tuple[Pattern, ...], tuple[re.Pattern[bytes], dict[bytes, Pattern]]] = {}


def _variants(p: Pattern) -> list[bytes]:
    """The spellings a pattern is searched for: itself, and for a case-blind one the usual others
    (klog's message capitalised, an error string in lower case)."""
    text = p.text.encode()
    if not p.ignore_case:
        return [text]
    return list(dict.fromkeys([text, text[:1].swapcase() + text[1:], text.lower()]))


def _compiled(patterns: tuple[Pattern, ...]) -> tuple[re.Pattern[bytes], dict[bytes, Pattern]]:
    """One regular expression of literal alternatives (a single pass over the buffer), and which
    pattern each spelling belongs to."""
    if patterns not in _COMPILED:
        spelling = {v: p for p in patterns for v in _variants(p)}
        _COMPILED[patterns] = (re.compile(b"|".join(re.escape(v) for v in spelling)), spelling)
    return _COMPILED[patterns]


def _time_at(data: bytes, offset: int) -> tuple[int, float | None]:
    """The start of the first line at or after `offset` and its time (None: no time, or no line)."""
    begin = offset if offset == 0 or data[offset - 1 : offset] == b"\n" else data.find(b"\n", offset) + 1
    if begin <= 0 < offset or begin >= len(data):
        return len(data), None
    end = data.find(b"\n", begin, begin + HEAD)
    return begin, _time_of(data[begin : end if end >= 0 else begin + HEAD])


def _window_start(data: bytes, cutoff: float | None) -> int:
    """The first line not older than `cutoff`: bisection (a log is written in time order), then line
    by line. A line without a time never makes anything skipped."""
    if cutoff is None or not data:
        return 0
    low, high = 0, len(data)
    while high - low > 4096:
        mid = (low + high) // 2
        begin, when = _time_at(data, mid)
        if when is None or when >= cutoff:
            high = mid
        else:
            low = begin + 1
    begin, when = _time_at(data, low)
    while begin < len(data) and when is not None and when < cutoff:
        begin, when = _time_at(data, begin + 1)
    return begin


def scan(
    data: bytes, patterns: tuple[Pattern, ...], source: str, since: float | None, now: float
) -> LogFindings:
    """Every pattern's lines in the window, each error judged current or history.

    One pass of one regular expression over the buffer; only matched lines are looked at. History:
    an error before the newest successful registration of the resource it names (of any resource
    when it names none). The plugin says "Registered device plugin for"; the kubelet logs each
    Register attempt, and one that none of its rejections follows (before the next attempt)
    succeeded.
    """
    found = LogFindings(source, read=True)
    cutoff = None if since is None else now - since
    if _CRI_PARTIAL.search(data):  # lines the runtime split in parts: joined first (rare, slower)
        kept = [line for when, line in lines_of(data) if cutoff is None or when is None or when >= cutoff]
        data, start = "\n".join(kept).encode(errors="replace"), 0
        found.lines = len(kept)
    else:
        start = _window_start(data, cutoff)
        tail = start < len(data) and not data.endswith(b"\n")
        found.lines = data.count(b"\n", start) + (1 if tail else 0)
    regex, spelling = _compiled(patterns)
    seen: list[tuple[Pattern, int, int, str | None]] = []  # pattern, line start and end, resource
    # One line, one pattern: the first in it. After a match the search goes on at the next line, so
    # each byte is looked at a bounded number of times however long its line is.
    pos = start
    while pos < len(data):
        m = regex.search(data, pos)
        if m is None:
            break
        begin = max(pos, data.rfind(b"\n", pos, m.start()) + 1)
        end = data.find(b"\n", m.end())
        end = len(data) if end < 0 else end
        pos = end + 1
        p = spelling[m.group()]
        if cutoff is not None and p.kind == "error":  # an error out of order in time is judged by its own
            when = _time_of(data[begin : min(end, begin + HEAD)])
            if when is not None and when < cutoff:
                continue
        r = _RESOURCE.search(data, begin, end)
        resource = (r.group(1) or r.group(2)).decode(errors="replace") if r else None
        seen.append((p, begin, end, resource))

    def text(i: int) -> str:
        _, begin, end, _ = seen[i]
        return "".join(line for _, line in lines_of(data[begin:end])).strip()

    successes: dict[str | None, int] = {}  # resource (None: any) -> the newest successful registration
    attempt: int | None = None
    for i, (p, _, _, resource) in enumerate(seen):
        if p.kind == "success":
            successes[resource] = successes[None] = i
        elif p.kind == "attempt":
            if attempt is not None:
                successes[seen[attempt][3]] = successes[None] = attempt
            attempt = i
        elif p.rejects:
            attempt = None
    if attempt is not None:
        successes[seen[attempt][3]] = successes[None] = attempt
    if None in successes:
        found.registered = text(successes[None])[:MAX_LINE]
    grouped: dict[tuple[Pattern, bool], list[int]] = {}
    for i, (p, _, _, resource) in enumerate(seen):
        if p.kind == "error":
            grouped.setdefault((p, i < successes.get(resource, -1)), []).append(i)
    for (p, history), indices in grouped.items():
        newest = text(indices[-1])
        found.hits.append(LogHit(p, len(indices), newest[:MAX_LINE], p.explain(newest), history))
    found.hits.sort(key=lambda h: (h.history, -h.count))
    return found


def scan_file(
    path: str, patterns: tuple[Pattern, ...], since: float | None, now: float | None = None
) -> LogFindings:
    """`scan` of a file's newest MAX_BYTES; a file that cannot be read is said in the findings."""
    try:
        data = read_tail(path)
    except OSError as e:
        return LogFindings(path, problem=f"cannot read {path}: {e.strerror or e}")
    except ValueError as e:  # a path no file can have (a NUL byte)
        return LogFindings(path, problem=f"cannot read {path!r}: {e}")
    return scan(data, patterns, path, since, now if now is not None else time.time())


# Where the kubelet logs: its own unit, k3s's (server and agent: the kubelet runs inside k3s),
# microk8s's kubelite; RKE2 writes the kubelet's log to a file of its own.
KUBELET_UNITS = ("kubelet", "k3s", "k3s-agent", "snap.microk8s.daemon-kubelite")
RKE2_KUBELET_LOG = "/var/lib/rancher/rke2/agent/logs/kubelet.log"


def scan_journal(units: tuple[str, ...], patterns: tuple[Pattern, ...], since: float | None) -> LogFindings:
    """`scan` of the journal's lines of `units` within `since` seconds (journalctl, bounded)."""
    source = "journalctl " + " ".join(f"-u {u}" for u in units)
    exe = shutil.which("journalctl")
    if exe is None:
        return LogFindings(source, problem="journalctl is not installed here")
    argv = [exe, *(a for u in units for a in ("-u", u)), "--no-pager", "-q", "-o", "cat", "-n", "100000"]
    if since is not None and math.isfinite(since):  # an endless window is the whole journal
        argv += ["--since", f"-{max(0, int(since))}s"]
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
    dated = []
    for path in glob.glob(os.path.join(root, "*device-plugin*", "device-plugin", "*.log")):
        try:
            dated.append((os.path.getmtime(path), path))
        except OSError:
            continue  # rotated away between the listing and the look
    return [path for _, path in sorted(dated)[-1:]]


def kubelet_logs(where: str, since: float, patterns: tuple[Pattern, ...]) -> list[LogFindings]:
    """The kubelet's log as --kubelet-log names it: a file; journal (the units of every distribution);
    auto (the journal, and RKE2's kubelet log file when there is one)."""
    if where in ("auto", "journal"):
        found = [scan_journal(KUBELET_UNITS, patterns, since)]
        if where == "auto" and os.path.exists(RKE2_KUBELET_LOG):
            found.append(scan_file(RKE2_KUBELET_LOG, patterns, since))
        return found
    return [scan_file(where, patterns, since)] if where else []


def plugin_logs(where: str, since: float, patterns: tuple[Pattern, ...]) -> list[LogFindings]:
    """The plugin's log as --plugin-log names it: a file, or auto (its container's newest log)."""
    paths = plugin_log_files() if where == "auto" else [where]
    found = [scan_file(p, patterns, since) for p in paths]
    return found or [LogFindings("/var/log/pods/*device-plugin*", problem="no device plugin log found")]
