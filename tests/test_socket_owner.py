"""Who serves a plugin socket: `hami_guard.node.unixdiag.socket_owner`, with real listeners in real network
namespaces (`testing.netns`: root, as in CI)."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator

import pytest

from hami_guard.node.unixdiag import socket_owner
from testing import netns
from testing.netns import Netns

OWNER = (
    "import json, sys; from hami_guard.node.unixdiag import socket_owner; "
    "o = socket_owner(*sys.argv[1:]); print(json.dumps([o.verdict, o.reason]))"
)


def owner_seen_from(ns: Netns, *args: str) -> list[str]:
    """socket_owner as a process in `ns` sees it (as a sidecar in that pod would)."""

    done = ns.run([sys.executable, "-c", OWNER, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    verdict: list[str] = json.loads(done.stdout)
    return verdict


@pytest.fixture
def namespaces() -> Iterator[tuple[Netns, Netns]]:
    netns.require()
    with Netns() as pod, Netns() as other:
        yield pod, other


def test_this_pods_listener_then_another_plugin_that_rebinds_the_path(
    dp_dir: str, namespaces: tuple[Netns, Netns]
) -> None:
    pod, other = namespaces
    assert pod.inode != other.inode
    ours = pod.plugin(dp_dir, register=False)
    try:
        path = ours.socket_path
        assert owner_seen_from(pod, path)[0] == "this-pod"
        assert owner_seen_from(other, path)[0] == "elsewhere"
        theirs = other.plugin(dp_dir, register=False)  # the GPU Operator's plugin: same socket name
        try:
            assert os.stat(path).st_ino == theirs.socket_inode != ours.socket_inode
            verdict, reason = owner_seen_from(pod, path)
            assert verdict == "elsewhere"
            assert reason.startswith("another device plugin serves nvidia-gpu.sock")
            assert owner_seen_from(other, path)[0] == "this-pod"
        finally:
            theirs.stop()
    finally:
        ours.stop()


def test_the_host_network_cannot_tell(dp_dir: str, short_tmp: str) -> None:
    """Where the kubelet's listener is in this namespace (hostNetwork), every plugin's could be too."""
    kubelet = os.path.join(dp_dir, "kubelet.sock")
    plugin = os.path.join(dp_dir, "nvidia-gpu.sock")
    with socket.socket(socket.AF_UNIX) as k, socket.socket(socket.AF_UNIX) as p:
        k.bind(kubelet)
        k.listen()
        p.bind(plugin)
        p.listen()
        owner = socket_owner(plugin, kubelet)
        assert owner.verdict == "unknown"
        assert owner.reason.startswith("host network: the kubelet's listener on kubelet.sock is in this")
        assert socket_owner(plugin).verdict == "this-pod"  # no kubelet to compare with: this namespace


def test_a_dead_file_a_regular_file_and_nothing(dp_dir: str) -> None:
    dead = os.path.join(dp_dir, "dead.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)
    assert socket_owner(dead) == socket_owner(dead, None, [])
    assert (socket_owner(dead).verdict, socket_owner(dead).reason) == (
        "unknown",
        "nothing listens on dead.sock: no process serves it",
    )
    regular = os.path.join(dp_dir, "file.sock")
    open(regular, "w").close()
    assert socket_owner(regular).reason == f"{regular} is not a socket"
    assert socket_owner(os.path.join(dp_dir, "none.sock")).verdict == "unknown"


def test_the_helper_says_why_it_cannot_run() -> None:
    if os.geteuid() == 0:
        assert netns.unavailable() is None or "unshare" in (netns.unavailable() or "")
    else:
        assert netns.unavailable() == "needs root for unshare --net (CI runs as root)"
