"""hami-doctor for DRA drivers: the sidecar's DRA evidence once, the kubelet's DRA log lines, the causes.

The rules read `sidecar.dra.verdicts`'s evidence of one moment (a snapshot: no grace, so "not registered"
may be a registration under way; the fix says to look again) and the kubelet's own log lines, whose
wording is the kubelet's (docs/kubelet.md#dra; tests/test_doctor_dra.py reads them from the real
plugin manager and DRA manager). Pure but for `gather_dra`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from doctor.causes import Cause
from doctor.logscan import LogFindings, Pattern
from sidecar.dra.slices import ApiAccess
from sidecar.dra.verdicts import KUBELET_CALL_TIMEOUT, DraSpec, Evidence, Judgement
from sidecar.health import Status

RESTART_DRIVER = (
    "$ kubectl delete pod -n <namespace> <the DRA driver's kubelet-plugin pod on this node>  "
    "# its DaemonSet starts a new one"
)
ONE_SOCKET_EACH = (
    "two instances of the driver share a socket: give each its own (the kubelet plugin helper's "
    "RollingUpdate(podUID) option, or the chart's rolling-update setting) or run one at a time"
)

DRA_PATTERNS = (
    Pattern(
        "RegisterPlugin error --",
        "dra-log",
        "the kubelet's plugin manager failed to register a plugin; it retries the socket with backoff "
        "(0.5 s doubling, at most 2 min 2 s)",
        ("look at the driver's own log for the same moment, then restart the driver:", RESTART_DRIVER),
        "pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go",
        refine=(
            (
                "failed to send registration status",
                "the driver refused (or did not answer) NotifyRegistrationStatus: the driver's side",
            ),
            ("already registered for DRA driver plugin", "the same service socket twice: " + ONE_SOCKET_EACH),
            (
                "none of services supported by the plugin",
                "version skew: the driver offers no DRA gRPC service this kubelet speaks (v1.DRAPlugin "
                "from 1.34, v1beta1.DRAPlugin before): upgrade the driver or the kubelet",
            ),
            ("dial failed at socket", "nothing serves the registration socket: the driver is not running"),
            ("failed to get plugin info using RPC GetInfo", "the driver's GetInfo failed or timed out (1 s)"),
            ("no handler registered for plugin type", "the socket is not a DRA driver's (or DRA is off)"),
        ),
    ),
    Pattern(
        "Error receiving from WatchResources stream",
        "dra-log",
        "the kubelet's device-health stream to a DRA driver ended with an error",
        source="pkg/kubelet/cm/dra/manager.go HandleWatchResourcesStream",
        refine=(
            (
                "code = Unimplemented",
                "known noise on Kubernetes 1.36: that kubelet opens the health stream for every driver, "
                "every 5 s, and logs this for a driver without health reporting; 1.37 asks only drivers "
                "that advertise it. Registration is not affected; nothing to fix",
            ),
        ),
    ),
)
NOISE = "known noise"


@dataclass(frozen=True)
class DraReading:
    spec: DraSpec
    evidence: Evidence
    judgement: Judgement


async def gather_dra(
    specs: Sequence[DraSpec],
    kubelet_socket: str,
    timeout: float,
    names: frozenset[str] | None = None,
    *,
    api: ApiAccess | None = None,
    node: str = "",
) -> list[DraReading]:
    """One round of the sidecar's DRA evidence, judged with no grace (a snapshot); the node's
    ResourceSlices too when `api` is given."""
    from hami_guard.node.unixdiag import KUBELET_PROCESS_NAMES
    from sidecar.dra.watch import DraWatch

    watch = DraWatch(
        specs,
        kubelet_socket,
        grace=0.0,
        timeout=timeout,
        names=names or KUBELET_PROCESS_NAMES,
        api=api,
        node=node,
    )
    try:
        found = await watch.round()
    finally:
        watch.close()  # a DRA service call still in flight is not waited for
    return [DraReading(s, *found[s.name]) for s in specs]


def dra_causes(
    readings: Sequence[DraReading], logs: Sequence[LogFindings], kubelet_version: str | None
) -> list[Cause]:
    """dra-not-serving, dra-service-silent, dra-not-registered, dra-log: one row each."""
    serving = Cause("dra-not-serving", "ok")
    silent = Cause("dra-service-silent", "ok")
    registered = Cause("dra-not-registered", "ok")
    for r in readings:
        name, ev, j = r.spec.name, r.evidence, r.judgement
        if ev.service_silent_since is not None:
            silent.problem(
                f"{name}: GetInfo answers, but the DRA service {ev.service} did not answer an empty "
                f"NodePrepareResources ({ev.service_reason}). The kubelet keeps such a driver registered "
                "and reports its connection open, so nothing on the node says so but Pods: their claims "
                f"fail to prepare after the kubelet's {KUBELET_CALL_TIMEOUT:.0f} s call timeout (event "
                "FailedPrepareDynamicResources, NodePrepareResources ... DeadlineExceeded), again and again",
                [
                    "run hami-doctor again: a service busy with a long prepare answers within a minute",
                    "if it stays silent, the driver is hung (its prepare path, or its DRA gRPC server): "
                    "restart it:",
                    RESTART_DRIVER,
                ],
            )
        elif ev.info.ok:
            silent.evidence.append(f"{name}: {ev.service_reason}")
        if j.plugin.status is Status.OK:
            serving.evidence.append(f"{name}: {j.plugin.reason}")
        elif ev.service_silent_since is not None and j.plugin.restarts:  # dra-service-silent's to say
            serving.evidence.append(f"{name}: GetInfo answers: {ev.info.type} {ev.info.name}")
        elif j.plugin.status is Status.FAILED and not j.plugin.restarts:
            serving.problem(
                f"{name}: {j.plugin.reason}",
                [f"name the driver's own registration socket: --dra-driver {name}=<its socket>"],
            )
        else:
            serving.problem(
                f"{name}: {ev.info.reason}",
                [
                    f"the driver's kubelet-plugin container is not serving {r.spec.registration}: read its "
                    "log, then restart it:",
                    RESTART_DRIVER,
                ],
            )
        if j.registered.status is Status.OK:
            registered.evidence.append(f"{name}: {j.registered.reason}")
        elif ev.kubelet_up is False:
            state = "refuses connections" if ev.kubelet_id else "is missing"
            registered.problem(
                f"{name}: the kubelet is not running (its socket {state}): no driver is registered",
                ["start the kubelet: it registers every driver in plugins_registry at start"],
            )
        elif ev.connections is None:
            registered.verdict = "unknown" if registered.verdict == "ok" else registered.verdict
            registered.evidence.append(f"{name}: {ev.connections_why}")
        elif j.plugin.status is Status.OK:
            fix = [
                "run hami-doctor again in a few seconds: a registration under way, or a retry after a "
                "refusal (the kubelet waits up to 2 min 2 s between tries), connects by then",
                "if it stays so, see dra-log below for the kubelet's reason, then restart the driver:",
                RESTART_DRIVER,
            ]
            if ev.service_id is None:
                fix = [
                    f"the driver names {ev.service} but serves nothing there: its DRA gRPC server is down; "
                    "restart the driver:",
                    RESTART_DRIVER,
                ]
            registered.problem(f"{name}: {j.registered.reason}", fix)
    log = Cause("dra-log", "ok")
    release = _minor(kubelet_version)
    for found in logs:
        if not found.read:
            log.evidence.append(f"{found.source}: {found.problem or 'not read'}")
            continue
        for hit in found.hits:
            line = f"{hit.count}x in {found.source}: {hit.meaning}; newest: {hit.newest}"
            if NOISE in hit.meaning:
                if release is not None and release >= 37:
                    log.problem(
                        line.replace(
                            NOISE,
                            "not expected on this kubelet (1.37 asks only drivers that "
                            "advertise health) and so",
                        ),
                        ["the driver advertises DRAResourceHealth, its server fails the stream: update it"],
                    )
                else:
                    log.evidence.append(line)
            else:
                log.problem(line, hit.pattern.fix)
    return [serving, silent, registered, log]


def _minor(version: str | None) -> int | None:
    try:
        major, minor, *_ = (int(x) for x in (version or "").split("."))
    except ValueError:
        return None
    return minor if major == 1 else None


def dra_kubelet_logs(where: str, since: float) -> list[LogFindings]:
    """The kubelet's log (as hami-doctor's --kubelet-log reads it), scanned for the DRA lines only."""
    from doctor.evidence import kubelet_logs

    return kubelet_logs(where, since, DRA_PATTERNS)


def scan_dra_log(data: bytes, source: str, since: float | None = None) -> LogFindings:
    from doctor.logscan import scan

    return scan(data, DRA_PATTERNS, source, since, time.time())
