"""Everything hami-doctor reads from the node, once, into one typed `NodeEvidence`.

This is the only module of the doctor that does I/O to learn about the node: initcheck's
checks, the sidecar's probes and its reading of the kubelet's records (the same code,
not a second implementation), the host's device nodes, the logs, the kubelet's and the
plugin's processes, and the sockets in the device-plugins folder. The rules
(`doctor.causes`) and the repairs' plan (`doctor.repairs`) only read the result.
psutil is imported inside functions, so a broken psutil is a diagnosis error the CLI
reports (NPD's Unknown), not a failed import.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from doctor.logscan import (
    KUBELET_ERRORS,
    PLUGIN_ERRORS,
    LogFindings,
    plugin_log_files,
    scan_file,
    scan_journal,
)
from doctor.settings import DoctorSettings
from initcheck.checks import Finding, options_for, run_checks, try_connect
from initcheck.flags import AUTO_DEVICES, PluginSpec
from initcheck.proc import process_visible
from sidecar.checkpoint import CHECKPOINT_NAME, Checkpoint, CheckpointError, read_checkpoint
from sidecar.probes import (
    ProbeResult,
    allocatable_devices,
    probe_kubelet,
    probe_plugin,
    registration_evidence,
)


@dataclass(frozen=True)
class SocketProbe:
    """One gRPC probe of a socket, as the sidecar judged it."""

    path: str
    state: str  # alive, absent, not-socket, refused, timeout, wrong-service, error
    reason: str

    @property
    def ok(self) -> bool:
        return self.state == "alive"

    @property
    def stale(self) -> bool:
        """The socket file exists and nothing listens on it."""
        return self.state == "refused"


@dataclass(frozen=True)
class PluginEvidence:
    spec: PluginSpec
    probe: SocketProbe
    registered: bool  # the kubelet's records show it accepted the plugin since both sockets were made
    registration: str  # why, in a sentence
    listed: int  # devices the kubelet lists: pod-resources' count when it answered, else the checkpoint's


@dataclass(frozen=True)
class KubeletProcess:
    visible: bool
    why: str = ""  # why it is not visible
    pid: int | None = None
    version: str | None = None  # "1.29.3", or None when the binary did not say
    listening: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        if not self.visible:
            return {"visible": False, "why": self.why}
        return {"visible": True, "pid": self.pid, "listening": list(self.listening), "version": self.version}


@dataclass(frozen=True)
class ProcessSample:
    rss: int  # bytes
    fds: int
    threads: int


@dataclass(frozen=True)
class ProcessGrowth:
    """Two samples of one plugin process, `interval` seconds apart."""

    pid: int
    first: ProcessSample
    second: ProcessSample
    interval: float
    uptime: float  # seconds

    @property
    def rss_mib(self) -> float:
        return (self.second.rss - self.first.rss) / 2**20


@dataclass(frozen=True)
class PluginProcesses:
    name: str
    visible: bool
    growth: tuple[ProcessGrowth, ...] = ()


@dataclass(frozen=True)
class SocketFile:
    path: str
    listening: bool  # connect() was accepted


@dataclass(frozen=True)
class NodeEvidence:
    findings: tuple[Finding, ...]  # initcheck's checks of kubelet.sock, in their order
    kubelet_socket: SocketProbe
    plugins: tuple[PluginEvidence, ...]
    kubelet: KubeletProcess
    kubelet_logs: tuple[LogFindings, ...]
    plugin_logs: tuple[LogFindings, ...]
    plugin_process: PluginProcesses
    folder_sockets: tuple[SocketFile, ...]  # every socket file in the device-plugins folder
    kubelet_path: str
    # What was asked for: the devices check (None: none; AUTO_DEVICES: the host's glob) and a leak's size.
    expect_devices: int | None = None
    device_glob: str = ""
    host_devices: tuple[str, ...] = ()  # the glob's matches, read only for AUTO_DEVICES
    rss_growth_mib: float = 20.0


async def gather(s: DoctorSettings) -> NodeEvidence:
    options = options_for(
        s.kubelet_path,
        plugin_uid=s.plugin_uid,
        plugin_gid=s.plugin_gid,
        expect_owner=s.expect_owner,
        expect_group=s.expect_group,
        expect_mode=s.expect_mode,
        kubelet_process=s.kubelet_process_name,
    )
    findings = tuple(run_checks(options))  # as the init container runs them: connect, not strict
    paths = [s.plugin_path(p) for p in s.plugins]
    kubelet, *probes = await asyncio.gather(
        probe_kubelet(s.kubelet_path, s.probe_timeout),
        *(probe_plugin(path, s.probe_timeout) for path in paths),
    )
    pod_resources = await allocatable_devices(s.pod_resources_socket, s.probe_timeout)
    try:
        checkpoint: Checkpoint | CheckpointError = read_checkpoint(
            os.path.join(s.device_plugin_dir, CHECKPOINT_NAME)
        )
    except CheckpointError as e:
        checkpoint = e
    plugins = tuple(
        _plugin_evidence(
            spec, path, probe=probe, kubelet=kubelet, checkpoint=checkpoint, pod_resources=pod_resources
        )
        for spec, path, probe in zip(s.plugins, paths, probes, strict=True)
    )
    return NodeEvidence(
        findings=findings,
        kubelet_socket=_socket_probe(s.kubelet_path, kubelet),
        plugins=plugins,
        kubelet=kubelet_process(s.kubelet_process_name),
        kubelet_logs=tuple(kubelet_logs(s.kubelet_log, s.since)),
        plugin_logs=tuple(plugin_logs(s.plugin_log, s.since)),
        plugin_process=await asyncio.to_thread(sample_processes, s.plugin_process_name, s.sample_interval),
        folder_sockets=tuple(folder_sockets(s.device_plugin_dir)),
        kubelet_path=os.path.abspath(s.kubelet_path),
        expect_devices=s.expect_devices,
        device_glob=s.device_glob,
        host_devices=tuple(sorted(glob.glob(s.device_glob))) if s.expect_devices == AUTO_DEVICES else (),
        rss_growth_mib=s.rss_growth_mib,
    )


def _socket_probe(path: str, result: ProbeResult) -> SocketProbe:
    return SocketProbe(path, result.state, result.reason)


def _plugin_evidence(
    spec: PluginSpec,
    path: str,
    *,
    probe: ProbeResult,
    kubelet: ProbeResult,
    checkpoint: Checkpoint | CheckpointError,
    pod_resources: dict[str, int] | str,
) -> PluginEvidence:
    ev = registration_evidence(checkpoint, spec.resource, kubelet.identity, probe.identity)
    count = pod_resources.get(spec.resource) if isinstance(pod_resources, dict) else None
    return PluginEvidence(
        spec=spec,
        probe=_socket_probe(path, probe),
        registered=ev.ok,
        registration=ev.reason,
        listed=count if count is not None else (ev.devices or 0),
    )


def kubelet_process(name: str) -> KubeletProcess:
    """pid, version and listening paths of the kubelet, or why they are unknown."""
    if not process_visible(name):
        return KubeletProcess(False, f"no process named {name} is visible (run with hostPID)")
    from initcheck.kubelet import KubeletLookupError, find_kubelet, listening_paths

    try:
        proc = find_kubelet(name)
        listening = listening_paths(name).paths
    except KubeletLookupError as e:
        return KubeletProcess(False, str(e))
    try:
        out = subprocess.run(
            [f"/proc/{proc.pid}/exe", "--version"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    m = re.search(r"Kubernetes v(\d+)\.(\d+)\.(\d+)", out)
    return KubeletProcess(
        True, pid=proc.pid, version=".".join(m.groups()) if m else None, listening=listening
    )


def kubelet_logs(where: str, since: float) -> list[LogFindings]:
    if where == "journal":
        return [scan_journal("kubelet", KUBELET_ERRORS, since)]
    return [scan_file(where, KUBELET_ERRORS, since)] if where else []


def plugin_logs(where: str, since: float) -> list[LogFindings]:
    paths = plugin_log_files() if where == "auto" else [where]
    found = [scan_file(p, PLUGIN_ERRORS, since) for p in paths]
    return found or [LogFindings("/var/log/pods/*device-plugin*", problem="no device plugin log found")]


def sample_processes(name: str, interval: float) -> PluginProcesses:
    """Two samples of every process named `name`, `interval` seconds apart (blocks: run it in a thread)."""
    import psutil

    procs = [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]
    if not procs:
        return PluginProcesses(name, visible=False)

    def sample(p: psutil.Process) -> ProcessSample | None:
        try:
            with p.oneshot():
                return ProcessSample(p.memory_info().rss, p.num_fds(), p.num_threads())
        except psutil.Error:
            return None

    first = {p.pid: sample(p) for p in procs}
    time.sleep(interval)
    growth = []
    for p in procs:
        a, b = first[p.pid], sample(p)
        if a is None or b is None:
            continue
        try:
            uptime = time.time() - p.create_time()
        except psutil.Error:
            uptime = 0.0
        growth.append(ProcessGrowth(p.pid, a, b, interval, uptime))
    return PluginProcesses(name, visible=True, growth=tuple(growth))


def folder_sockets(folder: str) -> list[SocketFile]:
    """Every `*.sock` socket file in the folder, and whether something accepts connections on it."""
    found = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if not entry.name.endswith(".sock"):
                continue
            try:
                if not stat.S_ISSOCK(os.lstat(entry.path).st_mode):
                    continue
            except OSError:
                continue
            found.append(SocketFile(entry.path, listening=try_connect(entry.path, timeout=0.2) is None))
    return found
