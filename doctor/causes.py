"""The rules: each known root cause judged from `NodeEvidence` alone, with its evidence and its fix.

Pure functions, no I/O: a test builds the evidence by hand and checks every branch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from doctor.candidates import candidates_cause
from doctor.dra.causes import dra_causes
from doctor.hami import hami_causes
from doctor.patterns import (
    ALREADY_CONNECTED,
    DRIVER_FIX,
    NO_DRIVER_ERROR,
    OTHER_PLUGIN_FIX,
    RESTART_PLUGIN,
    RUNTIME_FIX,
)
from doctor.recovery import recovery_cause
from doctor.shell import command
from doctor.types import (
    CANDIDATE_CAUSES,
    CAUSES,
    DRA_CAUSES,
    HAMI_CAUSES,
    RECOVERY_CAUSES,
    Cause,
    DriverNodes,
    KubeletProcess,
    LogFindings,
    LogHit,
    NodeEvidence,
    PluginEvidence,
    PluginProcesses,
    SocketProbe,
)
from hami_guard.flags import AUTO_DEVICES, Expect
from initcheck.checks import Finding
from sidecar.deviceplugin.evidence import accepted_devices, iso, not_held_reason, unrecorded_connection
from sidecar.deviceplugin.naming import matching_plugins, physical_devices, pick_found, socket_found_instead

ORDER = {cause: i for i, (cause, _) in enumerate(CAUSES)}
# --plugin-candidates' row right after driver-runtime (a plugin that cannot reach its device may serve
# nothing), before every row of the plugins it decides on.
_RANKED = [c for c, _ in CAUSES + DRA_CAUSES + HAMI_CAUSES + RECOVERY_CAUSES]
_RANKED.insert(_RANKED.index("driver-runtime") + 1, CANDIDATE_CAUSES[0][0])
RANK = {cause: i for i, cause in enumerate(_RANKED)}
# initcheck's checks that are about permission; the others are about the socket's path.
PERMISSION_CHECKS = frozenset(
    ("PERMISSION_DENIED", "OWNER_MISMATCH", "GROUP_MISMATCH", "MODE_MISMATCH", "MODE_TOO_OPEN")
)
# A fix line starting with "$ " is a command: printed so that it pastes (wrapped with backslashes).
DRIVER_FIRST = (
    "the GPU driver or container runtime problem above explains this: fix it first, restarting the "
    "plugin alone does not help"
)
REREGISTER_FIX = ("restart the plugin so that it registers again:", RESTART_PLUGIN)
# The kubelet refused a Register at a path it holds (the catalogue's "already connected" refinement).
REFUSED_FIX = (
    "a plugin restart is refused the same way: restart the kubelet, then the plugin registers again "
    "(HAMi does when kubelet.sock is created); never run two instances of the plugin on one socket path",
    "$ systemctl restart kubelet",
)
UNRECORDED_FIX = (
    "run hami-doctor again in a few seconds: a Register under way has its device list recorded by then",
    "if it stays so, the kubelet refused the Register: restart the plugin; on Kubernetes 1.37 a kubelet "
    "restart clears the refused state",
    RESTART_PLUGIN,
)
# The rows of the judged plugins: with candidates and none judged, they judge nothing.
NO_PLUGIN_ROWS = frozenset(
    ("socket-owner", "plugin-not-serving", "plugin-not-registered", "socket-name", "devices-not-registered")
)
# Growth between two samples that no healthy plugin shows.
FD_GROWTH = 100
THREAD_GROWTH = 20


def diagnose(e: NodeEvidence) -> list[Cause]:
    """One row per root cause: problems first, each group in causal order."""
    path, permission = initcheck_causes(e.findings)
    causes = [
        path,
        permission,
        protocol_cause(e.kubelet_socket),
        driver_cause(e.plugin_logs, e.driver),
        owner_cause(e.plugins),
        serving_cause(e.plugins),
        registration_cause(e),
        devices_cause(e),
        log_cause("kubelet-log", e.kubelet_logs),
        log_cause("plugin-log", e.plugin_logs),
        growth_cause(e.plugin_process, e.rss_growth_mib),
        version_cause(e.kubelet),
        socket_name_cause(e),
    ]
    driver = causes[3]
    if driver.verdict == "problem":  # restarting a plugin that cannot see a GPU mends nothing
        for c in causes[5:8]:
            if c.verdict == "problem":
                c.fix = [DRIVER_FIRST]
    if e.dra is not None:
        causes += dra_causes(e.dra, e.dra_logs, e.kubelet.version)
    if e.hami is not None:
        causes += hami_causes(e.hami, e.plugin_logs)
    if e.recovery is not None:
        causes.append(recovery_cause(e.recovery))
    if e.candidates is not None:
        causes.append(candidates_cause(e.candidates))
        if not e.plugins:  # the rows of the plugins judge none: not "ok"
            for c in causes:
                if c.id in NO_PLUGIN_ROWS:
                    c.verdict, c.evidence = "unknown", ["no plugin judged: none of the candidates is served"]
    causes.sort(key=lambda c: (c.verdict != "problem", RANK[c.id]))
    return causes


def initcheck_causes(findings: Iterable[Finding]) -> tuple[Cause, Cause]:
    """initcheck's checks of kubelet.sock, as two rows: its path (socket-path) and its permission."""
    path = Cause("socket-path", "ok")
    perm = Cause("socket-permission", "ok")
    for f in findings:
        target = perm if f.id in PERMISSION_CHECKS else path
        if f.status == "fail":
            target.problem(f"{f.id}: {f.path}: {f.found}", [f.remedy] if f.remedy else [])
        elif f.status == "pass":
            target.evidence.append(f.found)
        elif f.status == "warn":
            target.evidence.append(f"{f.id} (warning): {f.found}")
        elif f.status == "skip" and f.id == "PATH_MISMATCH":
            path.evidence.append(f"PATH_MISMATCH not checked: {f.found}")
        # Processes of a kubelet's name that are not the kubelet: named, never judged by.
        path.evidence += [f"{f.id}: ignored {ignored}" for ignored in f.ignored]
    return path, perm


def socket_name_cause(e: NodeEvidence) -> Cause:
    """A plugin's socket missing while a device plugin serves another in the folder: HAMi installed with
    another resourceName (another name, another socket: the vendor profile's) than --plugin says."""
    cause = Cause("socket-name", "ok")
    configured = {p.spec.socket for p in e.plugins} | {os.path.basename(e.kubelet_path)}
    served = [
        name for s in e.folder_sockets if s.listening and (name := os.path.basename(s.path)) not in configured
    ]
    specs = tuple(p.spec for p in e.plugins)
    for p in e.plugins:
        if p.probe.state != "absent":
            cause.evidence.append(f"{p.spec.socket}: exists")
            continue
        found = pick_found(p.spec, served)
        if found is None:
            cause.evidence.append(f"{p.spec.socket} is missing, and no other socket is served in the folder")
            continue
        fixed = matching_plugins(specs, p.spec, found)
        value = ",".join(f"{s.resource}={s.socket}" for s in fixed)
        flags = " ".join(f"--plugin {s.resource}={s.socket}" for s in fixed)
        cause.problem(
            f"{p.spec.socket} does not exist; {socket_found_instead(specs, p.spec, found)}",
            [
                "the plugin serves another socket than hami-guard was told: give the sidecar (and "
                "hami-doctor) the plugin setting that matches it, or install HAMi with the resourceName "
                "the setting names:",
                "$ "
                + command(
                    "kubectl",
                    "-n",
                    "kube-system",
                    "set",
                    "env",
                    "daemonset/hami-device-plugin",
                    "-c",
                    "hami-sidecar",
                    f"HAMI_GUARD_PLUGIN={value}",
                ),
                f"hami-doctor {flags}",
            ],
        )
    if not e.plugins:
        cause.verdict = "unknown"
    return cause


def protocol_cause(kubelet: SocketProbe) -> Cause:
    """kubelet.sock answers as the kubelet's v1beta1 registration service, not another one."""
    if kubelet.state == "wrong-service":
        return Cause(
            "protocol",
            "problem",
            [kubelet.reason],
            [
                "point the plugin at the kubelet's real device-plugins folder (HAMi chart: "
                "devicePlugin.pluginPath); find who listens on the socket:",
                "$ ss -xlp | grep kubelet.sock",
            ],
        )
    if kubelet.ok:
        return Cause("protocol", "ok", [f"kubelet.sock: {kubelet.reason}"])
    return Cause("protocol", "unknown", [f"kubelet.sock did not answer: {kubelet.reason}"])


def driver_cause(plugin_logs: Sequence[LogFindings], nodes: DriverNodes) -> Cause:
    """The plugin cannot reach a GPU: its driver errors, or no device nodes of the vendor's on the host."""
    cause = Cause("driver-runtime", "ok")
    hits = [(f, h) for f in plugin_logs if f.read for h in f.current if h.pattern.cause == "driver-runtime"]
    for f, h in hits:
        fix: Sequence[str] = h.pattern.fix
        if "container runtime" in h.meaning:
            fix = RUNTIME_FIX
        elif "kernel driver" in h.meaning or "kernel module" in h.meaning:
            fix = DRIVER_FIX
        elif h.text.startswith("No devices found") and nodes.checked:
            # GPUs on the host, none in the container: the runtime; none on the host: the driver.
            fix = RUNTIME_FIX if nodes.gpus else DRIVER_FIX
        cause.problem(_hit_line(f.source, h), fix)
    if nodes.checked:
        if not nodes.control:
            cause.problem(
                f"no {nodes.folder}/{nodes.control_node} on the host: the {nodes.vendor} driver is not "
                "loaded, or this node has no GPU",
                DRIVER_FIX,
            )
        else:
            cause.evidence.append(
                f"{nodes.folder}/{nodes.control_node} and {len(nodes.gpus)} GPU device node(s) on the host"
            )
    for f in plugin_logs:
        for h in f.history:
            if h.pattern.cause == "driver-runtime":
                cause.evidence.append("history: " + _hit_line(f.source, h))
    if cause.verdict == "ok" and not nodes.checked and not any(f.read and f.lines for f in plugin_logs):
        cause.verdict = "unknown"
        cause.evidence.append(
            "no plugin log line was read, and the host's device nodes were not checked "
            "(--expect-devices auto with --device-glob on the host's /dev)"
        )
    elif cause.verdict == "ok" and not cause.evidence:
        cause.evidence.append(NO_DRIVER_ERROR)
    return cause


def owner_cause(plugins: Sequence[PluginEvidence]) -> Cause:
    """Another process's listener behind the plugin's socket file: a second plugin took the socket."""
    cause = Cause("socket-owner", "ok")
    unknown = []
    for p in plugins:
        line = f"{p.spec.socket}: {p.owner.reason}"
        if p.owner.verdict == "elsewhere":
            cause.problem(line, OTHER_PLUGIN_FIX)
        elif p.owner.verdict == "this-pod":
            cause.evidence.append(line)
        else:
            unknown.append(line)
    if cause.verdict == "ok" and unknown:
        cause.verdict = "unknown"
    cause.evidence += unknown
    return cause


def serving_cause(plugins: Sequence[PluginEvidence]) -> Cause:
    """Each plugin answers on its socket; a dead socket file left behind is named, with its removal."""
    cause = Cause("plugin-not-serving", "ok")
    for p in plugins:
        line = f"{p.spec.socket}: {p.probe.reason}"
        if p.probe.ok:
            cause.evidence.append(line)
            continue
        stale = (
            [
                "the plugin died and left its socket behind (hami-doctor --fix removes it):",
                "$ " + command("rm", "--", p.probe.path),
            ]
            if p.probe.stale
            else []
        )
        cause.problem(line, [*stale, "check the plugin's log, then restart it:", RESTART_PLUGIN])
    return cause


@dataclass(frozen=True)
class Registration:
    """Whether the kubelet holds a plugin now: True, False, or None when it cannot be told; and why."""

    held: bool | None
    why: str
    fix: tuple[str, ...] = ()


def registration(p: PluginEvidence, e: NodeEvidence) -> Registration:
    """Judged as the sidecar judges `registered:` (docs/design.md#registration), from one look.

    The kubelet's live connection to the plugin's socket first; where it cannot be seen, pod-resources
    (live); the checkpoint is history: it dates an acceptance, and is not rewritten when the kubelet
    drops a plugin (kubernetes issues 121994, 131013).
    """
    cp, plugin = e.checkpoint.value, p.probe.identity
    accepted = accepted_devices(cp, p.spec.resource, plugin, e.kubelet_socket.identity)
    if p.connections.value is not None:
        return _by_connections(p, e, p.connections.value, accepted)
    return _without_connections(p, e, accepted)


def _by_connections(p: PluginEvidence, e: NodeEvidence, conns: int, accepted: int | None) -> Registration:
    """The kubelet's connections to the plugin's socket are seen: held, dropped, or refused."""
    r, sock = p.spec.resource, p.spec.socket
    cp, live = e.checkpoint.value, e.pod_resources.value
    if unrecorded_connection(conns, cp, accepted) and (refused := _refused_at(sock, e)):
        # 1.37's stale endpoint: the kubelet keeps an earlier plugin's endpoint at the path (its end went
        # unnoticed after a refusal forgot its client) and refuses this one's Register.
        healthy = len(physical_devices(live.get(r, ()))) if live is not None else 0
        phantom = (
            f"; pod-resources lists {healthy} healthy device(s) of {r} with no stream of this socket behind "
            "them (phantom capacity: Pods admitted to them fail in Allocate)"
            if healthy
            else ""
        )
        return Registration(
            False,
            f"the kubelet is connected to {sock} but recorded no device list from it, and its log says it "
            f"refused the Register there ({refused}): it keeps the endpoint of an earlier plugin at that "
            f"path and refuses the path until it restarts (Kubernetes 1.37){phantom}",
            REFUSED_FIX,
        )
    if unrecorded_connection(conns, cp, accepted):
        return Registration(
            False,
            f"the kubelet is connected to {sock} but has recorded no device list from it since the "
            "socket was created (a Register under way, or refused; a kubelet restart clears the "
            "refused state on Kubernetes 1.37)",
            UNRECORDED_FIX,
        )
    refused = _refused_at(sock, e)
    if conns > 0 and refused:
        return Registration(
            False,
            f"the kubelet holds a connection to {sock}, but its log says it refused a later Register "
            f"there ({refused}): it forgot the client of the stream it holds, whose end goes unnoticed, "
            "and refuses the path until it restarts (Kubernetes 1.37)",
            REFUSED_FIX,
        )
    if conns > 0 and live is not None and not live.get(r) and accepted:
        # The kubelet marked the devices unhealthy itself, which it does only when it drops the
        # plugin: a plugin that reports them unhealthy rewrites the checkpoint too.
        return Registration(
            False,
            f"the kubelet holds a connection to {sock}, but pod-resources lists no device of {r} "
            f"although its checkpoint, written since the socket was created, records {accepted} "
            "healthy: it dropped the plugin (a connection is not a stream; kubernetes issue 121994)",
            REREGISTER_FIX,
        )
    if conns > 0:  # zero devices, or only unhealthy ones, while held is registered
        return Registration(True, f"the kubelet holds a connection to {sock}{_device_note(r, e, accepted)}")
    if cp is not None and accepted is not None:
        return Registration(
            False,
            f"the kubelet is no longer connected to {sock}, though its checkpoint recorded {accepted} "
            f"healthy device(s) from it at {iso(cp.mtime_ns / 1e9)} (history): it dropped the plugin, "
            "which keeps serving (kubernetes issues 121994, 131013)",
            REREGISTER_FIX,
        )
    why = not_held_reason(e.checkpoint, r, p.probe.identity, None)
    return Registration(False, f"the kubelet holds no connection to {sock}: {why}", REREGISTER_FIX)


def _without_connections(p: PluginEvidence, e: NodeEvidence, accepted: int | None) -> Registration:
    """The kubelet's connections cannot be seen: pod-resources (live), else the checkpoint (history)."""
    r = p.spec.resource
    cp, live = e.checkpoint.value, e.pod_resources.value
    unseen = f"the kubelet's connections cannot be seen: {p.connections.error}"
    if live is not None and live.get(r):
        n = len(physical_devices(live[r]))
        return Registration(True, f"pod-resources lists {n} healthy device(s) of {r} ({unseen})")
    listing = "pod-resources lists none" if live is not None else e.pod_resources.error
    if cp is None and not e.checkpoint.error.startswith("no checkpoint"):
        return Registration(None, f"cannot be told: {unseen}; {listing}; {e.checkpoint.error}")
    if accepted is None:
        why = not_held_reason(e.checkpoint, r, p.probe.identity, None)
        return Registration(False, f"{why} ({unseen})", REREGISTER_FIX)
    if live is not None and accepted:
        return Registration(
            False,
            f"pod-resources lists no device of {r} although the kubelet recorded {accepted} healthy: it "
            f"dropped the plugin ({unseen})",
            REREGISTER_FIX,
        )
    assert cp is not None  # accepted_devices() read it
    return Registration(
        None,
        f"the kubelet's checkpoint recorded {accepted} healthy device(s) of {r} at "
        f"{iso(cp.mtime_ns / 1e9)}, since both sockets were made; that is history (it is not rewritten when "
        f"the kubelet drops a plugin) and nothing live tells whether the kubelet holds it now ({unseen}; "
        f"{listing})",
    )


def _refused_at(sock: str, e: NodeEvidence) -> str:
    """The kubelet log's newest current refusal of a Register at `sock`'s path ("device plugin already
    connected: <path>", Kubernetes 1.37), or "": none, or a registration followed it (history)."""
    for f in e.kubelet_logs:
        for h in f.hits:
            if not h.history and ALREADY_CONNECTED in h.newest and f"/{sock}" in h.newest:
                return h.newest
    return ""


def _device_note(r: str, e: NodeEvidence, accepted: int | None) -> str:
    live = e.pod_resources.value
    n = len(physical_devices(live.get(r, ()))) if live is not None else accepted
    if n is None:
        return ""
    where = "pod-resources lists" if live is not None else "its checkpoint recorded"
    return (
        f"; {where} {n} healthy device(s)" if n else f"; {where} no healthy device (registered all the same)"
    )


def registration_cause(e: NodeEvidence) -> Cause:
    """Each plugin is held by the kubelet now (`registration`); unknown where that cannot be told."""
    cause = Cause("plugin-not-registered", "ok")
    unknown = []
    for p in e.plugins:
        found = registration(p, e)
        line = f"{p.spec.resource}: {found.why}"
        if found.held is None:
            unknown.append(line)
        elif found.held:
            cause.evidence.append(line)
        else:
            cause.problem(line, found.fix)
    if cause.verdict == "ok" and unknown:
        cause.verdict = "unknown"
    cause.evidence += unknown
    return cause


def listed(p: PluginEvidence, e: NodeEvidence) -> int:
    """Healthy physical devices the kubelet lists now: pod-resources when it answers, else the checkpoint
    when written since kubelet.sock was made (an older one is not this kubelet's: never counted)."""
    r, live, cp = p.spec.resource, e.pod_resources.value, e.checkpoint.value
    if live is not None:
        return len(physical_devices(live.get(r, ())))
    kubelet = e.kubelet_socket.identity
    devices = cp.devices(r) if cp is not None else None
    if devices is None or kubelet is None or cp is None or cp.mtime_ns < kubelet.mtime_ns:
        return 0
    return len(physical_devices(devices))


def devices_cause(e: NodeEvidence) -> Cause:
    """With --expect-devices (N, or auto: the host's device nodes), the kubelet lists at least that many."""
    plugins, expect, device_glob, host = e.plugins, e.expect_devices, e.device_glob, e.host_devices
    counts = {p.spec.resource: listed(p, e) for p in plugins}
    cause = Cause("devices-not-registered", "ok")
    listing = "; ".join(f"{r}: the kubelet lists {n}" for r, n in counts.items())
    if expect.kind is Expect.ANY:
        cause.verdict = "unknown"
        cause.evidence.append(f"not checked: give --expect-devices N, or auto to count {device_glob}")
        if listing:
            cause.evidence.append(listing)
        return cause
    if expect == AUTO_DEVICES and not host:
        cause.verdict = "unknown"
        cause.evidence.append(f"no host device matches {device_glob}")
        return cause
    want = len(host) if expect == AUTO_DEVICES else expect.count
    source = (
        f"the host has {want} device node(s) ({device_glob})"
        if expect == AUTO_DEVICES
        else (f"{want} device(s) expected (--expect-devices)")
    )
    for p in plugins:
        n = counts[p.spec.resource]
        if n < want:
            cause.problem(
                f"{p.spec.resource}: {source}, the kubelet lists {n}",
                [
                    "the driver sees the GPUs, the kubelet does not: restart the plugin, and if that "
                    "does not help, look in its log for devices it marks unhealthy:",
                    RESTART_PLUGIN,
                ],
            )
        else:
            cause.evidence.append(f"{p.spec.resource}: the kubelet lists {n} of {want}")
    return cause


def _hit_line(source: str, h: LogHit) -> str:
    return f"{source}: {h.count} x '{h.text}': {h.meaning}; newest: {h.newest}"


def log_cause(cause_id: str, findings: Sequence[LogFindings]) -> Cause:
    """Each current error line of this row's patterns is a problem with its own fix; an error a later
    registration followed is history. A log of which no line could be read is unknown, never ok."""
    readable = [f for f in findings if f.read and f.lines]
    if not readable:
        why = "; ".join(f.problem or f"{f.source}: no line could be read" for f in findings) or "no log given"
        return Cause(cause_id, "unknown", [why])
    cause = Cause(cause_id, "ok")
    for f in readable:
        mine = [h for h in f.hits if h.pattern.cause == cause_id]
        for h in mine:
            if h.history:
                cause.evidence.append(f"history (registered since): {_hit_line(f.source, h)}")
            else:
                refused = ALREADY_CONNECTED in h.newest  # a plugin restart is no fix for that one
                cause.problem(_hit_line(f.source, h), REFUSED_FIX if refused else h.pattern.fix)
        if not any(not h.history for h in mine):
            last = f"; newest registration: {f.registered}" if f.registered else ""
            cause.note_first(f"{f.source}: no current registration error{last}")
    return cause


def growth_cause(processes: PluginProcesses, rss_growth_mib: float) -> Cause:
    """The plugin's memory, descriptors and threads between two samples: a growth no healthy plugin shows."""
    if not processes.visible:
        return Cause(
            "plugin-growth", "unknown", [f"no process named {processes.name} is visible (run with hostPID)"]
        )
    cause = Cause("plugin-growth", "ok")
    for g in processes.growth:
        a, b = g.first, g.second
        line = (
            f"pid {g.pid}: RSS {b.rss / 2**20:.0f} MiB ({g.rss_mib:+.1f} in {g.interval:.1f}s), fds {b.fds} "
            f"({b.fds - a.fds:+d}), threads {b.threads} ({b.threads - a.threads:+d}), "
            f"up {g.uptime / 3600:.1f} h"
        )
        if (
            g.rss_mib >= rss_growth_mib
            or b.fds - a.fds >= FD_GROWTH
            or b.threads - a.threads >= THREAD_GROWTH
        ):
            cause.problem(
                line,
                [
                    "a leak in the plugin: watch it, report it upstream with this evidence, restart it:",
                    f"$ ps -o rss,nlwp -p {g.pid}",
                    RESTART_PLUGIN,
                ],
            )
        else:
            cause.evidence.append(line)
    return cause


def version_cause(kubelet: KubeletProcess) -> Cause:
    """What really changed between kubelet versions for a device plugin (docs/kubelet.md#versions)."""
    if not kubelet.version:
        why = kubelet.why or "the kubelet binary did not print a Kubernetes version"
        return Cause("kubelet-version", "unknown", [f"version unknown: {why}"])
    major, minor, _ = (int(x) for x in kubelet.version.split("."))
    where = (
        f" (inside {kubelet.process}, {kubelet.distribution})"
        if kubelet.process not in ("", "kubelet")
        else ""
    )
    notes = [f"kubelet v{kubelet.version}{where}; device plugin API v1beta1 is the only one served"]
    if (major, minor) >= (1, 25):
        notes.append(
            "Register is synchronous since 1.25: the plugin must serve its socket before it registers"
        )
    if (major, minor) < (1, 23):
        notes.append(
            "pod-resources GetAllocatableResources needs 1.23 (GA 1.28): device counts from the checkpoint"
        )
    return Cause("kubelet-version", "ok", notes)
