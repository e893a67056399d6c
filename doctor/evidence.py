"""Everything hami-doctor reads from the node, once, into one typed `NodeEvidence`.

This stage is the only one of the doctor that does I/O to learn about the node (with its
helpers: `doctor.logscan` reads the logs, `doctor.dra.evidence` the DRA drivers): initcheck's
checks, the sidecar's probes, its view of the kubelet's connections to the plugins and
its reading of the kubelet's records (the same code, not a second implementation), the
host's device nodes, the logs, the kubelet's and the plugin's processes, and the sockets
in the device-plugins folder. The rules (`doctor.causes`) and the repairs' plan
(`doctor.repairs`) only read the result. psutil is imported inside functions, so a
broken psutil is a diagnosis error the CLI reports (NPD's Unknown), not a failed import.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import glob
import os
import re
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from doctor import candidates
from doctor.dra.evidence import dra_kubelet_logs, gather_dra
from doctor.hami import gather_hami
from doctor.logscan import kubelet_logs, plugin_logs
from doctor.patterns import KUBELET_PATTERNS, catalogue
from doctor.recovery import gather_recovery
from doctor.settings import DoctorSettings
from doctor.types import (
    CandidateJudgement,
    DriverNodes,
    KubeletProcess,
    NodeEvidence,
    PluginEvidence,
    PluginProcesses,
    ProcessGrowth,
    ProcessSample,
    SocketFile,
    SocketProbe,
)
from hami_guard import profiles
from hami_guard.flags import AUTO_DEVICES, PluginSpec
from hami_guard.node.kubelet import KubeletLookupError, listening_paths
from hami_guard.node.proc import KUBELET_PROCESS_NAMES, KubeletProcesses, kubelet_processes
from hami_guard.node.sockets import try_connect
from hami_guard.node.unixdiag import (
    KUBELET_BOUND_PATH,
    Connections,
    DiagUnavailable,
    SocketOwner,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    socket_owner,
)
from hami_guard.profiles import VendorProfile
from initcheck.checks import options_for, run_checks
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
from sidecar.deviceplugin.hamiconfig import NODE_NAME_ENV
from sidecar.deviceplugin.probes import (
    ProbeResult,
    Reading,
    pod_resources_devices,
    probe_kubelet,
    probe_plugin,
    read_checkpoint_async,
)

T = TypeVar("T")


class Gathering:
    """Runs each reader; a reader that fails is said in `errors`, and its fallback stands in."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def take(self, what: str, read: Callable[[], T], fallback: T) -> T:
        """`read()`, or `fallback` when it raises (said in `errors` as `what`)."""
        try:
            return read()
        except Exception as e:  # one broken reader never costs the whole report
            self.errors.append(f"{what}: {type(e).__name__}: {e}")
            return fallback


async def gather(s: DoctorSettings) -> NodeEvidence:
    """Everything the doctor reads from the node, once; a reader that fails is said in `errors`. With
    --plugin-candidates, first which of them to judge (`decide`), then those as --plugin."""
    if not s.plugin_candidates:
        return await _gather(s)
    judgement = await decide(s)
    found = await _gather(s.judging(judgement.judged))
    return dataclasses.replace(found, candidates=judgement)


async def decide(s: DoctorSettings) -> CandidateJudgement:
    """Which of --plugin-candidates this node serves (doctor/candidates.py): the sockets, then the
    kubelet's records of them."""
    pod_resources = await pod_resources_devices(s.pod_resources_socket, s.probe_timeout)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-doctor-checkpoint") as reader:
        checkpoint = await read_checkpoint_async(os.path.join(s.device_plugin_dir, CHECKPOINT_NAME), reader)
    folder, found = s.device_plugin_dir, s.plugin_candidates
    looked, records = await asyncio.to_thread(candidates.look, folder, found, pod_resources, checkpoint)
    elsewhere = await asyncio.to_thread(candidates.others_served, folder, found, s.kubelet_socket, s.profile)
    node = os.environ.get(NODE_NAME_ENV, "") or socket.gethostname()
    return candidates.judge(looked, records, elsewhere, s.profile.name, node)


async def _gather(s: DoctorSettings) -> NodeEvidence:
    """Everything the doctor reads from the node for the plugins `s` names."""
    options = options_for(
        s.kubelet_path,
        plugin_uid=s.plugin_uid,
        plugin_gid=s.plugin_gid,
        expect_owner=s.expect_owner,
        expect_group=s.expect_group,
        expect_mode=s.expect_mode,
        kubelet_process=s.kubelet_process_name,
    )
    g = Gathering()
    findings = tuple(run_checks(options))  # as the init container runs them: connect, not strict
    paths = [s.plugin_path(p) for p in s.plugins]
    # The kubelet's connections and whose listener serves each plugin socket, read before the probes
    # (a probe's own connection lingers a few ms), from one reading of this namespace, as the sidecar.
    names = {*KUBELET_PROCESS_NAMES, s.kubelet_process_name}
    # Which process is the kubelet (the one of a kubelet's name that listens on kubelet.sock), once for
    # the readers that follow.
    kubelets = g.take(
        "the kubelet's process",
        lambda: kubelet_processes(s.kubelet_path, names=names),
        KubeletProcesses(listener="could not be read"),
    )
    mine, seen = _read_connections(s, g, names, kubelets)
    first_read = time.monotonic()
    first = [
        g.take(
            f"the kubelet's connections to {path}",
            partial(_connections_to, seen, spec, path),
            Reading[frozenset[int]].failed("could not be read"),
        )
        for spec, path in zip(s.plugins, paths, strict=True)
    ]
    sockets = None if isinstance(mine, str) else mine
    owners = [
        g.take(
            f"owner of {path}",
            partial(socket_owner, path, s.kubelet_path, sockets, names=names, kubelets=kubelets),
            _NO_OWNER,
        )
        for path in paths
    ]
    kubelet, *probes = await asyncio.gather(
        probe_kubelet(s.kubelet_path, s.probe_timeout),
        *(probe_plugin(path, s.probe_timeout) for path in paths),
    )
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-doctor-checkpoint") as reader:
        checkpoint = await read_checkpoint_async(os.path.join(s.device_plugin_dir, CHECKPOINT_NAME), reader)
    pod_resources = await pod_resources_devices(s.pod_resources_socket, s.probe_timeout)
    plugin_process = await asyncio.to_thread(
        g.take,
        "plugin process",
        lambda: sample_processes(s.plugin_process_name, s.sample_interval),
        PluginProcesses(s.plugin_process_name, visible=False),
    )
    connections = await _lasting(
        s, g, names=names, seen=seen, first=first, paths=paths, first_read=first_read
    )
    plugins = tuple(
        PluginEvidence(spec, _socket_probe(path, probe), held, owner)
        for spec, path, probe, held, owner in zip(s.plugins, paths, probes, connections, owners, strict=True)
    )
    process = g.take(
        "the kubelet's listening paths",
        lambda: kubelet_process(s.kubelet_path, s.kubelet_process_name),
        KubeletProcess(False, "the kubelet's process could not be read"),
    )
    none: tuple[str, ...] = ()
    host = (
        g.take("host devices", lambda: tuple(sorted(glob.glob(s.device_glob))), none)
        if s.expect_devices == AUTO_DEVICES
        else none
    )
    # The device nodes of the first plugin's vendor that has a profile (its driver's control node).
    vendor = next((v for p in s.plugins if (v := profiles.for_resource(p.resource)) is not None), None)
    return NodeEvidence(
        findings=findings,
        kubelet_socket=_socket_probe(s.kubelet_path, kubelet),
        plugins=plugins,
        kubelet=process,
        kubelet_logs=tuple(
            g.take("kubelet log", lambda: kubelet_logs(s.kubelet_log, s.since, KUBELET_PATTERNS), [])
        ),
        plugin_logs=tuple(
            g.take("plugin log", lambda: plugin_logs(s.plugin_log, s.since, catalogue(s.profile).plugin), [])
        ),
        plugin_process=plugin_process,
        folder_sockets=tuple(g.take("sockets", lambda: folder_sockets(s.device_plugin_dir), [])),
        kubelet_path=os.path.abspath(s.kubelet_path),
        checkpoint=checkpoint,
        pod_resources=pod_resources,
        expect_devices=s.expect_devices,
        device_glob=s.device_glob,
        host_devices=host,
        rss_growth_mib=s.rss_growth_mib,
        driver=g.take(
            "driver nodes",
            lambda: (
                driver_nodes(s.device_glob, vendor)
                if vendor is not None and s.expect_devices == AUTO_DEVICES
                else DriverNodes(False)
            ),
            DriverNodes(False),
        ),
        errors=tuple(g.errors),
        **(await _dra_evidence(s, g, names) if s.dra_drivers else {}),
        **(await _hami_evidence(s, g, pod_resources, plugins) if s.hami_api is not None else {}),
        # Not for node-problem-detector: its condition is the plugin's registration, not a GPU's health.
        recovery=await gather_recovery("" if s.npd else s.sidecar_status, s.probe_timeout),
    )


async def _dra_evidence(s: DoctorSettings, g: Gathering, names: set[str]) -> dict[str, Any]:
    """The DRA drivers' readings and the kubelet's DRA log lines (doctor/dra/evidence.py)."""
    try:
        readings = await gather_dra(
            s.dra_drivers, s.kubelet_path, s.probe_timeout, frozenset(names), api=s.dra_api, node=s.dra_node
        )
    except Exception as e:  # a broken reader never costs the whole report
        g.errors.append(f"DRA drivers: {type(e).__name__}: {e}")
        readings = []
    return {
        "dra": tuple(readings),
        "dra_logs": tuple(g.take("kubelet DRA log", lambda: dra_kubelet_logs(s.kubelet_log, s.since), [])),
    }


async def _hami_evidence(
    s: DoctorSettings,
    g: Gathering,
    pod_resources: Reading[dict[str, frozenset[str]]],
    plugins: tuple[PluginEvidence, ...],
) -> dict[str, Any]:
    """HAMi's registration of each resource with a known annotation (doctor/hami.py)."""
    assert s.hami_api is not None
    try:
        readings = await gather_hami(
            s.hami_api,
            s.node_name,
            s.hami_keys,
            s.hami_handshake,
            kubelet=pod_resources,
            serving={p.spec.resource: p.probe.ok for p in plugins},
            timeout=max(s.probe_timeout, 1.0),
        )
    except Exception as e:  # a broken reader never costs the whole report
        g.errors.append(f"HAMi's registration: {type(e).__name__}: {e}")
        return {}
    return {"hami": readings}


_NO_OWNER = SocketOwner("unknown", "could not be read")


def driver_nodes(device_glob: str, vendor: VendorProfile = profiles.DEFAULT) -> DriverNodes:
    """The driver's control node and the GPU nodes (the profile's) in the folder of the device glob (the
    host's /dev, as mounted)."""
    folder = os.path.dirname(device_glob) or "/dev"
    d = vendor.devices
    if not d.control or not os.path.isdir(folder):  # no control node: the driver's state is not told
        return DriverNodes(False, folder, control_node=d.control, vendor=vendor.vendor)
    gpus = tuple(sorted(glob.glob(os.path.join(glob.escape(folder), os.path.basename(d.glob)))))
    control = os.path.exists(os.path.join(folder, d.control))
    return DriverNodes(True, folder, control, gpus, d.control, vendor.vendor)


def _socket_probe(path: str, result: ProbeResult) -> SocketProbe:
    return SocketProbe(path, result.state, result.reason, result.identity)


def _diag_dump() -> list[UnixSocket] | str:
    """This network namespace's Unix sockets, or why the kernel does not list them."""
    try:
        return diag_dump()
    except DiagUnavailable as e:
        return str(e)


def _read_connections(
    s: DoctorSettings, g: Gathering, names: set[str], kubelets: KubeletProcesses | None = None
) -> tuple[list[UnixSocket] | str, Connections | str]:
    """One reading of this namespace's Unix sockets, and of the kubelet's connections from it (with the
    caller's `kubelet_processes`, else read again)."""
    unread: list[UnixSocket] | str = "this network namespace's sockets could not be read"
    mine = g.take("this network namespace's sockets", _diag_dump, unread)
    unseen: Connections | str = "the kubelet's connections could not be read"
    seen = g.take(
        "the kubelet's connections",
        lambda: kubelet_connections(
            s.kubelet_path,
            names=names,
            mine=mine,
            served=[s.plugin_path(p) for p in s.plugins],
            kubelets=kubelets,
        ),
        unseen,
    )
    return mine, seen


def _connections_to(seen: Connections | str, spec: PluginSpec, path: str) -> Reading[frozenset[int]]:
    """The kubelet's connections to the listener of the plugin's socket file, as the sidecar counts them:
    their accepted ends (by inode)."""
    if isinstance(seen, str):
        return Reading.failed(seen)
    # Where the folder is mounted elsewhere, the plugin bound it at the kubelet's own path.
    bound = os.path.join(os.path.dirname(KUBELET_BOUND_PATH), spec.socket)
    ids = seen.accepted(path, (bound,))
    return Reading.failed(ids) if isinstance(ids, str) else Reading(ids)


async def _lasting(
    s: DoctorSettings,
    g: Gathering,
    *,
    names: set[str],
    seen: Connections | str,
    first: list[Reading[frozenset[int]]],
    paths: list[str],
    first_read: float,
) -> list[Reading[int]]:
    """The kubelet's connections to each plugin that lasted from the first reading to a second one, a
    probe timeout later.

    Where the kubelet's descriptors cannot be read (no CAP_SYS_PTRACE), a connection in its network
    namespace is anyone's there: the sidecar's probe of the plugin (hostNetwork) is one just like the
    kubelet's, and a single look catches one now and then (more often on a busy node, where a probe
    takes longer): the plugin would count as held. A prober's connection ends within its timeout (the
    sidecar's default is this doctor's); the kubelet's lasts as long as it holds the plugin.
    """
    exact = isinstance(seen, Connections) and seen.exact and seen.owned is not None
    if exact or not any(r.value for r in first):
        return [Reading(len(r.value)) if r.value is not None else Reading.failed(r.error) for r in first]
    wait = s.probe_timeout - (time.monotonic() - first_read)
    if wait > 0:
        await asyncio.sleep(wait)
    _, again = _read_connections(s, g, names)
    lasting: list[Reading[int]] = []
    for spec, path, before in zip(s.plugins, paths, first, strict=True):
        after = g.take(
            f"the kubelet's connections to {path}",
            partial(_connections_to, again, spec, path),
            Reading[frozenset[int]].failed("could not be read"),
        )
        if before.value is None:
            lasting.append(Reading.failed(before.error))
        elif after.value is None:
            lasting.append(Reading.failed(after.error))
        else:
            lasting.append(Reading(len(before.value & after.value)))
    return lasting


def kubelet_process(kubelet_path: str, name: str, proc: str = "/proc") -> KubeletProcess:
    """pid, version and listening paths of the kubelet (in k3s or kubelite too), or why they are unknown:
    the process of a kubelet's name that listens on `kubelet_path` (`hami_guard.node.proc`), the others
    named as ignored."""
    try:
        found = listening_paths(kubelet_path, name, proc)
    except KubeletLookupError as e:
        return KubeletProcess(False, str(e), ignored=e.ignored)
    return KubeletProcess(
        True,
        pid=found.pid,
        version=kubelet_version(found.pid, found.process),
        listening=found.paths,
        distribution=found.distribution,
        process=found.process,
        ignored=found.ignored,
    )


def kubelet_version(pid: int, process: str) -> str | None:
    """`--version` of the kubelet's binary: asked only of kubelet and k3s, which print it and exit."""
    if process != "kubelet" and not process.startswith("k3s"):
        return None
    try:
        out = subprocess.run(
            [f"/proc/{pid}/exe", "--version"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Kubernetes v(\d+)\.(\d+)\.(\d+)", out) or re.search(r"v(\d+)\.(\d+)\.(\d+)\+k3s", out)
    return ".".join(m.groups()) if m else None


def sample_processes(name: str, interval: float) -> PluginProcesses:
    """Two samples of every process named `name`, `interval` seconds apart (blocks: run it in a thread)."""
    import psutil  # noqa: PLC0415  # here: a broken psutil costs this reader alone

    procs = [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]
    if not procs:
        return PluginProcesses(name, visible=False)

    def sample(p: psutil.Process) -> ProcessSample | None:
        try:
            with p.oneshot():
                return ProcessSample(p.memory_info().rss, p.num_fds(), p.num_threads())
        except psutil.Error:
            return None

    # Each sample's own time: on a busy node the two are further apart than `interval`, and the
    # evidence says how far (the growth is judged as seen, between the samples actually taken).
    first = {p.pid: (sample(p), time.monotonic()) for p in procs}
    time.sleep(interval)
    growth = []
    for p in procs:
        (a, taken), b = first[p.pid], sample(p)
        if a is None or b is None:
            continue
        apart = time.monotonic() - taken
        try:
            uptime = time.time() - p.create_time()
        except psutil.Error:
            uptime = 0.0
        growth.append(ProcessGrowth(p.pid, a, b, apart, uptime))
    return PluginProcesses(name, visible=True, growth=tuple(growth))


def folder_sockets(folder: str) -> list[SocketFile]:
    """Every `*.sock` socket file in the folder, whether something accepts connections on it, and which
    file was judged: its identity before and after the connect() test, None when it changed between."""
    found: list[SocketFile] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return found
    for name in names:
        if not name.endswith(".sock"):
            continue
        path = os.path.abspath(os.path.join(folder, name))
        before = _identity(path)
        if before is None:
            continue
        err = try_connect(path, timeout=0.2)
        after = _identity(path)
        if err is not None and err != errno.ECONNREFUSED:
            continue  # vanished, denied: nothing to conclude
        same = before if before == after else None
        age = time.time() - before[2] / 1e9  # since its creation: a socket file is never written
        found.append(SocketFile(path, listening=err is None, identity=same, age=age))
    return found


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns
