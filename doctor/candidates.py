"""--plugin-candidates: which of several resources this node's plugin serves, decided on the node before
anything is judged (one DaemonSet of a per-node vendor over nodes of several devices: Ascend's plugin
serves its own chip's `huawei.com/<commonWord>` on `<commonWord>.sock`).

hami-sidecar learns it from the listeners of its pod's network namespace (sidecar.deviceplugin.candidates),
which no process outside the pod is in. hami-doctor runs on the host (node-problem-detector: the host's
network and PID namespaces; or by hand, as root), where that rule tells nothing: every host-network
process listens there, and the plugin's own pod (Ascend's has no hostNetwork) listens elsewhere. What it
reads instead, for each candidate:

- its socket file, never through a symbolic link (lstat), and a connection to it that a listener accepts
  (the kernel's word, whatever the listener's network namespace), the same file before and after; the
  listener's process by SO_PEERCRED (the process that called listen(), in this PID namespace) and the
  name it gives itself, shown, never judged by (a name is the process's to choose);
- the kubelet's own records: the healthy devices pod-resources lists of the resource now, and whether the
  checkpoint names it (history).

A dead socket file (a refused connection), a link, or anything else at a candidate's path is not served.
Exactly one served: that one is judged, as if --plugin had named it. Several: each is judged (a doctor
reports, it restarts nothing; the row says a node's plugin serves one). None: where the kubelet's records
name exactly one candidate (pod-resources first, the checkpoint else), that one is judged (its rows say why
it is not served); otherwise one problem row, no plugin serving any of them, with the fix. A candidate this
node does not have is never judged, so never a problem for being absent.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections.abc import Sequence

from doctor.shell import command
from doctor.types import CandidateJudgement, CandidateSocket, CandidateState, Cause, Decided
from hami_guard import profiles
from hami_guard.flags import PluginSpec
from hami_guard.profiles import VendorProfile
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.naming import physical_devices
from sidecar.deviceplugin.probes import Reading

CONNECT_TIMEOUT = 0.2  # a listener accepts at once (a full backlog times out: it listens all the same)
_PEERCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def _identity(path: str) -> tuple[int, int, int] | None:
    st = os.lstat(path)
    return (st.st_dev, st.st_ino, st.st_mtime_ns) if stat.S_ISSOCK(st.st_mode) else None


def _accepts(path: str) -> tuple[bool | None, int, str]:
    """(a listener accepted a connection (None: the connection failed otherwise than refused: nothing
    told), its pid in this PID namespace (0: not visible), why not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.connect(path)
        except (TimeoutError, BlockingIOError):
            return True, 0, ""  # its backlog is full: it listens
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)
            return (False if e.errno == errno.ECONNREFUSED else None), 0, why
        try:
            raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            pid: int = _PEERCRED.unpack(raw)[0]
        except OSError:
            pid = 0
    return True, pid, ""


def _process(pid: int, proc: str = "/proc") -> str:
    if pid <= 0:
        return "a process outside this PID namespace"
    try:
        with open(os.path.join(proc, str(pid), "comm"), encoding="utf-8", errors="replace") as f:
            name = f.read(64).strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid}, named {name!r}" if name else f"pid {pid}"


def look_socket(path: str) -> tuple[CandidateState, str]:
    """What is at a candidate's socket path: served only for a socket file (not a link) a listener accepts
    connections on, the same file before and after the connection."""
    name = os.path.basename(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent", f"{name} does not exist"
    except OSError as e:
        return "unreadable", f"{name} cannot be read: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return "link", f"{name} is a symbolic link, not followed: not a plugin's socket"
    if not stat.S_ISSOCK(st.st_mode):
        return "other", f"{name} is not a socket"
    before = (st.st_dev, st.st_ino, st.st_mtime_ns)
    accepted, pid, why = _accepts(path)
    try:
        after = _identity(path)
    except OSError:
        after = None
    if after != before:
        return "changed", f"{name} changed while it was looked at: nothing concluded"
    if accepted is None:
        return "unreadable", f"{name}: a connection failed ({why}): whether it is served cannot be told"
    if not accepted:
        return "dead", f"{name} is a socket file nothing listens on ({why}): a dead plugin's, or a look-alike"
    return "served", f"{name} is a socket file a listener accepts connections on ({_process(pid)})"


def look(
    folder: str,
    candidates: Sequence[PluginSpec],
    pod_resources: Reading[dict[str, frozenset[str]]],
    checkpoint: Reading[Checkpoint],
) -> tuple[tuple[CandidateSocket, ...], str]:
    """Each candidate's socket and the kubelet's records of it; and why the records could not be read
    ("" where one of them was)."""
    live, cp = pod_resources.value, checkpoint.value
    found = []
    for c in candidates:
        state, detail = look_socket(os.path.join(folder, c.socket))
        ids = live.get(c.resource) if live is not None else None
        listed = len(physical_devices(ids, c.resource)) if ids else None
        found.append(
            CandidateSocket(c, state, detail, listed, cp is not None and c.resource in cp.registered)
        )
    why = "" if live is not None or cp is not None else f"{pod_resources.error}; {checkpoint.error}"
    return tuple(found), why


def others_served(
    folder: str, candidates: Sequence[PluginSpec], kubelet_socket: str, profile: VendorProfile
) -> tuple[tuple[str, str], ...]:
    """Sockets of the vendor's form served in the folder that are no candidate: (socket, its resource)."""
    taken = {c.socket for c in candidates} | {kubelet_socket}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ()
    found = []
    for name in names:
        resource = profile.resources.resource_for(name)
        if name in taken or resource is None:
            continue
        if look_socket(os.path.join(folder, name))[0] == "served":
            found.append((name, resource))
    return tuple(found)


def judge(
    looked: Sequence[CandidateSocket],
    records: str = "",
    elsewhere: tuple[tuple[str, str], ...] = (),
    vendor: str = profiles.DEFAULT.name,
    node: str = "",
) -> CandidateJudgement:
    """Which candidates to judge: the one served; each of several served; else the one the kubelet's records
    name (pod-resources, else the checkpoint); else none."""
    found = tuple(looked)
    served = tuple(c.spec for c in found if c.state == "served")
    if served:
        decided: Decided = "served" if len(served) == 1 else "several"
        return CandidateJudgement(found, served, decided, records, elsewhere, vendor, node)
    for named in ([c for c in found if c.listed is not None], [c for c in found if c.checkpointed]):
        if len(named) == 1:
            return CandidateJudgement(found, (named[0].spec,), "recorded", records, elsewhere, vendor, node)
        if named:
            break  # several named: the records do not tell which one is this node's
    return CandidateJudgement(found, (), "none", records, elsewhere, vendor, node)


def _records(c: CandidateSocket) -> str:
    if c.listed is not None:
        return f"the kubelet's pod-resources lists {c.listed} healthy device(s) of it"
    if c.checkpointed:
        return "the kubelet's checkpoint names it (history)"
    return "the kubelet's records do not name it"


def candidates_cause(j: CandidateJudgement) -> Cause:
    """The row that says which candidate was judged and why; a problem only when none can be."""
    profile = profiles.named(j.vendor) or profiles.DEFAULT
    cause = Cause("plugin-candidates", "ok")
    judged = {s.resource for s in j.judged}
    for c in j.candidates:
        verdict = "judged" if c.spec.resource in judged else "not this node's, not judged"
        cause.evidence.append(f"{c.spec.resource}: {c.detail}; {_records(c)}: {verdict}")
    if j.records:
        cause.evidence.append(f"the kubelet's records could not be read: {j.records}")
    names = ", ".join(s.resource for s in j.judged)
    if j.decided == "served":
        cause.evidence.insert(0, f"judged {names}: the one candidate served on this node")
    elif j.decided == "several":
        cause.verdict = "unknown"
        cause.evidence.insert(
            0,
            f"several candidates are served ({names}): each is judged; a node's {profile.vendor} plugin "
            "serves one, so which is this node's cannot be told (another plugin on this node?)",
        )
    elif j.decided == "recorded":
        cause.evidence.insert(
            0,
            f"none is served now; the kubelet's records name {names} on this node: judged (its rows below "
            "say why it is not served)",
        )
    else:
        _none(cause, j, profile)
    return cause


def _none(cause: Cause, j: CandidateJudgement, profile: VendorProfile) -> None:
    shown = ", ".join(c.spec.resource for c in j.candidates)
    fix = [
        "start this node's device plugin, or read why it serves nothing (its pod's state and log):",
        "$ "
        + command(
            "kubectl", "-n", profile.chart.namespace, "get", "pods", "-o", "wide",
            "--field-selector", f"spec.nodeName={j.node or '<node>'}",
        ),
    ]  # fmt: skip
    for sock, resource in j.elsewhere:
        cause.evidence.append(f"{sock} is served in the folder: {resource}, not a candidate")
        fix.append(
            f"this node's plugin serves {resource}, which is not a candidate: add it "
            f"(--plugin-candidates {resource}={sock}; HAMI_GUARD_PLUGIN_CANDIDATES; the NPD rule's args)"
        )
    if profile.chart.node_label:
        fix.append(
            f"a node with no {profile.vendor} device has no plugin to judge: run hami-doctor (the NPD "
            f"rule) on the plugin's nodes only ({profile.chart.node_label})"
        )
    cause.problem(f"no plugin serving any of {shown}", fix)
