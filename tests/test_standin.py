"""The node end-to-end tests' stand-in for HAMi's plugin (sidecar.testing.standin), against the simulated
kubelet: it registers HAMi's split IDs, and each fault file does what tests/node/e2e_node.py relies on."""

from __future__ import annotations

import asyncio
import os

from sidecar.testing import FakeKubelet
from sidecar.testing.plugin import hami_device_ids
from sidecar.testing.standin import DROP, IGNORE_KUBELET_RESTART, NOREGISTER, StandInPlugin, apply_control
from tests.conftest import wait_for

RESOURCE = "nvidia.com/gpu"


async def test_standin_faults(kubelet: FakeKubelet, dp_dir: str, short_tmp: str) -> None:
    control = os.path.join(short_tmp, "control")
    devices = hami_device_ids(["GPU-a", "GPU-b"])
    assert len(devices) == 20 and devices[0] == "GPU-a-0"
    plugin = StandInPlugin(dp_dir, RESOURCE, devices=devices, register_timeout=5)
    async with plugin:
        apply_control(plugin, control)  # no folder: no fault
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices))

        # A drop: the kubelet's stream ends, the plugin still serves and does not register again.
        os.mkdir(control)
        open(os.path.join(control, DROP), "w").close()
        apply_control(plugin, control)
        assert not os.path.exists(os.path.join(control, DROP))  # one-shot
        await wait_for(lambda: kubelet.streams(RESOURCE) == 0, what="the stream ended")
        assert plugin.serving and plugin.registrations == 1

        # kubelet.sock re-created: ignored while the file exists...
        open(os.path.join(control, IGNORE_KUBELET_RESTART), "w").close()
        apply_control(plugin, control)
        await kubelet.restart()
        await wait_for(lambda: os.path.exists(kubelet.socket_path))
        await asyncio.sleep(0.5)  # ten times the plugin's folder polling interval
        assert plugin.registrations == 1 and plugin.register_attempts == 1
        # ...and answered as HAMi does without it.
        os.unlink(os.path.join(control, IGNORE_KUBELET_RESTART))
        apply_control(plugin, control)
        await kubelet.restart()
        await wait_for(lambda: plugin.registrations == 2, what="registered again")
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices))

        # noregister: no Register call at all.
        open(os.path.join(control, NOREGISTER), "w").close()
        apply_control(plugin, control)
        attempts = plugin.register_attempts
        assert not await plugin.register()
        assert plugin.register_attempts == attempts
