"""What the kubelet's and the plugin's logs say, read from the end and bounded.

Every pattern is a line the program really prints (the source is named beside it), mapped to the
cause row it feeds, what it means and its fix. A line is matched by its message only: a
generic string such as `context deadline exceeded` (the API server's timeouts print it too)
never decides a cause; inside a matched line it only makes the meaning more precise. An error
followed by a later successful registration is history, shown as such, not a problem.
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
from dataclasses import dataclass, field
from typing import Literal

MAX_BYTES = 10 * 1024 * 1024  # per log: the newest 10 MiB, whatever the file's size
MAX_LINE = 300  # of a line kept as evidence
# A line the container runtime split in CRI partial (P) lines (16 KiB each) is joined up to this; the
# rest of a longer one continues as a line of its own, so no byte goes unscanned and none is held twice.
MAX_JOINED = 1024 * 1024
HEAD = 256  # of a line: enough for its time (CRI prefix, then klog's header)

Kind = Literal["error", "attempt", "success"]

RESTART_PLUGIN = (
    "$ kubectl -n kube-system delete pod -l app.kubernetes.io/component=hami-device-plugin "
    "--field-selector spec.nodeName=$(hostname)"
)
INITCHECK = (
    "start the plugin only once the kubelet listens (the hami-initcheck init container, --wait 60), "
    "with the kubelet's own device-plugins folder mounted at the same path"
)
RUNTIME_FIX = (
    "install the NVIDIA Container Toolkit and make it the runtime of the plugin's pod: "
    "nvidia-ctk runtime configure --runtime=containerd (k3s and RKE2 pick it up when they restart), "
    "restart containerd, and set runtimeClassName: nvidia on the plugin (HAMi chart: "
    "devicePlugin.runtimeClassName)",
)
DRIVER_FIX = (
    "load the NVIDIA driver on the host: nvidia-smi must list the GPUs (modprobe nvidia; after a driver "
    "upgrade, reboot); on a node without GPUs keep the plugin off it with a nodeSelector",
    "$ nvidia-smi -L",
)


@dataclass(frozen=True)
class Pattern:
    text: str  # the program's own wording, matched literally
    cause: str  # the row it feeds: kubelet-log, plugin-log or driver-runtime
    meaning: str
    fix: tuple[str, ...] = ()
    source: str = ""  # where upstream it is printed
    kind: Kind = "error"
    ignore_case: bool = False
    # A more precise meaning when the same line also says one of these (checked in order).
    refine: tuple[tuple[str, str], ...] = ()

    def explain(self, line: str) -> str:
        lower = line.lower()
        for needle, meaning in self.refine:
            if needle.lower() in lower:
                return meaning
        return self.meaning


DIAL_BACK = (
    ("context deadline exceeded", "the plugin did not answer on its socket within the kubelet's 10 s dial"),
    ("no such file or directory", "no plugin socket at the path the kubelet joins to its own folder"),
    ("connection refused", "the plugin's socket is a dead file"),
)
# Kubernetes 1.37 (manager.go PluginConnected): an endpoint is still connected at the path.
ALREADY_CONNECTED = "device plugin already connected"
REFUSED_MEANING = (
    "the kubelet already holds an endpoint at that socket path (Kubernetes 1.37) and refused the Register; "
    "it also forgot the client of the stream it held, so that stream's end goes unnoticed, and it refuses "
    "every Register at that path until it restarts"
)
REFUSED_FIX = (
    "a plugin restart is refused the same way: restart the kubelet, then the plugin registers again "
    "(HAMi does when kubelet.sock is created); never run two instances of the plugin on one socket path",
    "$ systemctl restart kubelet",
)
DIAL_BACK_FIX = (
    "the kubelet dials the plugin back inside Register (Kubernetes 1.25 and later): the plugin must "
    "serve its socket, in the kubelet's own device-plugins folder, before it registers; mount that "
    "folder at the same path in the plugin's pod, then restart the plugin:",
    RESTART_PLUGIN,
)
NVML_REFINE = (
    ("ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 is not in the plugin's container: the container runtime "
     "did not inject the driver (no NVIDIA runtime)"),
    ("could not load NVML library", "libnvidia-ml.so.1 is not in the plugin's container: the container "
     "runtime did not inject the driver (no NVIDIA runtime)"),
    ("ERROR_DRIVER_NOT_LOADED", "the NVIDIA kernel driver is not loaded on the host"),
    ("Driver Not Loaded", "the NVIDIA kernel driver is not loaded on the host"),
    ("ERROR_LIB_RM_VERSION_MISMATCH", "the driver's library and kernel module differ (upgraded, not "
     "rebooted)"),
    ("version mismatch", "the driver's library and kernel module differ (upgraded, not rebooted)"),
    ("ERROR_NO_PERMISSION", "the plugin's container may not open the GPU device nodes"),
    ("ERROR_UNKNOWN", "NVML failed: the plugin's container cannot reach the GPU devices (device cgroup, "
     "runtime)"),
)  # fmt: skip
RUNTIME_OR_DRIVER = RUNTIME_FIX + DRIVER_FIX

# The kubelet's wording: kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/{server,handler,client}.go,
# and the pod admission of pkg/kubelet (docs/kubelet.md#log-lines).
KUBELET_PATTERNS = (
    Pattern(
        "Got registration request from device plugin with resource",
        "kubelet-log",
        "a plugin called Register",
        source="server.go Register",
        kind="attempt",
    ),
    Pattern(
        "Bad registration request from device plugin",
        "kubelet-log",
        "the kubelet refused the plugin's Register",
        (
            "the plugin must speak v1beta1 and register an extended resource name <domain>/<name> (HAMi "
            "chart: resourceName, e.g. nvidia.com/gpu)",
        ),
        "server.go Register",
        refine=(
            ("is not supported by kubelet", "the plugin asked for an API version other than v1beta1"),
            ("is invalid", "the resource name is not <domain>/<name>"),
        ),
    ),
    Pattern(
        "Error connecting to device plugin client",
        "kubelet-log",
        "the kubelet could not dial the plugin back during Register",
        DIAL_BACK_FIX,
        "server.go Register",
        refine=((ALREADY_CONNECTED, REFUSED_MEANING), *DIAL_BACK),
    ),
    Pattern(
        "Failed to connect to new client",
        "kubelet-log",
        "the kubelet could not dial the plugin back during Register",
        DIAL_BACK_FIX,
        "handler.go connectClient",
        refine=((ALREADY_CONNECTED, REFUSED_MEANING), *DIAL_BACK),
    ),
    Pattern(
        "Unable to connect to device plugin client with socket path",
        "kubelet-log",
        "the kubelet could not dial the plugin back during Register",
        DIAL_BACK_FIX,
        "client.go Connect",
        refine=DIAL_BACK,
    ),
    Pattern(
        "ListAndWatch ended unexpectedly for device plugin",
        "kubelet-log",
        "the plugin's device stream ended (it exited or restarted): the kubelet marked its devices "
        "unhealthy and never dials it again",
        ("only a new Register brings the devices back: restart the plugin", RESTART_PLUGIN),
        "client.go Run",
    ),
    Pattern(
        "Error while serving device plugin registration grpc server",
        "kubelet-log",
        "the kubelet's registration server stopped serving kubelet.sock",
        ("read the kubelet's log around it, then restart the kubelet", "$ systemctl restart kubelet"),
        "plugin/v1beta1/server.go Start",
    ),
    Pattern(
        "Failed to listen to socket while starting device plugin registry",
        "kubelet-log",
        "the kubelet could not create kubelet.sock in its device-plugins folder (read-only, full, or "
        "denied by a security module)",
        (
            "check the folder on the host (writable, space left, SELinux label), then restart the kubelet:",
            "$ ls -ldZ /var/lib/kubelet/device-plugins",
        ),
        "server.go serve",
    ),
    Pattern(
        "Failed to cleanup the device plugin directory",
        "kubelet-log",
        "the kubelet could not remove the old sockets from its device-plugins folder, so it started no "
        "registration server",
        (
            "find what cannot be removed there (an immutable file, a bind mount), fix it, restart the "
            "kubelet:",
            "$ lsattr /var/lib/kubelet/device-plugins",
        ),
        "server.go Start",
    ),
    Pattern(
        "Could not set selinux context on socket dir",
        "kubelet-log",
        "SELinux: the kubelet could not label its device-plugins folder, so an unprivileged plugin "
        "container may be denied kubelet.sock",
        (
            "label the folder for containers, or run the plugin privileged:",
            "$ chcon -R -t container_file_t /var/lib/kubelet/device-plugins",
        ),
        "server.go Start",
    ),
    Pattern(
        "Allocate failed due to",
        "kubelet-log",
        "a GPU pod was rejected at admission (UnexpectedAdmissionError): the kubelet could not allocate "
        "its devices",
        (
            "the rejected pod stays Failed: delete it once the plugin serves healthy devices again; "
            "kubectl describe pod shows the same message",
        ),
        'pkg/kubelet admission ("Pod admission denied")',
        refine=(
            (
                "requested number of devices unavailable",
                "fewer healthy devices than the pod requested: "
                "devices unhealthy, or the plugin not registered",
            ),
            ("rpc error", "the plugin's Allocate or GetPreferredAllocation call failed"),
        ),
    ),
)
# A registration attempt that one of these follows failed.
KUBELET_REJECTIONS = frozenset(
    (
        "Bad registration request from device plugin",
        "Error connecting to device plugin client",
        "Failed to connect to new client",
        "Unable to connect to device plugin client with socket path",
    )
)

# HAMi (pkg/device-plugin/nvidiadevice/nvinternal/plugin/{server,factory,register}.go,
# cmd/device-plugin/nvidia/main.go) and NVIDIA's plugin (internal/plugin/{server,factory}.go,
# cmd/nvidia-device-plugin/main.go) print these alike.
PLUGIN_PATTERNS = (
    Pattern(
        "Registered device plugin for",
        "plugin-log",
        "the kubelet accepted the plugin",
        source="server.go Start",
        kind="success",
    ),
    Pattern(
        "Could not register device plugin:",
        "plugin-log",
        "the plugin's Register call to the kubelet failed (it retries in 30 s)",
        (INITCHECK, "then restart the plugin:", RESTART_PLUGIN),
        "server.go Start",
        refine=(
            (
                "failed to dial device plugin",
                "the kubelet could not dial the plugin back: its socket is not in "
                "the kubelet's folder, or it did not serve yet",
            ),
            ("is not supported by kubelet", "the kubelet refused the API version"),
            ("is invalid", "the kubelet refused the resource name"),
            (
                "context deadline exceeded",
                "kubelet.sock did not answer within the plugin's 5 s dial: the "
                "plugin's folder is not the live kubelet's, or the kubelet is restarting",
            ),
            ("connection refused", "the plugin's kubelet.sock is a dead file: nothing listens on it"),
            ("no such file or directory", "no kubelet.sock in the plugin's folder"),
        ),
    ),
    Pattern(
        "Failed to start one or more plugins. Retrying in 30s...",
        "plugin-log",
        "a plugin failed to start and is retried in 30 s (the line before it says why)",
        (INITCHECK,),
        "main.go start",
    ),
    Pattern(
        "Could not start device plugin for",
        "plugin-log",
        "the plugin could not serve its socket (its folder is read-only or not mounted)",
        ("mount the host's device-plugins folder read-write in the plugin container", RESTART_PLUGIN),
        "server.go Start",
    ),
    Pattern(
        "Failed to start plugin:",
        "plugin-log",
        "a plugin failed to start",
        (INITCHECK,),
        "main.go startPlugins",
        refine=(
            (
                "context deadline exceeded",
                "a plugin failed to start: a dial timed out (kubelet.sock not "
                "answering, or its own socket not served)",
            ),
        ),
    ),
    Pattern(
        "No devices found. Waiting indefinitely.",
        "driver-runtime",
        "the plugin found no GPU in its container and serves nothing",
        RUNTIME_OR_DRIVER,
        "main.go startPlugins",
    ),
    Pattern(
        "failed to create FS watcher for",
        "plugin-log",
        "the plugin cannot watch the device-plugins folder, so it exits",
        (
            "raise the inotify limit on the host (and persist it in /etc/sysctl.d):",
            "$ sysctl -w fs.inotify.max_user_instances=8192",
        ),
        "main.go start",
        refine=(
            ("no such file or directory", "the plugin's device-plugins folder does not exist: not mounted"),
        ),
    ),
    Pattern(
        "has repeatedly crashed recently. Quitting",
        "plugin-log",
        "the plugin's gRPC server crashed more than 5 times within an hour and the plugin exited",
        ("the lines 'GRPC server for ... crashed with error' before it say why; then", RESTART_PLUGIN),
        "server.go Serve",
    ),
    Pattern(
        "device marked unhealthy",
        "plugin-log",
        "the plugin reported a GPU unhealthy (an XID error or a lost GPU); it stays unhealthy until the "
        "plugin restarts",
        (
            "check the GPU (dmesg | grep -i xid; nvidia-smi), then restart the plugin:",
            RESTART_PLUGIN,
        ),
        "server.go ListAndWatch",
    ),
    Pattern(
        "Failed to register annotation:",
        "plugin-log",
        "HAMi could not write the node's GPU annotations to the API server: HAMi's scheduler does not "
        "see this node's GPUs, so GPU pods stay Pending",
        (
            "check that the node reaches the API server and that the plugin's service account may patch "
            "nodes:",
            "$ kubectl auth can-i patch nodes --as=system:serviceaccount:kube-system:hami-device-plugin",
        ),
        "register.go WatchAndRegister",
    ),
    Pattern(
        "Failed to initialize NVML",
        "driver-runtime",
        "the plugin cannot start NVML",
        RUNTIME_OR_DRIVER,
        "factory.go getResourceManagers",
        ignore_case=True,
        refine=NVML_REFINE,
    ),
    Pattern(
        "nvml init failed",
        "driver-runtime",
        "the plugin cannot start NVML",
        RUNTIME_OR_DRIVER,
        "factory.go getResourceManagers",
        refine=NVML_REFINE,
    ),
    Pattern(
        "Incompatible strategy detected",
        "driver-runtime",
        "the plugin found neither NVML nor Tegra in its container: the container runtime did not inject "
        "the NVIDIA driver",
        RUNTIME_FIX,
        "factory.go getResourceManagers",
    ),
)
ALL_PATTERNS = KUBELET_PATTERNS + PLUGIN_PATTERNS


@dataclass(frozen=True)
class LogHit:
    """The lines of one pattern: how many, the newest, and whether a later registration made them history."""

    pattern: Pattern
    count: int
    newest: str
    meaning: str
    history: bool = False

    @property
    def text(self) -> str:
        return self.pattern.text


@dataclass
class LogFindings:
    source: str
    read: bool = False
    problem: str = ""  # why the log could not be read
    lines: int = 0  # lines read within the window
    hits: list[LogHit] = field(default_factory=list)
    registered: str = ""  # the newest line that shows a successful registration

    @property
    def current(self) -> list[LogHit]:
        return [h for h in self.hits if not h.history]

    @property
    def history(self) -> list[LogHit]:
        return [h for h in self.hits if h.history]


class NotRegularFile(OSError):
    pass


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
        elif p.text in KUBELET_REJECTIONS:
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
