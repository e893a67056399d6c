"""A plugin socket removed by someone else while its plugin still listens: pending for the grace, never
the crash that fails liveness at once, and the kubelet's connections still matched by the listener's
own identity (docs/design.md#plugin-listener)."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from functools import partial

import aiohttp

from sidecar.config import PluginSpec
from testing import FakeDevicePlugin, FakeKubelet, free_port
from tests.conftest import wait_for
from tests.e2e.conftest import FAST, GPU, Node, NodeFactory, Watch, sidecar_running

GRACE = 30.0  # long against the test: any 503 here is the crash verdict, never the grace
OTHER = "example.com/dev"  # another plugin's resource, which the kubelet holds


async def test_registered_never_says_no_connection_while_the_listener_holds_the_kubelet(
    make_node: NodeFactory,
) -> None:
    async with make_node(registration_grace=GRACE) as node:
        await node.until("/healthz", 200)
        os.unlink(node.plugin.socket_path)  # the plugin listens on, the kubelet keeps its stream
        await node.wait_rounds(rounds=3)
        assert node.plugin.serving and node.kubelet.healthy_devices(GPU)
        _, body = await node.get("/readyz?verbose")
        registered = next(line for line in body.splitlines() if f"registered:{GPU}" in line)
        assert registered == f"[+]registered:{GPU} ok", body
        # By the connection itself, matched through the listener's file, not by pod-resources.
        status = json.loads((await node.get("/status"))[1])
        assert status["checks"][f"registered:{GPU}"]["reason"].startswith("the kubelet holds a connection")
        assert "still listens" in (await node.get("/healthz?verbose"))[1]
        assert (await node.get("/healthz"))[0] == 200


def registered_again(node: Node, target: int) -> bool:
    return node.plugin.registrations >= target


async def test_a_socket_removed_after_an_in_process_reserve_is_pending_never_a_crash(
    make_node: NodeFactory,
) -> None:
    """HAMi re-serves its socket in-process when kubelet.sock is created, and Go binds the new file
    before it listens: the round the creation event asks for looks for the listener in between. A
    later removal by someone else must still find it: pending, never a 503 before the grace."""
    async with make_node(registration_grace=GRACE) as node:
        await node.until("/healthz", 200)
        for trial in range(3):
            node.plugin.listen_delay = 0.4  # the round the new file's event asks for looks in the gap
            target = node.plugin.registrations + 1
            await node.plugin.restart()
            await wait_for(partial(registered_again, node, target), what="registered again")
            await node.until("/healthz", 200, timeout=10.0)
            watch = Watch(node, "/healthz")
            await watch.started()
            os.unlink(node.plugin.socket_path)
            await node.wait_rounds(rounds=2)
            await asyncio.sleep(0.3)  # past the restart window, where a crash would be judged
            codes = await watch.stop()
            assert 503 not in codes, f"trial {trial}: a 503 before the grace"
            _, body = await node.get("/healthz?verbose")
            assert "still listens" in body, body
            # The plugin serves its file again, as a plugin restart would.
            node.plugin.listen_delay = 0.0
            await node.plugin.restart()


async def test_status_names_a_layout_without_pod_resources_unsafe(make_node: NodeFactory) -> None:
    """Without pod-resources nothing live tells a registration where the connections cannot be read:
    /status says so, and says nothing of it while pod-resources is read."""
    async with make_node() as node:
        await node.until("/healthz", 200)
        status = json.loads((await node.get("/status"))[1])
        assert status["live_evidence"] == {"pod_resources": "read"}
        os.unlink(node.settings.pod_resources_socket)  # as if the folder were not mounted
        await node.wait_rounds(rounds=2)
        status = json.loads((await node.get("/status"))[1])
        assert "look-alike" in status["live_evidence"]["unsafe"]
        assert (await node.get("/healthz"))[0] == 200  # the connection, readable here, still decides


async def test_a_symbolic_link_to_a_held_socket_never_passes_for_a_dropped_plugin(
    dp_dir: str, short_tmp: str
) -> None:
    """After a drop, the plugin's path replaced by a symbolic link to another plugin's socket, which the
    kubelet holds: the link is not the plugin's socket (its identity is never read through a link), so
    neither the probe nor the kubelet's connections to the other socket count for it."""
    settings = replace(
        FAST,
        device_plugin_dir=dp_dir,
        pod_resources_socket="/nonexistent",  # the connections alone decide
        port=free_port(),
        plugins=(PluginSpec(GPU, "nvidia-gpu.sock"),),
    )
    async with (
        FakeKubelet(dp_dir, dial_timeout=0.5) as kubelet,
        FakeDevicePlugin(dp_dir, register_timeout=5) as gpu,
        FakeDevicePlugin(dp_dir, OTHER, "other.sock", ["dev-0"], register_timeout=5) as other,
    ):
        await wait_for(lambda: kubelet.healthy_devices(GPU) and kubelet.healthy_devices(OTHER))
        async with sidecar_running(settings), aiohttp.ClientSession() as http:
            node = Node(dp_dir, kubelet, gpu, None, settings, http)  # type: ignore[arg-type]
            await node.until("/healthz", 200)
            await kubelet.drop(GPU)
            await node.until("/healthz?verbose", 503, contains="dropped the plugin")
            os.unlink(gpu.socket_path)
            os.symlink(other.socket_path, gpu.socket_path)
            watch = Watch(node, "/healthz?verbose")
            await watch.started()
            await asyncio.sleep(2.5)  # rounds past the grace (2 s)
            answers = watch.seen[:]
            await watch.stop()
            assert {code for _, code, _ in answers} == {503}, answers[-1][2]
            assert not any(f"[+]registered:{GPU}" in body for _, _, body in answers), answers[-1][2]
            assert "is a symbolic link" in answers[-1][2]
