"""The /status document: the checks, the sockets, the registration cycles and the settings, as JSON.

Read from the sidecar's state when asked, never by a probe: what the judges last concluded
(`sidecar.deviceplugin.verdicts`, `sidecar.dra.verdicts`) and the evidence they had.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from typing import TYPE_CHECKING, Any

from hami_guard.flags import DeviceExpectation, Expect
from sidecar import __version__
from sidecar.deviceplugin import hamiconfig
from sidecar.deviceplugin.evidence import iso
from sidecar.health import HealthState, Status

if TYPE_CHECKING:
    from sidecar.app import Sidecar
    from sidecar.dra.watch import DraWatch


def status_document(sidecar: Sidecar) -> dict[str, Any]:
    """Everything /status shows of `sidecar`."""
    if sidecar.candidates is not None and sidecar.waiting:
        return _waiting_document(sidecar, sidecar.candidates.document())
    s = sidecar.settings
    state = sidecar.state
    judge = sidecar.judge
    return {
        "version": __version__,
        "uptime_seconds": round(sidecar.clock() - sidecar.started, 3),
        "live": state.healthy(),
        "ready": sidecar.ready and state.all_ok(),
        "watch_mode": sidecar.watch_mode,
        **({"plugin_candidates": sidecar.candidates.document()} if sidecar.candidates is not None else {}),
        "checks": _checks(state),
        "sockets": {
            s.kubelet_socket: _socket_info(s.kubelet_path),
            **{p.socket: {"resource": p.resource, **_socket_info(s.plugin_path(p))} for p in s.plugins},
            "pod-resources": _socket_info(s.pod_resources_socket),
        },
        "kubelet_connections_from": sidecar.device_plugins.connections_source,
        "live_evidence": _live_evidence(sidecar),
        # Processes named as the kubelet that do not listen on the kubelet.sock this pod sees: not read.
        "kubelet_processes_ignored": list(sidecar.device_plugins.kubelets_ignored),
        "socket_table_read_seconds": round(sidecar.device_plugins.table_read_seconds, 4),
        **({"dra": _dra_document(sidecar.dra, sidecar.clock())} if sidecar.dra is not None else {}),
        "hami_registration": _hami_document(sidecar),
        "kubelet_restarts": judge.kubelet_restarts,
        "kubelet_release": judge.kubelet_rules.as_dict(),
        "probe_rounds": sidecar.rounds,
        "runtime": _runtime(),
        "registration": judge.registration(),
        "registration_history": [a.as_dict() for a in judge.history],
        "devices": judge.devices(),
        "unhealthy_recovery": judge.recovery() or "off (--recover-unhealthy-after 0)",
        "expected_devices": _expected_devices(s.expect_devices, sidecar.device_plugins.expectation),
        "settings": {
            "device_plugin_dir": s.device_plugin_dir,
            "probe_interval": s.probe_interval,
            "probe_timeout": s.probe_timeout,
            "registration_grace": s.registration_grace,
            "plugins": {p.resource: p.socket for p in s.plugins},
        },
    }


def _checks(state: HealthState) -> dict[str, Any]:
    return {
        c.name: {
            "state": c.status.value,
            "fails_liveness": c.live_failed,
            "since": iso(c.since),
            "reason": c.reason,
            "last_probe_latency_seconds": c.latency,
            **(
                {"grace_left_seconds": round(state.grace_left(c), 3)}
                if c.status is Status.PENDING and not c.judged_elsewhere
                else {}
            ),
        }
        for c in state.checks.values()
    }


def _waiting_document(sidecar: Sidecar, candidates: dict[str, Any]) -> dict[str, Any]:
    """/status while the sidecar learns which candidate this node's plugin serves
    (sidecar.deviceplugin.candidates): nothing else is judged yet."""
    s = sidecar.settings
    return {
        "version": __version__,
        "uptime_seconds": round(sidecar.clock() - sidecar.started, 3),
        "live": sidecar.state.healthy(),
        "ready": False,
        "watch_mode": sidecar.watch_mode,
        "plugin_candidates": candidates,
        "checks": _checks(sidecar.state),
        "settings": {
            "device_plugin_dir": s.device_plugin_dir,
            "polling_interval": s.polling_interval,
            "registration_grace": s.registration_grace,
            "plugins": {},
        },
    }


def _live_evidence(sidecar: Sidecar) -> dict[str, Any]:
    """What says the kubelet holds a plugin now besides its connections, and what that layout costs."""
    read = sidecar.device_plugins.pod_resources
    if read is None:
        return {"pod_resources": "not read yet"}
    if read.value is not None:
        return {"pod_resources": "read"}
    return {
        "pod_resources": f"cannot be read: {read.error}",
        "unsafe": (
            "without pod-resources, where the kubelet's connections cannot be read (the /proc route "
            "without the plugin's descriptors), nothing live tells a registration: a neighbour's "
            "look-alike connection at the plugin's path can hide a drop from liveness; registered: "
            "then says 'no live evidence in this layout' (readiness only). Mount pod-resources "
            "(docs/deploy.md)"
        ),
    }


def _expected_devices(expect: DeviceExpectation, auto: hamiconfig.Expectation | None) -> dict[str, Any]:
    """What the devices check wants, and why (auto: which devices HAMi registers, which it filters)."""
    if expect.kind is Expect.OFF:
        return {"check": "off (--expect-devices 0)"}
    if expect.kind is Expect.ANY:
        return {"check": "at least one healthy device", "want": 1}
    if expect.kind is Expect.AT_LEAST:
        return {"check": "--expect-devices", "want": expect.count}
    if auto is None:
        return {"check": "--expect-devices auto", "want": None, "notes": ["not read yet"]}
    return {"check": "--expect-devices auto", **auto.as_dict()}


def _dra_document(dra: DraWatch, now: float) -> dict[str, Any]:
    """The DRA drivers' last evidence and verdicts."""
    drivers: dict[str, Any] = {}
    for spec in dra.specs:
        ev, j = dra.last.get(spec.name, (None, None))
        drivers[spec.name] = {
            "registration_socket": _socket_info(spec.registration),
            "service_socket": ev.service if ev else spec.service,
            "getinfo": None
            if ev is None
            else {"answer": ev.info.kind, "reason": ev.info.reason, "versions": list(ev.info.versions)},
            "kubelet_connections": None if ev is None else ev.connections,
            "service": None
            if ev is None
            else {
                "silent_since_seconds": _since(now, ev.service_silent_since),
                "reading": ev.service_reason,
            },
            "resourceslices": None
            if ev is None or (ev.slices is None and not ev.slices_why)
            else {"slices": ev.slices[0], "devices": ev.slices[1]}
            if ev.slices is not None
            else {"no_evidence": ev.slices_why},
            "restarts_in_vain": 0 if j is None else j.restarts_in_vain,
            "spell_seconds": None if j is None else round(now - j.spell_started, 3),
        }
    return {
        "grace": dra.judge.grace,
        "kubelet_connections_from": dra.connections_source,
        "drivers": drivers,
    }


def _hami_document(sidecar: Sidecar) -> dict[str, Any]:
    """HAMi's registration as the hami checks last read it, or why there are none."""
    s = sidecar.settings
    if sidecar.hami is not None:
        return {"on": True, **sidecar.hami.document(sidecar.clock())}
    why = (
        "off (--no-hami-registration)"
        if not s.hami_registration
        else "off: no API server known (KUBERNETES_SERVICE_HOST/PORT unset, no --kube-api-server)"
        if s.hami_api is None
        else "off: no configured plugin has a known HAMi register annotation (--hami-annotation)"
    )
    return {"on": False, "why": why}


def _since(now: float, since: float | None) -> float | None:
    return None if since is None else round(now - since, 3)


def _runtime() -> dict[str, Any]:
    """What a leak would show: tasks by coroutine, threads by name."""
    tasks: dict[str, int] = {}
    for t in asyncio.all_tasks():
        name = getattr(t.get_coro(), "__qualname__", "?")
        tasks[name] = tasks.get(name, 0) + 1
    return {
        "tasks": sum(tasks.values()),
        "task_kinds": dict(sorted(tasks.items())),
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def _socket_info(path: str) -> dict[str, Any]:
    try:
        st = os.lstat(path)
    except OSError:
        return {"path": path, "exists": False}
    return {
        "path": path,
        "exists": True,
        "is_socket": stat.S_ISSOCK(st.st_mode),
        "mode": f"{stat.S_IMODE(st.st_mode):04o}",
        "owner": f"{st.st_uid}:{st.st_gid}",
        "created": iso(st.st_mtime),
    }
