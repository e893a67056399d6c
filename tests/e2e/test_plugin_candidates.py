"""--plugin-candidates with the real kubelet (tests/realkubelet) in a network namespace of its own, as in
a pod without hostNetwork: the sidecar learns the resource this pod's plugin serves, past a look-alike of
another candidate served from another namespace, then judges it with the real device manager, and it
restarts nothing on the way (sidecar/deviceplugin/candidates.py)."""

from __future__ import annotations

from typing import Any

from hami_guard.flags import PluginSpec
from testing import netns
from testing.netns import Netns, PluginProcess
from tests.e2e.conftest import Watch

THEIRS = PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock")
OURS = PluginSpec("huawei.com/Ascend310P", "Ascend310P.sock")


async def test_the_real_kubelet_holds_the_chosen_candidate(node_factory: Any, process_table: None) -> None:
    netns.require()
    async with node_factory(
        kubelet_netns=True, plugins=(), plugin_candidates=(THEIRS, OURS), polling_interval=0.05
    ) as node:
        watch = Watch(node)
        await watch.started()
        with Netns() as other:
            theirs = PluginProcess.start(
                other, node.dir, resource=THEIRS.resource, socket_name=THEIRS.socket, devices=["NPU-9-0"]
            )
            try:
                await node.until(
                    "/readyz?verbose",
                    503,
                    contains="Ascend910B3.sock: no listener in this pod's network namespace",
                )
                assert node.sidecar.waiting
                await node.plugin(OURS.resource, OURS.socket, ["NPU-0-0", "NPU-0-1"], watch_kubelet=False)
                took = await node.until("/readyz", 200, timeout=30)
                print(f"{node.release}: ready {took:.2f} s after this pod's plugin registered")
            finally:
                theirs.stop()
        codes = await watch.stop()
        assert node.sidecar.settings.plugins == (OURS,)
        assert f"registered:{OURS.resource}" in node.sidecar.state.checks
        assert set(codes) == {200}, [b for _, c, b in watch.seen if c != 200][:1]
