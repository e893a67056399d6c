"""hami-doctor: why does this node show no GPU resource, and what fixes it.

Runs initcheck's checks and the sidecar's probes once (no second implementation of
either), adds the kubelet's version, logs and the plugin process, and prints one row
per known root cause, the most likely first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from initcheck.checks import DEFAULT_DIR, DEFAULT_SOCKET, Finding, run_checks, try_connect
from initcheck.cli import _id, _octal, options_from
from initcheck.envflags import parse_with_env
from sidecar.checkpoint import CHECKPOINT_NAME, CheckpointError, read_checkpoint
from sidecar.config import DEFAULT_DEVICE_GLOB, DEFAULT_PLUGIN, DEFAULT_POD_RESOURCES, PluginSpec, _plugin
from sidecar.logscan import (
    KUBELET_ERRORS,
    PLUGIN_ERRORS,
    LogFindings,
    plugin_log_files,
    scan_file,
    scan_journal,
)
from sidecar.probes import (
    ProbeResult,
    allocatable_devices,
    probe_kubelet,
    probe_plugin,
    registration_evidence,
)

Verdict = Literal["problem", "ok", "unknown"]

# Root causes, in the order a cause explains the ones after it: the most likely first.
CAUSES = (
    ("socket-path", "socket path mismatch"),
    ("socket-permission", "socket permission"),
    ("protocol", "API/protocol mismatch"),
    ("plugin-not-serving", "plugin not serving"),
    ("plugin-not-registered", "plugin not registered"),
    ("devices-not-registered", "devices visible, not registered"),
    ("kubelet-log", "kubelet registration errors"),
    ("plugin-log", "plugin registration errors"),
    ("plugin-growth", "plugin resource growth"),
    ("kubelet-version", "kubelet version"),
)
TITLES = dict(CAUSES)
ORDER = {cause: i for i, (cause, _) in enumerate(CAUSES)}
# A fix line starting with "$ " is a command: printed so that it pastes (wrapped with backslashes).
RESTART_PLUGIN = (
    "$ kubectl -n kube-system delete pod -l app.kubernetes.io/component=hami-device-plugin "
    "--field-selector spec.nodeName=$(hostname)"
)


@dataclass
class Cause:
    id: str
    verdict: Verdict
    evidence: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return TITLES[self.id]

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "fix": self.fix,
        }


@dataclass
class Repair:
    path: str
    why: str
    command: str
    applied: bool = False
    error: str = ""


@dataclass
class Report:
    causes: list[Cause]
    repairs: list[Repair]
    kubelet: dict[str, Any]

    @property
    def problems(self) -> list[Cause]:
        return [c for c in self.causes if c.verdict == "problem"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": not self.problems,
            "exit_code": 1 if self.problems else 0,
            "most_likely": self.problems[0].id if self.problems else None,
            "causes": [c.as_dict() for c in self.causes],
            "repairs": [vars(r) for r in self.repairs],
            "kubelet": self.kubelet,
        }


# -- evidence ------------------------------------------------------------------------------------
def kubelet_process(name: str) -> dict[str, Any]:
    """pid, version and listening paths of the kubelet, or why they are unknown."""
    from initcheck.checks import process_visible

    if not process_visible(name):
        return {"visible": False, "why": f"no process named {name} is visible (run with hostPID)"}
    from initcheck.kubelet import KubeletLookupError, find_kubelet, listening_paths

    try:
        proc = find_kubelet(name)
        listening = list(listening_paths(name).paths)
    except KubeletLookupError as e:
        return {"visible": False, "why": str(e)}
    info: dict[str, Any] = {"visible": True, "pid": proc.pid, "listening": listening, "version": None}
    try:
        out = subprocess.run(
            [f"/proc/{proc.pid}/exe", "--version"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    if m := re.search(r"Kubernetes v(\d+)\.(\d+)\.(\d+)", out):
        info["version"] = ".".join(m.groups())
    return info


def version_cause(kubelet: dict[str, Any]) -> Cause:
    version = kubelet.get("version")
    if not version:
        why = kubelet.get("why") or "the kubelet binary did not print a Kubernetes version"
        return Cause("kubelet-version", "unknown", [f"version unknown: {why}"])
    major, minor, _ = (int(x) for x in version.split("."))
    notes = [f"kubelet v{version}; device plugin API v1beta1 is the only one served"]
    if (major, minor) >= (1, 25):
        notes.append(
            "Register is synchronous since 1.25: the plugin must serve its socket before it registers"
        )
    if (major, minor) < (1, 23):
        notes.append(
            "pod-resources GetAllocatableResources needs 1.23 (GA 1.28): device counts from the checkpoint"
        )
    return Cause("kubelet-version", "ok", notes)


def initcheck_causes(findings: list[Finding]) -> tuple[Cause, Cause]:
    path = Cause("socket-path", "ok")
    perm = Cause("socket-permission", "ok")
    for f in findings:
        target = (
            perm
            if f.id
            in ("PERMISSION_DENIED", "OWNER_MISMATCH", "GROUP_MISMATCH", "MODE_MISMATCH", "MODE_TOO_OPEN")
            else path
        )
        if f.status == "fail":
            target.verdict = "problem"
            target.evidence.append(f"{f.id}: {f.path}: {f.found}")
            if f.remedy:
                target.fix.append(f.remedy)
        elif f.status == "pass":
            target.evidence.append(f.found)
        elif f.status == "warn":
            target.evidence.append(f"{f.id} (warning): {f.found}")
        elif f.status == "skip" and f.id == "PATH_MISMATCH":
            path.evidence.append(f"PATH_MISMATCH not checked: {f.found}")
    return path, perm


def protocol_cause(k: ProbeResult) -> Cause:
    if k.state == "wrong-service":
        return Cause(
            "protocol",
            "problem",
            [k.reason],
            [
                "point the plugin at the kubelet's real device-plugins folder (HAMi chart: "
                "devicePlugin.pluginPath); find who listens on the socket:",
                "$ ss -xlp | grep kubelet.sock",
            ],
        )
    if k.ok:
        return Cause("protocol", "ok", [f"kubelet.sock: {k.reason}"])
    return Cause("protocol", "unknown", [f"kubelet.sock did not answer: {k.reason}"])


@dataclass
class PluginState:
    spec: PluginSpec
    path: str
    probe: ProbeResult

    @property
    def stale(self) -> bool:
        """The socket file exists and nothing listens on it."""
        return self.probe.state == "refused"


async def gather_plugins(
    args: argparse.Namespace, plugins: list[PluginSpec]
) -> tuple[ProbeResult, list[PluginState]]:
    paths = [os.path.join(args.device_plugin_dir, p.socket) for p in plugins]
    kubelet, *results = await asyncio.gather(
        probe_kubelet(os.path.join(args.device_plugin_dir, args.kubelet_socket), args.probe_timeout),
        *(probe_plugin(path, args.probe_timeout) for path in paths),
    )
    return kubelet, [PluginState(*s) for s in zip(plugins, paths, results, strict=True)]


def serving_cause(states: list[PluginState]) -> Cause:
    cause = Cause("plugin-not-serving", "ok")
    for s in states:
        if s.probe.ok:
            cause.evidence.append(f"{s.spec.socket}: {s.probe.reason}")
            continue
        cause.verdict = "problem"
        cause.evidence.append(f"{s.spec.socket}: {s.probe.reason}")
        if s.stale:
            cause.fix += [
                "the plugin died and left its socket behind (hami-doctor --fix removes it):",
                f"$ rm {s.path}",
            ]
        cause.fix += ["check the plugin's log, then restart it:", RESTART_PLUGIN]
    cause.fix = list(dict.fromkeys(cause.fix))
    return cause


def registration_cause(
    args: argparse.Namespace,
    kubelet: ProbeResult,
    states: list[PluginState],
    pod_resources: dict[str, int] | str,
) -> tuple[Cause, Cause]:
    try:
        checkpoint: Any = read_checkpoint(os.path.join(args.device_plugin_dir, CHECKPOINT_NAME))
    except CheckpointError as e:
        checkpoint = e
    registered = Cause("plugin-not-registered", "ok")
    devices = Cause("devices-not-registered", "ok")
    host = sorted(glob.glob(args.device_glob))
    listed: dict[str, int] = {}
    for s in states:
        ev = registration_evidence(checkpoint, s.spec.resource, kubelet.identity, s.probe.identity)
        registered.evidence.append(f"{s.spec.resource}: {ev.reason}")
        if not ev.ok:
            registered.verdict = "problem"
            registered.fix += ["restart the plugin so that it registers again:", RESTART_PLUGIN]
        count = pod_resources.get(s.spec.resource) if isinstance(pod_resources, dict) else None
        listed[s.spec.resource] = count if count is not None else (ev.devices or 0)
    if not host:
        devices.verdict = "unknown" if not args.expect_devices else devices.verdict
        devices.evidence.append(f"no host device matches {args.device_glob}")
    for resource, n in listed.items():
        want = args.expect_devices or len(host)
        if want and n < want:
            devices.verdict = "problem"
            devices.evidence.append(
                f"{resource}: the host has {len(host)} device node(s) ({args.device_glob}), "
                f"the kubelet lists {n}"
            )
            devices.fix += [
                "the driver sees the GPUs, the kubelet does not: restart the plugin, and if that "
                "does not help, look in its log for devices it marks unhealthy:",
                RESTART_PLUGIN,
            ]
        elif want:
            devices.evidence.append(f"{resource}: the kubelet lists {n} of {want}")
    registered.fix = list(dict.fromkeys(registered.fix))
    devices.fix = list(dict.fromkeys(devices.fix))
    return registered, devices


def log_cause(cause_id: str, findings: list[LogFindings], fix: list[str]) -> Cause:
    readable = [f for f in findings if f.read]
    if not readable:
        why = "; ".join(f.problem for f in findings) or "no log given"
        return Cause(cause_id, "unknown", [why])
    cause = Cause(cause_id, "ok")
    for f in readable:
        if not f.errors:
            cause.evidence.append(f"{f.source}: no registration error")
            continue
        cause.verdict = "problem"
        for pattern, n in sorted(f.counts.items(), key=lambda kv: -kv[1]):
            cause.evidence.append(f"{f.source}: {n} x '{pattern}', newest: {f.last[pattern]}")
    if cause.verdict == "problem":
        cause.fix += fix
    return cause


def growth_cause(name: str, interval: float, rss_mib: float) -> Cause:
    import psutil

    procs = [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]
    if not procs:
        return Cause("plugin-growth", "unknown", [f"no process named {name} is visible (run with hostPID)"])
    cause = Cause("plugin-growth", "ok")

    def sample(p: psutil.Process) -> tuple[int, int, int] | None:
        try:
            with p.oneshot():
                return p.memory_info().rss, p.num_fds(), p.num_threads()
        except psutil.Error:
            return None

    first = {p.pid: sample(p) for p in procs}
    time.sleep(interval)
    for p in procs:
        a, b = first[p.pid], sample(p)
        if a is None or b is None:
            continue
        grown = (b[0] - a[0]) / 2**20
        try:
            uptime = time.time() - p.create_time()
        except psutil.Error:
            uptime = 0.0
        line = (
            f"pid {p.pid}: RSS {b[0] / 2**20:.0f} MiB ({grown:+.1f} in {interval:g}s), fds {b[1]} "
            f"({b[1] - a[1]:+d}), threads {b[2]} ({b[2] - a[2]:+d}), up {uptime / 3600:.1f} h"
        )
        cause.evidence.append(line)
        if grown >= rss_mib or b[1] - a[1] >= 100 or b[2] - a[2] >= 20:
            cause.verdict = "problem"
            cause.fix += [
                "a leak in the plugin: watch it, report it upstream with this evidence, restart it:",
                f"$ ps -o rss,nlwp -p {p.pid}",
                RESTART_PLUGIN,
            ]
    return cause


def plan_repairs(args: argparse.Namespace, states: list[PluginState]) -> list[Repair]:
    """Only safe, reversible repairs: stale plugin sockets nothing listens on. Never kubelet.sock,
    never the checkpoint."""
    protected = {args.kubelet_socket, CHECKPOINT_NAME}
    repairs = []
    seen = set()
    candidates = [s.path for s in states if s.stale]
    with contextlib.suppress(OSError):
        candidates += [e.path for e in os.scandir(args.device_plugin_dir) if e.name.endswith(".sock")]
    for path in candidates:
        name = os.path.basename(path)
        if name in protected or path in seen:
            continue
        seen.add(path)
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        if try_connect(path, timeout=0.2) is not None:
            repairs.append(Repair(path, "a plugin socket nothing listens on (the plugin died)", f"rm {path}"))
    return repairs


def apply_repairs(repairs: list[Repair], out: TextIO) -> None:
    for r in repairs:
        try:
            if try_connect(r.path, timeout=0.2) is None:  # something listens again: leave it
                r.error = "skipped: it accepts connections again"
            else:
                os.unlink(r.path)
                r.applied = True
        except OSError as e:
            r.error = e.strerror or str(e)
        print(f"fix: {r.command}: {'done' if r.applied else r.error}", file=out)


async def diagnose(args: argparse.Namespace) -> Report:
    plugins: list[PluginSpec] = args.plugin or [_plugin(DEFAULT_PLUGIN)]
    options = options_from(args)  # initcheck's own reading of the same flags
    path_cause, perm_cause = initcheck_causes(run_checks(options))
    kubelet, states = await gather_plugins(args, plugins)
    pod_resources = await allocatable_devices(args.pod_resources_socket, args.probe_timeout)
    registered, devices = registration_cause(args, kubelet, states, pod_resources)
    since = args.since
    kubelet_logs = (
        [scan_journal("kubelet", KUBELET_ERRORS, since)]
        if args.kubelet_log == "journal"
        else [scan_file(args.kubelet_log, KUBELET_ERRORS, since)]
        if args.kubelet_log
        else []
    )
    plugin_paths = plugin_log_files() if args.plugin_log == "auto" else [args.plugin_log]
    plugin_logs = [scan_file(p, PLUGIN_ERRORS, since) for p in plugin_paths]
    if not plugin_logs:
        plugin_logs = [LogFindings("/var/log/pods/*device-plugin*", problem="no device plugin log found")]
    kubelet_info = kubelet_process(args.kubelet_process_name)
    causes = [
        path_cause,
        perm_cause,
        protocol_cause(kubelet),
        serving_cause(states),
        registered,
        devices,
        log_cause(
            "kubelet-log",
            kubelet_logs,
            [
                "the kubelet rejected the plugin or could not dial it back; the newest lines say why:",
                "$ journalctl -u kubelet --since -1h | grep -i 'device plugin'",
            ],
        ),
        log_cause(
            "plugin-log",
            plugin_logs,
            [
                "the plugin could not register: start it only once the kubelet listens (the hami-initcheck "
                "init container with --wait 60), then restart it:",
                RESTART_PLUGIN,
            ],
        ),
        await asyncio.to_thread(
            growth_cause, args.plugin_process_name, args.sample_interval, args.rss_growth_mib
        ),
        version_cause(kubelet_info),
    ]
    # The same causal order, problems first.
    causes.sort(key=lambda c: (c.verdict != "problem", ORDER[c.id]))
    return Report(causes, plan_repairs(args, states), kubelet_info)


# -- output ------------------------------------------------------------------------------------------
WIDTH = 80


def print_text(report: Report, fixing: bool, out: TextIO) -> None:
    """A table that reads in 80 columns: one row per cause, problems first with evidence and fixes."""
    problems = report.problems
    if problems:
        print(f"hami-doctor: {len(problems)} problem(s) found; the most likely cause first", file=out)
    else:
        print("hami-doctor: no problem found; the kubelet sees the device plugin", file=out)
    print(f"\n{'#':>2}  {'CAUSE':<31} {'VERDICT':<8} {'EVIDENCE'}", file=out)
    wrap = textwrap.TextWrapper(
        width=WIDTH,
        initial_indent=" " * 4,
        subsequent_indent=" " * 6,
        break_on_hyphens=False,
    )
    room = WIDTH - 45  # after "NN  CAUSE (31) VERDICT (8) "
    for i, c in enumerate(report.causes, 1):
        verdict = "PROBLEM" if c.verdict == "problem" else c.verdict
        summary = "; ".join(c.evidence)
        if len(summary) > room:
            summary = summary if len(summary) <= room else summary[: room - 1] + "…"
        print(f"{i:>2}  {c.title:<31} {verdict:<8} {summary}".rstrip(), file=out)
        if c.verdict == "problem":
            for line in c.evidence:
                print(wrap.fill(line), file=out)
            for f in c.fix:
                print(shell_lines(f[2:]) if f.startswith("$ ") else wrap.fill("fix: " + f), file=out)
    if report.repairs and not fixing:
        print("\nrepairs (hami-doctor --fix applies these and nothing else):", file=out)
        for r in report.repairs:
            print(wrap.fill(f"# {r.why}"), file=out)
            print(shell_lines(r.command), file=out)


def shell_lines(command: str, indent: int = 6) -> str:
    """A command wrapped at 80 columns with backslashes, so that it still pastes into a shell."""
    lines, line = [], ""
    for word in command.split(" "):
        if line and indent + len(line) + 1 + len(word) > WIDTH - 2:
            lines.append(line + " \\")
            line = "  " + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(" " * indent + ln for ln in [*lines, line])


def npd_line(report: Report) -> str:
    if not report.problems:
        return "hami-doctor: the device plugin is registered"
    c = report.problems[0]
    return f"{c.title}: {c.evidence[0] if c.evidence else 'problem'}"[:200]


# -- command line ---------------------------------------------------------------------------------------
def _duration(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", value.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m, 2h, got {value!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hami-doctor",
        description="Diagnose why this node shows no GPU resource, and print the fix. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin.",
        epilog="exit codes: 0 healthy, 1 a problem was found, 2 usage error (with --npd: 2 unknown)",
    )
    p.add_argument("--device-plugin-dir", default=DEFAULT_DIR)
    p.add_argument("--kubelet-socket", default=DEFAULT_SOCKET)
    p.add_argument(
        "--plugin", action="append", type=_plugin, help=f"RESOURCE=SOCKET (default {DEFAULT_PLUGIN})"
    )
    p.add_argument("--pod-resources-socket", default=DEFAULT_POD_RESOURCES)
    p.add_argument("--probe-timeout", type=float, default=2.0)
    p.add_argument("--plugin-uid", type=_id)
    p.add_argument("--plugin-gid", type=_id)
    p.add_argument("--expect-owner", type=_id)
    p.add_argument("--expect-group", type=_id)
    p.add_argument("--expect-mode", type=_octal)
    p.add_argument("--device-glob", default=DEFAULT_DEVICE_GLOB)
    p.add_argument(
        "--expect-devices", type=int, default=0, help="N devices expected (default: count the glob)"
    )
    p.add_argument("--kubelet-log", default="journal", help="a file, or journal (journalctl -u kubelet)")
    p.add_argument("--plugin-log", default="auto", help="a file, or auto (/var/log/pods/*device-plugin*)")
    p.add_argument("--since", type=_duration, default=3600.0, help="log window (default 1h)")
    p.add_argument("--kubelet-process-name", default="kubelet")
    p.add_argument("--plugin-process-name", default="nvidia-device-plugin")
    p.add_argument(
        "--sample-interval", type=float, default=2.0, help="seconds between two samples of the plugin"
    )
    p.add_argument(
        "--rss-growth-mib", type=float, default=20.0, help="RSS growth between samples that is a problem"
    )
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.add_argument("--fix", action="store_true", help="apply the safe repairs the report lists")
    p.add_argument("--npd", action="store_true", help="one line and node-problem-detector's exit codes")
    p.set_defaults(connect=True, strict=False)  # initcheck's checks, as the init container runs them
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = build_parser()
    args = parse_with_env(parser, sys.argv[1:] if argv is None else argv)
    try:
        report = asyncio.run(diagnose(args))
        if args.fix:
            apply_repairs(report.repairs, out if not args.npd and args.output == "text" else sys.stderr)
    except Exception as e:  # an internal error is NPD's Unknown, never a traceback
        if args.npd:
            print(f"hami-doctor could not diagnose: {type(e).__name__}: {e}"[:200], file=out)
            return 2
        raise
    code = 1 if report.problems else 0
    if args.npd:
        print(npd_line(report), file=out)
    elif args.output == "json":
        print(json.dumps(report.as_dict(), indent=2), file=out)
    else:
        print_text(report, args.fix, out)
    return code


def run() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    run()
