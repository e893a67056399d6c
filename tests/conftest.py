"""Shared fixtures: short temporary folders (Unix socket paths are limited to 107 bytes) and the simulator."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from testing import FakeDevicePlugin, FakeKubelet
from testing.realdra import missing_reason
from testing.realdra import selected_releases as dra_releases


@pytest.fixture
def short_tmp() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hg-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dp_dir(short_tmp: str) -> str:
    path = os.path.join(short_tmp, "device-plugins")
    os.mkdir(path, 0o750)
    return path


@pytest.fixture
async def kubelet(dp_dir: str, short_tmp: str) -> AsyncIterator[FakeKubelet]:
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    async with FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5) as k:
        yield k


@pytest.fixture
async def plugin(kubelet: FakeKubelet, dp_dir: str) -> AsyncIterator[FakeDevicePlugin]:
    async with FakeDevicePlugin(dp_dir, register_timeout=5, retry_interval=30) as p:
        await wait_for(lambda: kubelet.healthy_devices("nvidia.com/gpu") == ["GPU-0", "GPU-1"])
        yield p


async def wait_for(predicate: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Poll a condition every 5 ms; fail the test with `what` when it does not hold in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.005)


def wait_ready(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    """Poll a sidecar process's /sidecarz until it answers 200; fail with its log if it exits first."""

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/sidecarz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "the sidecar exited"
        assert time.monotonic() < deadline, "the sidecar did not become ready"
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Ends a process the test started: SIGTERM, 10 s to exit, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def require_tool(name: str) -> str:
    """The path of a tool; a skip where it is missing, and a failure in CI (CI=true)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required in CI (.ci/run installs it)")
        pytest.skip(f"{name} not installed")
    return path


@pytest.fixture
def process_table() -> Iterator[None]:
    """Held by every test that starts a stand-in kubelet (a process named kubelet, k3s-server or kubelite)
    or reads the machine's process table for one: an exclusive lock on a file of the machine's temporary
    folder, so that no such test sees another's stand-in, whichever pytest-xdist worker or pytest run it
    is in."""
    path = os.path.join(tempfile.gettempdir(), "hami-guard-tests-process-table.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@pytest.fixture
def kubelet_elsewhere(short_tmp: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real process named `kubelet` listening on a socket of its own, away from the checked path."""
    exe = os.path.join(short_tmp, "kubelet")
    os.symlink(os.path.realpath(sys.executable), exe)
    where = os.path.join(short_tmp, "elsewhere.sock")
    code = (
        "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([exe, "-c", code, where], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    try:
        yield proc, where
    finally:
        proc.kill()
        proc.wait()


def require_dra_fixture(release: str) -> None:
    """Skip where the DRA fixture (tests/realdra) of a release is not built; fail under CI=true."""

    reason = missing_reason(release)
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI builds it: .ci/run runs `make dra-fixtures`)")
        pytest.skip(reason)


@pytest.fixture(params=dra_releases())
def dra_release(request: pytest.FixtureRequest) -> str:
    """A release of the DRA fixture: "new" and "old", or those $REALDRA_RELEASES names."""
    rel: str = request.param
    require_dra_fixture(rel)
    return rel
