"""The DRA drivers' rows: dra-not-serving, dra-service-silent, dra-not-registered and dra-log.

Pure: the rules read `sidecar.dra.verdicts`'s evidence of one moment (doctor/dra/evidence.py: a
snapshot, no grace, so "not registered" may be a registration under way; the fix says to look
again) and the kubelet's own log lines, whose wording is the kubelet's (docs/kubelet.md#dra;
tests/test_doctor_dra.py reads them from the real plugin manager and DRA manager).
"""

from __future__ import annotations

from collections.abc import Sequence

from doctor.patterns import RESTART_DRIVER
from doctor.types import Cause, DraReading, LogFindings
from sidecar.dra.verdicts import KUBELET_CALL_TIMEOUT
from sidecar.health import Status

# The catalogue's meaning of a line the kubelet logs for nothing wrong (doctor/patterns.toml, [[dra]]).
NOISE = "known noise"


def dra_causes(
    readings: Sequence[DraReading], logs: Sequence[LogFindings], kubelet_version: str | None
) -> list[Cause]:
    """dra-not-serving, dra-service-silent, dra-not-registered, dra-log: one row each."""
    return [
        dra_serving_cause(readings),
        dra_silent_cause(readings),
        dra_registration_cause(readings),
        dra_log_cause(logs, kubelet_version),
    ]


def dra_silent_cause(readings: Sequence[DraReading]) -> Cause:
    """A driver whose GetInfo answers while its DRA service does not: the kubelet sees nothing wrong."""
    silent = Cause("dra-service-silent", "ok")
    for r in readings:
        name, ev = r.spec.name, r.evidence
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
    return silent


def dra_serving_cause(readings: Sequence[DraReading]) -> Cause:
    """Each driver serves its registration socket (GetInfo answers), as the sidecar judges it."""
    serving = Cause("dra-not-serving", "ok")
    for r in readings:
        name, ev, j = r.spec.name, r.evidence, r.judgement
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
    return serving


def dra_registration_cause(readings: Sequence[DraReading]) -> Cause:
    """Each driver is registered with the kubelet: its connection to the driver's service, as the sidecar
    judges it from one look."""
    registered = Cause("dra-not-registered", "ok")
    for r in readings:
        name, ev, j = r.spec.name, r.evidence, r.judgement
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
    return registered


def dra_log_cause(logs: Sequence[LogFindings], kubelet_version: str | None) -> Cause:
    """The kubelet's DRA log lines: each a problem with its fix, but the known noise of Kubernetes 1.36."""
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
    return log


def _minor(version: str | None) -> int | None:
    try:
        major, minor, *_ = (int(x) for x in (version or "").split("."))
    except ValueError:
        return None
    return minor if major == 1 else None
