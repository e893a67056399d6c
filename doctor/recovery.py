"""What hami-sidecar did for the GPUs HAMi marked unhealthy (`--recover-unhealthy-after`), from its /status.

HAMi never marks a device healthy again; the sidecar, where told to, asks for one plugin restart that
re-reads such a device (sidecar/deviceplugin/recovery.py). The doctor, run in the plugin's pod, reads
the sidecar's `/status` (`--sidecar-status`, loopback by default) and says per resource what was done:
the restarts asked for, the devices they brought back, and those unhealthy again after theirs (really
unhealthy: a problem, with its fix). No sidecar answering there: no row. Every reading is bounded (the
probe timeout for the whole answer, not for each read: a server that sends one byte at a time is cut
at that deadline; 1 MiB) and total: whatever answers, a row or nothing, never an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any

from doctor.types import Cause
from hami_guard import profiles
from sidecar.deviceplugin.probes import Reading

MAX_STATUS_BYTES = 1 << 20
DEFAULT_URL = "http://127.0.0.1:9395/status"  # the sidecar's port, in the pod's network namespace
SHOWN = 8


class NoSidecar(Exception):
    """Nothing answers at the URL (refused, unreachable, not a 200): no sidecar to ask."""


class Late(Exception):
    """The answer did not come whole within the deadline."""


def _get(url: str, timeout: float) -> bytes:
    """The body of a GET of an http:// URL, whole within `timeout` seconds from the first byte sent to the
    last received: each read waits at most that, and at the deadline the connection is cut (a watchdog
    shuts the socket down), however the server drips. NoSidecar when nothing answers, Late at the
    deadline; http.client's exceptions for a peer that does not speak HTTP."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:  # a URL given must not reach files or other schemes
        raise ValueError(f"{url!r}: not an http:// address")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    late = threading.Event()

    def cut() -> None:
        late.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns at once

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            conn.connect()
        except OSError as e:
            raise NoSidecar(str(e)) from None
        if late.is_set():
            raise Late
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn.request("GET", path, headers={"Connection": "close"})
        answer = conn.getresponse()
        if answer.status != 200:
            raise NoSidecar(f"HTTP {answer.status}")
        body: bytes = answer.read(MAX_STATUS_BYTES + 1)
    except (OSError, http.client.HTTPException):
        if late.is_set():
            raise Late from None
        raise
    finally:
        watchdog.cancel()
        conn.close()
    if late.is_set():  # the cut ended the body early
        raise Late
    return body


def read_recovery(url: str, timeout: float) -> Reading[Any] | None:
    """The `unhealthy_recovery` section of the sidecar's /status: per resource its recovery, or the
    text saying it is off. None: no sidecar answers at `url`. Never raises."""
    if not url.startswith("http://"):
        return Reading.failed(f"--sidecar-status {url!r}: an http:// address")
    try:
        body = _get(url, timeout)
    except (NoSidecar, ValueError):
        return None  # nothing listens there: no sidecar to ask
    except Late:
        return Reading.failed(f"{url}: no whole answer within {timeout:g}s (the deadline of the whole read)")
    except Exception as e:  # a peer that is not HTTP, or that hung up mid-answer
        return Reading.failed(f"{url}: {type(e).__name__}: {e}")
    if len(body) > MAX_STATUS_BYTES:
        return Reading.failed(f"{url}: over {MAX_STATUS_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        return Reading.failed(f"{url}: not the sidecar's JSON ({type(e).__name__})")
    if not isinstance(doc, dict) or "unhealthy_recovery" not in doc:
        return Reading.failed(f"{url}: no unhealthy_recovery in the answer (a sidecar without it?)")
    return Reading(doc["unhealthy_recovery"])


async def gather_recovery(url: str, timeout: float) -> Reading[Any] | None:
    """`read_recovery` off the loop."""
    if not url:
        return None
    return await asyncio.to_thread(read_recovery, url, timeout)


def _devices(value: Any) -> list[str]:
    """Device names of a /status list or mapping, at most a few, as text."""
    items = list(value) if isinstance(value, dict | list) else []
    names = [str(v)[:80] for v in items[:SHOWN]]
    return names + ([f"and {len(items) - SHOWN} more"] if len(items) > SHOWN else [])


def _when(value: Any, device: str) -> str:
    when = value.get(device) if isinstance(value, dict) else None
    return f" at {str(when)[:40]}" if when else ""


def recovery_cause(reading: Reading[Any]) -> Cause:
    """The row: per resource, the restarts the sidecar asked for unhealthy GPUs and their outcome."""
    cause = Cause("unhealthy-devices", "ok")
    doc = reading.value
    if doc is None:
        return Cause("unhealthy-devices", "unknown", [reading.error])
    if not isinstance(doc, dict):
        cause.verdict = "unknown"
        cause.evidence.append(f"the sidecar's recovery of unhealthy devices: {str(doc)[:200]}")
        cause.evidence.append(
            "HAMi never marks a device healthy again: set --recover-unhealthy-after (e.g. 10m) on the "
            "sidecar for one plugin restart that re-reads it"
        )
        return cause
    for resource, rec in sorted(doc.items()):
        if not isinstance(rec, dict):
            continue
        _resource(cause, str(resource)[:120], rec)
    if not cause.evidence:
        cause.evidence.append("no resource's recovery in the sidecar's /status")
    return cause


def _resource(cause: Cause, r: str, rec: dict[str, Any]) -> None:
    restarts = rec.get("restarts") if isinstance(rec.get("restarts"), int) else 0
    recovered = _devices(rec.get("recovered"))
    gone = rec.get("really_unhealthy")
    really = [str(d)[:80] for d in list(gone)[:SHOWN]] if isinstance(gone, dict | list) else []
    asked = _devices(rec.get("restart_asked_for"))
    missing = _devices(rec.get("not_listed_healthy"))
    inspect = (profiles.for_resource(r) or profiles.DEFAULT).devices.inspect  # the vendor's look at a GPU
    cause.evidence.append(
        f"{r}: the sidecar asked for {restarts} plugin restart(s) to re-read unhealthy devices"
        + (
            f"; brought back: {', '.join(d + _when(rec.get('recovered'), d) for d in recovered)}"
            if recovered
            else ""
        )
    )
    if asked:
        cause.evidence.append(
            f"{r}: a plugin restart is asked for now (liveness fails) to re-read {', '.join(asked)}"
        )
    elif missing:
        cause.evidence.append(f"{r}: not listed healthy now: {', '.join(missing)}")
    for d in really:
        when = _when(rec.get("really_unhealthy"), d)
        cause.problem(
            f"{r}: {d} unhealthy again after the plugin restart that re-read it{when}: the GPU is really "
            "unhealthy; the sidecar asks for no more restarts for it",
            [
                f"look at the GPU: {inspect}",
                "then drain the node and reset or replace the GPU (a reboot clears most XIDs):",
                "$ kubectl drain $(hostname) --ignore-daemonsets --delete-emptydir-data",
            ],
        )
    if rec.get("restart_budget_spent") is True:
        cause.problem(
            f"{r}: restart budget spent: {rec.get('restarts_in_vain')} plugin restarts were followed by a "
            "device unhealthy again; the sidecar asks for none",
            [f"the GPUs above need a person: {inspect}"],
        )
