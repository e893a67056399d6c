"""hami-doctor's row on what hami-sidecar did for GPUs HAMi marked unhealthy (doctor/recovery.py): the
row from a /status section, and the reading of /status from a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from doctor.recovery import read_recovery, recovery_cause
from doctor.settings import parse_settings
from sidecar.deviceplugin.probes import Reading
from testing import free_port

GPU = "nvidia.com/gpu"
UUID0 = "GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f"
SECTION: dict[str, Any] = {
    GPU: {
        "after_seconds": 600.0,
        "not_listed_healthy": {},
        "restart_asked_for": [],
        "restarts": 2,
        "last_restart": "2026-01-01T00:00:00.000Z",
        "awaiting": [],
        "recovered": {UUID0: "2026-01-01T00:00:01.000Z"},
        "really_unhealthy": {},
        "restarts_in_vain": 0,
        "restart_budget_spent": False,
    }
}


def test_a_gpu_brought_back_is_said_and_is_no_problem() -> None:
    cause = recovery_cause(Reading(SECTION))
    assert cause.verdict == "ok"
    assert cause.evidence == [
        f"{GPU}: the sidecar asked for 2 plugin restart(s) to re-read unhealthy devices; brought back: "
        f"{UUID0} at 2026-01-01T00:00:01.000Z"
    ]


def test_a_gpu_unhealthy_again_after_its_restart_is_a_problem_with_its_fix() -> None:
    doc = {GPU: {**SECTION[GPU], "really_unhealthy": {UUID0: "2026-01-01T01:00:00.000Z"}, "recovered": {}}}
    cause = recovery_cause(Reading(doc))
    assert cause.verdict == "problem"
    assert cause.evidence[0].startswith(
        f"{GPU}: {UUID0} unhealthy again after the plugin restart that re-read it at "
        "2026-01-01T01:00:00.000Z: the GPU is really unhealthy"
    )
    assert "look at the GPU: dmesg | grep -i xid; nvidia-smi -q" in cause.fix


def test_a_restart_asked_for_now_and_recovery_off_are_said() -> None:
    asked = recovery_cause(Reading({GPU: {**SECTION[GPU], "restart_asked_for": [UUID0]}}))
    assert asked.verdict == "ok"
    assert f"{GPU}: a plugin restart is asked for now (liveness fails) to re-read {UUID0}" in asked.evidence
    off = recovery_cause(Reading("off (--recover-unhealthy-after 0)"))
    assert off.verdict == "unknown"
    assert "set --recover-unhealthy-after" in off.evidence[1]


@pytest.mark.parametrize("doc", [None, 7, [1, 2], {GPU: "x"}, {GPU: {"restarts": "many", "recovered": 3}}])
def test_any_section_gives_a_row(doc: object) -> None:
    assert recovery_cause(Reading(doc)).verdict in ("ok", "unknown")


class _Status(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[HTTPServer] = []

    def start(body: bytes) -> str:
        handler = type("Handler", (_Status,), {"body": body})
        server = HTTPServer(("127.0.0.1", 0), handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}/status"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_sidecars_status_is_read_and_anything_else_is_said(serve: Any) -> None:
    url = serve(json.dumps({"unhealthy_recovery": SECTION}).encode())
    assert read_recovery(url, 2.0) == Reading(SECTION)
    assert "not the sidecar's JSON" in (read_recovery(serve(b"<html>"), 2.0) or Reading(None)).error
    assert "no unhealthy_recovery" in (read_recovery(serve(b"{}"), 2.0) or Reading(None)).error
    assert "over 1048576 bytes" in (read_recovery(serve(b" " * (2 << 20)), 2.0) or Reading(None)).error
    assert read_recovery(f"http://127.0.0.1:{free_port()}/status", 0.5) is None  # no sidecar: no row
    assert "an http:// address" in (read_recovery("file:///etc/passwd", 0.5) or Reading(None)).error


def test_the_flag_and_its_variable() -> None:
    assert parse_settings([]).sidecar_status == "http://127.0.0.1:9395/status"
    assert parse_settings(["--sidecar-status", ""]).sidecar_status == ""
    assert parse_settings([], {"HAMI_GUARD_SIDECAR_STATUS": "http://127.0.0.1:1/status"}).sidecar_status == (
        "http://127.0.0.1:1/status"
    )
