"""The records hami-doctor's stages pass to one another, and nothing else.

Every stage imports this module; it imports no other module of the doctor, so the stages'
imports run one way (settings → evidence → causes → repairs → render → cli) with no circle.
The types of the evidence (`NodeEvidence` and its parts), of the logs' findings (`Pattern`,
`LogHit`, `LogFindings`), of the DRA drivers' readings (`DraReading`), of the verdicts
(`Cause`, with the rows' ids and titles), of the repairs (`Repair`) and of the report
(`Report`). The other packages' types are imported for annotations only (but `SocketOwner` and the
default vendor profile, for defaults): this module stays as light as the command line, which imports
it before it knows whether grpc can be imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hami_guard.flags import ANY_DEVICES, DeviceExpectation
from hami_guard.node.unixdiag import SocketOwner
from hami_guard.profiles import DEFAULT

if TYPE_CHECKING:
    from hami_guard.flags import PluginSpec
    from initcheck.checks import Finding
    from sidecar.deviceplugin.checkpoint import Checkpoint
    from sidecar.deviceplugin.probes import Reading, SocketId
    from sidecar.dra.spec import DraSpec
    from sidecar.dra.verdicts import Evidence, Judgement
    from sidecar.hami.verdicts import HamiEvidence, HamiKeys, HamiVerdict

Verdict = Literal["problem", "ok", "unknown"]
Kind = Literal["error", "attempt", "success"]

# Root causes, in the order a cause explains the ones after it: the most likely first.
CAUSES = (
    ("socket-path", "socket path mismatch"),
    ("socket-name", "plugin socket under another name"),
    ("socket-permission", "socket permission"),
    ("protocol", "API/protocol mismatch"),
    ("driver-runtime", "GPU driver or runtime"),
    ("socket-owner", "another plugin owns the socket"),
    ("plugin-not-serving", "plugin not serving"),
    ("plugin-not-registered", "plugin not registered"),
    ("devices-not-registered", "devices visible, not registered"),
    ("kubelet-log", "kubelet registration errors"),
    ("plugin-log", "plugin registration errors"),
    ("plugin-growth", "plugin resource growth"),
    ("kubelet-version", "kubelet version"),
)
# DRA drivers' rows (doctor/dra/), only when --dra-driver names any: after the device plugins'.
DRA_CAUSES = (
    ("dra-not-serving", "DRA driver not serving"),
    ("dra-service-silent", "DRA service not answering"),
    ("dra-not-registered", "DRA driver not registered"),
    ("dra-log", "kubelet DRA log lines"),
)
# HAMi's own registration (doctor/hami.py), only where the API server can be asked: after the others.
HAMI_CAUSES = (
    ("hami-registration", "HAMi scheduler's view of the GPUs"),
    ("hami-handshake", "HAMi scheduler handshake"),
)
# What hami-sidecar did for GPUs HAMi marked unhealthy (doctor/recovery.py), where its /status answers.
RECOVERY_CAUSES = (("unhealthy-devices", "GPUs HAMi marked unhealthy"),)
# Which of --plugin-candidates this node serves (doctor/candidates.py), only when they are given: ranked
# after driver-runtime (a plugin that cannot reach its device may serve nothing).
CANDIDATE_CAUSES = (("plugin-candidates", "plugin candidates"),)
TITLES = dict(CAUSES + DRA_CAUSES + HAMI_CAUSES + RECOVERY_CAUSES + CANDIDATE_CAUSES)


# -- the evidence ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SocketProbe:
    """One gRPC probe of a socket, as the sidecar judged it."""

    path: str
    state: str  # alive, absent, not-socket, refused, timeout, wrong-service, error
    reason: str
    identity: SocketId | None = None  # the socket file probed (its mtime: when it was made), if any

    @property
    def ok(self) -> bool:
        """Something serves the socket and answered the probe."""
        return self.state == "alive"

    @property
    def stale(self) -> bool:
        """The socket file exists and nothing listens on it."""
        return self.state == "refused"


NOT_CHECKED = SocketOwner("unknown", "not checked")


@dataclass(frozen=True)
class PluginEvidence:
    """What was read about one device plugin (one --plugin): its probe, the kubelet's connections to it
    and whose listener serves its socket file."""

    spec: PluginSpec
    probe: SocketProbe
    # The kubelet's open connections to the listener of the plugin's socket file (its ListAndWatch
    # stream), read before the probes as the sidecar reads them; or why they cannot be seen.
    connections: Reading[int]
    owner: SocketOwner = NOT_CHECKED  # whose listener serves the socket file


@dataclass(frozen=True)
class KubeletProcess:
    """The kubelet's process as this namespace sees it: pid, version and listening paths, or why not."""

    visible: bool
    why: str = ""  # why it is not visible
    pid: int | None = None
    version: str | None = None  # "1.29.3", or None when the binary did not say
    listening: tuple[str, ...] = ()
    distribution: str = ""  # kubelet, k3s, rke2 or microk8s; "" when not visible
    process: str = ""  # the process that runs the kubelet (kubelet, k3s-server, kubelite, ...)
    # Processes of a kubelet's name that are not the kubelet (they do not listen on kubelet.sock as this
    # pod sees it): "pid N (name): why".
    ignored: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The report's JSON `kubelet` object."""
        if not self.visible:
            return {"visible": False, "why": self.why, "ignored": list(self.ignored)}
        return {
            "visible": True,
            "pid": self.pid,
            "listening": list(self.listening),
            "version": self.version,
            "distribution": self.distribution,
            "process": self.process,
            "ignored": list(self.ignored),
        }


@dataclass(frozen=True)
class DriverNodes:
    """The host's device nodes of the plugin's vendor (its profile), in the folder of --device-glob
    (checked with --expect-devices auto)."""

    checked: bool
    folder: str = ""
    control: bool = False  # <folder>/<control_node> exists: the driver is loaded
    gpus: tuple[str, ...] = ()  # the profile's device glob in <folder>
    control_node: str = DEFAULT.devices.control  # the driver's control node, the profile's
    vendor: str = DEFAULT.vendor


@dataclass(frozen=True)
class ProcessSample:
    """One sample of a process: resident memory, open descriptors and threads."""

    rss: int  # bytes
    fds: int
    threads: int


@dataclass(frozen=True)
class ProcessGrowth:
    """Two samples of one plugin process, `interval` seconds apart (as measured)."""

    pid: int
    first: ProcessSample
    second: ProcessSample
    interval: float
    uptime: float  # seconds

    @property
    def rss_mib(self) -> float:
        """The resident memory's growth between the samples, in MiB."""
        return (self.second.rss - self.first.rss) / 2**20


@dataclass(frozen=True)
class PluginProcesses:
    """Every process named --plugin-process-name, sampled twice; not visible: none is (no hostPID)."""

    name: str
    visible: bool
    growth: tuple[ProcessGrowth, ...] = ()


@dataclass(frozen=True)
class SocketFile:
    """One socket file in the device-plugins folder, and whether something listens on it."""

    path: str
    listening: bool  # connect() was accepted
    # The file that was judged: (st_dev, st_ino, st_mtime_ns, st_ctime_ns), the same before and after the
    # connect() test; None when it changed in between (then nothing is concluded about it).
    identity: tuple[int, int, int, int] | None = None
    age: float = 0.0  # seconds since it was made (its mtime: bind() sets it, nothing writes a socket)


CandidateState = Literal["served", "dead", "link", "other", "absent", "changed", "unreadable"]
Decided = Literal["served", "several", "recorded", "none"]


@dataclass(frozen=True)
class CandidateSocket:
    """One --plugin-candidates resource as read on the node: its socket file and the kubelet's records."""

    spec: PluginSpec
    # served: a socket file (not a link) a listener accepted a connection on; dead: a socket file that
    # refused one; link: a symbolic link (never followed); other: not a socket; absent; changed: the file
    # changed while it was looked at; unreadable: the look failed (a permission).
    state: CandidateState
    detail: str  # what is at the path, in words (the listener's pid and name where served)
    listed: int | None = None  # healthy devices the kubelet's pod-resources lists; None: not listed
    checkpointed: bool = False  # the kubelet's checkpoint names the resource

    @property
    def recorded(self) -> bool:
        """The kubelet's own records name the resource on this node."""
        return self.listed is not None or self.checkpointed


@dataclass(frozen=True)
class CandidateJudgement:
    """Which of the candidates the doctor judged, and why: `judged` are then judged as --plugin."""

    candidates: tuple[CandidateSocket, ...]
    judged: tuple[PluginSpec, ...]
    # served: exactly one served; several: more than one served, each judged; recorded: none served, and
    # the kubelet's records name exactly one, judged; none: nothing to judge.
    decided: Decided
    records: str = ""  # why the kubelet's records could not be read ("" where they were)
    # Sockets served in the folder of the vendor's form that are no candidate: (socket, resource).
    elsewhere: tuple[tuple[str, str], ...] = ()
    vendor: str = DEFAULT.name  # the vendor profile's name (its chart's namespace, its nodes' label)
    node: str = ""  # this node's name, for the fix's command


# -- the logs ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pattern:
    """One line of the catalogue (doctor/patterns.toml): a program's wording and what it means."""

    text: str  # the program's own wording, matched literally
    cause: str  # the row it feeds: kubelet-log, plugin-log, driver-runtime or dra-log
    meaning: str
    fix: tuple[str, ...] = ()
    source: str = ""  # where upstream it is printed
    kind: Kind = "error"
    ignore_case: bool = False
    # A more precise meaning when the same line also says one of these (checked in order).
    refine: tuple[tuple[str, str], ...] = ()
    rejects: bool = False  # the kubelet refused the Register attempt that this line follows

    def explain(self, line: str) -> str:
        """The meaning of `line`: the first refinement whose words it holds, else the pattern's own."""
        lower = line.lower()
        for needle, meaning in self.refine:
            if needle.lower() in lower:
                return meaning
        return self.meaning


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
        """The pattern's wording."""
        return self.pattern.text


@dataclass
class LogFindings:
    """What one log (a file, or the journal's units) says: its lines' hits, or why it could not be read."""

    source: str
    read: bool = False
    problem: str = ""  # why the log could not be read
    lines: int = 0  # lines read within the window
    hits: list[LogHit] = field(default_factory=list)
    registered: str = ""  # the newest line that shows a successful registration

    @property
    def current(self) -> list[LogHit]:
        """The hits no later registration followed."""
        return [h for h in self.hits if not h.history]

    @property
    def history(self) -> list[LogHit]:
        """The hits a later registration followed."""
        return [h for h in self.hits if h.history]


# -- DRA drivers -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraReading:
    """One DRA driver: the sidecar's evidence of one moment, and its judgement with no grace."""

    spec: DraSpec
    evidence: Evidence
    judgement: Judgement


# -- HAMi's own registration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HamiReading:
    """One resource's HAMi registration: the sidecar's evidence of one moment and its verdict with no
    wait for HAMi's loop (a snapshot), and the node's handshake annotation as read."""

    keys: HamiKeys
    evidence: HamiEvidence
    verdict: HamiVerdict
    handshake: str | None  # the handshake annotation's value; None when absent or the Node unread
    allocatable: int | None  # the Node's allocatable of the resource (None: absent, or unread)
    api: str  # where the Node was read from
    node: str  # the Node's name


# -- all the node's evidence -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeEvidence:
    """Everything hami-doctor read from the node, once; the rules and the repairs' plan only read it."""

    findings: tuple[Finding, ...]  # initcheck's checks of kubelet.sock, in their order
    kubelet_socket: SocketProbe
    plugins: tuple[PluginEvidence, ...]
    kubelet: KubeletProcess
    kubelet_logs: tuple[LogFindings, ...]
    plugin_logs: tuple[LogFindings, ...]
    plugin_process: PluginProcesses
    folder_sockets: tuple[SocketFile, ...]  # every socket file in the device-plugins folder
    kubelet_path: str
    checkpoint: Reading[Checkpoint]  # the kubelet's records: history, never proof of a registration now
    pod_resources: Reading[dict[str, frozenset[str]]]  # healthy device IDs by resource: live
    # What was asked for: the devices check (ANY: none; AUTO_DEVICES: the host's glob) and a leak's size.
    expect_devices: DeviceExpectation = ANY_DEVICES
    device_glob: str = ""
    host_devices: tuple[str, ...] = ()  # the glob's matches, read only for AUTO_DEVICES
    rss_growth_mib: float = 20.0
    driver: DriverNodes = DriverNodes(checked=False)
    errors: tuple[str, ...] = ()  # evidence that could not be gathered, and why
    # DRA drivers (doctor/dra/): None when --dra-driver names none.
    dra: tuple[DraReading, ...] | None = None
    dra_logs: tuple[LogFindings, ...] = ()
    # HAMi's own registration (doctor/hami.py): None when no API server is known or it is turned off.
    hami: tuple[HamiReading, ...] | None = None
    # hami-sidecar's recovery of unhealthy devices, from its /status (doctor/recovery.py): None when no
    # sidecar answers at --sidecar-status.
    recovery: Reading[Any] | None = None
    # --plugin-candidates: which of them `plugins` are, and why; None when they are not given.
    candidates: CandidateJudgement | None = None


# -- the verdicts, the repairs and the report --------------------------------------------------------------
@dataclass
class Cause:
    """One row of the report: a root cause's verdict, its evidence and its fix."""

    id: str
    verdict: Verdict
    evidence: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)
    _problems: int = field(default=0, repr=False, compare=False)

    @property
    def title(self) -> str:
        """The row's name in the report."""
        return TITLES[self.id]

    def problem(self, evidence: str, fix: Iterable[str] = ()) -> None:
        """A problem's evidence goes before every note, so that the first line is the failing check."""
        self.verdict = "problem"
        self.evidence.insert(self._problems, evidence)
        self._problems += 1
        self.fix += [f for f in fix if f not in self.fix]

    def note_first(self, evidence: str) -> None:
        """A note placed after the problems' evidence but before every other note."""
        self.evidence.insert(self._problems, evidence)

    def as_dict(self) -> dict[str, Any]:
        """The row as the report's JSON has it."""
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Repair:
    """One safe repair: removing a plugin socket file nothing listens on; applied, or why not."""

    path: str
    why: str
    command: str
    applied: bool = False
    error: str = ""
    # The judged file: (st_dev, st_ino, st_mtime_ns, st_ctime_ns).
    identity: tuple[int, int, int, int] | None = field(default=None, compare=False)

    def as_dict(self) -> dict[str, object]:
        """The repair as the report's JSON has it."""
        return {
            "path": self.path,
            "why": self.why,
            "command": self.command,
            "applied": self.applied,
            "error": self.error,
        }


@dataclass(frozen=True)
class Report:
    """The rows, the repairs and what could not be read: what every output prints."""

    causes: list[Cause]  # problems first, in causal order
    repairs: list[Repair]
    kubelet: KubeletProcess
    errors: tuple[str, ...] = ()  # evidence that could not be gathered

    @property
    def problems(self) -> list[Cause]:
        """The rows whose verdict is a problem, most likely first."""
        return [c for c in self.causes if c.verdict == "problem"]

    @property
    def exit_code(self) -> int:
        """1 when a problem was found, else 0."""
        return 1 if self.problems else 0

    def as_dict(self) -> dict[str, Any]:
        """The report's JSON document."""
        return {
            "healthy": not self.problems,
            "exit_code": self.exit_code,
            "most_likely": self.problems[0].id if self.problems else None,
            "causes": [c.as_dict() for c in self.causes],
            "repairs": [r.as_dict() for r in self.repairs],
            "kubelet": self.kubelet.as_dict(),
            "errors": list(self.errors),
        }
