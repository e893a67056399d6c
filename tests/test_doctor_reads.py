"""hami-doctor's reads of URLs and the API server: each within one deadline, however the server drips;
and `--kubeconfig` for every API route it takes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from doctor.recovery import read_recovery
from doctor.settings import parse_settings
from tests.test_doctor import Doctor, row

DRIP_BYTES = 200  # one every DRIP_PERIOD: 10 s in all, far past the deadlines below
DRIP_PERIOD = 0.05


@dataclass
class Drip:
    """A loopback HTTP server that answers each GET with a 200 whose body comes one byte at a time,
    DRIP_BYTES of them, then closes; `sent` counts the body's bytes each connection took."""

    url: str
    sent: list[int] = field(default_factory=list)


@pytest.fixture
def drip() -> Iterator[Drip]:
    server = socket.create_server(("127.0.0.1", 0))
    found = Drip(f"http://127.0.0.1:{server.getsockname()[1]}/status")
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)  # the request
            head = (
                f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {DRIP_BYTES}\r\n\r\n"
            )
            sent = 0
            try:
                conn.sendall(head.encode())
                while sent < DRIP_BYTES and not stop.is_set():
                    conn.sendall(b" ")
                    sent += 1
                    time.sleep(DRIP_PERIOD)
            except OSError:
                pass  # the client hung up
            found.sent.append(sent)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield found
    finally:
        stop.set()
        server.close()


def test_a_dripping_status_ends_at_the_deadline_with_a_clear_message(drip: Drip) -> None:
    """Each byte comes well within the per-read timeout: only a deadline of the whole read ends it."""
    reading = read_recovery(drip.url, 0.5)
    assert reading is not None
    assert reading.error == f"{drip.url}: no whole answer within 0.5s (the deadline of the whole read)"
    deadline = time.monotonic() + 30
    while not drip.sent and time.monotonic() < deadline:  # the server's side of the hang-up
        time.sleep(0.01)
    assert drip.sent and drip.sent[0] < DRIP_BYTES  # cut before the drip ended


async def test_the_doctor_says_a_dripping_sidecar_status(drip: Drip, short_tmp: str, dp_dir: str) -> None:
    """hami-doctor --sidecar-status against it: the row says the deadline, the run goes on."""
    logs = [os.path.join(short_tmp, name) for name in ("kubelet.log", "plugin.log")]
    for log in logs:
        Path(log).touch()
    code, doc = await Doctor(dp_dir, short_tmp, *logs).report("--sidecar-status", drip.url)
    assert code == 1  # kubelet.sock is missing here: a problem, and a report
    evidence = row(doc, "unhealthy-devices")["evidence"]
    assert evidence == [f"{drip.url}: no whole answer within 0.5s (the deadline of the whole read)"]


def kubeconfig(tmp: str, server: str) -> str:
    doc = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "kubeconfig-token"}}],
    }
    path = os.path.join(tmp, "kubeconfig.json")
    Path(path).write_text(json.dumps(doc))
    return path


def test_the_kubeconfig_serves_the_resourceslices_route(short_tmp: str) -> None:
    """--dra-resourceslices with --kubeconfig: the kubeconfig's server and credentials, as for HAMi's
    registration; no --kube-api-server needed."""
    path = kubeconfig(short_tmp, "https://127.0.0.1:6443")
    argv = ["--dra-driver", "gpu.example.com", "--dra-resourceslices", "--kubeconfig", path]
    s = parse_settings(argv, environ={"NODE_NAME": "n1"})
    assert s.dra_api is not None
    assert (s.dra_api.server, s.dra_api.token, s.dra_node) == (
        "https://127.0.0.1:6443",
        "kubeconfig-token",
        "n1",
    )
    assert s.dra_api.source.startswith(f"kubeconfig {path}")
    # And hami-doctor runs with it (no usage error), the server unreachable being evidence, not a refusal.
    done = subprocess.run(
        [sys.executable, "-m", "doctor", *argv, "--device-plugin-dir", short_tmp, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_NAME": "n1"},
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    assert "no --kube-api-server" not in done.stderr
