"""What each image runs, proven to start: no Docker engine here, so the test does what the
Dockerfile does (the wheel plus exactly the image's pinned requirements, in a fresh virtual
environment) and runs the Dockerfile's ENTRYPOINT from there."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.testing import free_port
from tests.conftest import wait_ready

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "/opt/hami-guard"


def dockerfile(name: str) -> tuple[list[str], str]:
    """The image's ENTRYPOINT and the requirements file it installs."""
    text = (ROOT / name).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    reqs = re.search(r"^COPY (requirements/\S+)", text, re.MULTILINE).group(1)  # type: ignore[union-attr]
    return entry, reqs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            ".",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("hami_guard-*.whl")
    return built


def image_venv(tmp: Path, wheel: Path, requirements: str) -> Path:
    venv = tmp / "opt-hami-guard"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "--quiet",
            "--no-deps",
            "-r",
            str(ROOT / requirements),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return venv


def entry(argv: list[str], venv: Path) -> list[str]:
    return [a.replace(PREFIX, str(venv)) for a in argv]


@pytest.fixture
def listening(short_tmp: str) -> Iterator[str]:
    folder = os.path.join(short_tmp, "device-plugins")
    os.mkdir(folder)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(folder, "kubelet.sock"))
        s.listen()
        yield folder


def test_init_image_runs_initcheck_with_psutil_only(wheel: Path, tmp_path: Path, listening: str) -> None:
    argv, reqs = dockerfile("Dockerfile.init")
    assert Path(ROOT / reqs).read_text().count("==") == 1  # psutil, and nothing else
    venv = image_venv(tmp_path, wheel, reqs)
    shutil.rmtree(
        next((venv / "lib").glob("python3*")) / "site-packages" / "sidecar"
    )  # as the Dockerfile does
    ok = subprocess.run(
        [*entry(argv, venv), "--device-plugin-dir", listening], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("ok: ")
    failing = subprocess.run([*entry(argv, venv), "--device-plugin-dir", "/nonexistent"], capture_output=True)
    assert failing.returncode == 100
    for module in ("grpc", "aiohttp", "watchdog", "sidecar"):
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c", f"import {module}"], cwd=tmp_path, capture_output=True
        )
        assert probe.returncode != 0, f"{module} is in the init image"


def test_sidecar_image_serves(wheel: Path, tmp_path: Path, listening: str) -> None:
    argv, reqs = dockerfile("Dockerfile.sidecar")
    venv = image_venv(tmp_path, wheel, reqs)
    port = free_port()
    proc = subprocess.Popen(
        [*entry(argv, venv), "--device-plugin-dir", listening, "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=15)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            assert b"device_plugin_check_up" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
