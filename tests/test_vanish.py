"""Restart or crash? The verdict on a vanished plugin socket, against real sockets, in the narrow
window an end-to-end run rarely hits: right after a kubelet restart, before any probe has run."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace

import pytest

from sidecar.app import Sidecar, plugin_check
from sidecar.config import Settings
from sidecar.health import Status
from sidecar.probes import socket_identity

GPU = "nvidia.com/gpu"


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sidecar(dp_dir: str) -> Sidecar:
    settings = replace(Settings(), device_plugin_dir=dp_dir, registration_grace=60.0, vanish_settle=0.0)
    return Sidecar(settings, clock=Clock())


def listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen()
    return s


def seen_plugin_socket(sidecar: Sidecar, path: str) -> None:
    """The plugin socket as a probe saw it answer, then removed (the plugin's process is gone)."""
    identity = socket_identity(path)
    assert not isinstance(identity, str)
    sidecar._plugin_ids[GPU] = identity
    os.unlink(path)


async def test_a_plugin_socket_newer_than_the_answering_kubelet_sock_was_not_removed_by_it(
    sidecar: Sidecar,
) -> None:
    s = sidecar.settings
    with listen(s.kubelet_path):
        await asyncio.sleep(0.02)  # the plugin registered after the kubelet listened
        with listen(s.plugin_path(s.plugins[0])):
            pass
        seen_plugin_socket(sidecar, s.plugin_path(s.plugins[0]))
        sidecar._kubelet_down = True  # a restart's first sign came; no probe has confirmed it yet
        assert sidecar._restart_removed(s.plugins[0]) == ""


async def test_an_older_plugin_socket_during_a_restart_was_removed_by_it(sidecar: Sidecar) -> None:
    s = sidecar.settings
    with listen(s.plugin_path(s.plugins[0])):
        pass
    seen_plugin_socket(sidecar, s.plugin_path(s.plugins[0]))
    await asyncio.sleep(0.02)
    with listen(s.kubelet_path):  # the new kubelet listens after its cleanup
        sidecar._kubelet_down = True
        assert sidecar._restart_removed(s.plugins[0]) == "a kubelet restart is under way"
    # The old kubelet's file, left behind, refuses: a restart too.
    assert sidecar._restart_removed(s.plugins[0]) == "kubelet.sock refuses connections"
    os.unlink(s.kubelet_path)
    assert sidecar._restart_removed(s.plugins[0]) == "kubelet.sock is gone"


async def test_a_crash_fails_at_once_even_within_the_grace(sidecar: Sidecar) -> None:
    s = sidecar.settings
    name = plugin_check(GPU)
    with listen(s.kubelet_path):
        await asyncio.sleep(0.02)
        with listen(s.plugin_path(s.plugins[0])):
            pass
        seen_plugin_socket(sidecar, s.plugin_path(s.plugins[0]))
        sidecar.state.reset([name])  # e.g. a kubelet restart a moment ago: the grace starts again
        sidecar._judging.add(GPU)
        await sidecar._judge_vanished(s.plugins[0])
    check = sidecar.state.checks[name]
    assert check.status is Status.FAILED
    assert "removed while the kubelet kept running" in check.reason
    assert sidecar.state.grace_left(check) == 60.0  # the grace had not run out


async def test_a_restart_keeps_the_plugin_pending(sidecar: Sidecar) -> None:
    s = sidecar.settings
    name = plugin_check(GPU)
    sidecar.state.report(name, True)
    with listen(s.plugin_path(s.plugins[0])):
        pass
    seen_plugin_socket(sidecar, s.plugin_path(s.plugins[0]))
    sidecar._kubelet_id = None
    sidecar._judging.add(GPU)
    await sidecar._judge_vanished(s.plugins[0])  # kubelet.sock is gone: a restart
    assert sidecar.state.checks[name].status is Status.PENDING
