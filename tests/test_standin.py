"""The node end-to-end tests' stand-in for HAMi's plugin (testing.standin), against the simulated
kubelet: it registers HAMi's split IDs, and each fault file does what tests/node/e2e_node.py relies on."""

from __future__ import annotations

import asyncio
import os

import pytest

from sidecar.hami.annotation import gpu_of
from testing import FakeKubelet
from testing.hamiwriter import Gpu
from testing.plugin import hami_device_ids
from testing.standin import (
    ANNOTATION_PATCH_FAILS,
    APPLIED,
    DEAD_GPU,
    DROP,
    FAIL_REGISTER,
    IGNORE_KUBELET_RESTART,
    NOREGISTER,
    UUID_PREFIX,
    XID,
    StandInPlugin,
    apply_control,
    gpu_view,
    main,
    parse_faults,
    take_one_shot,
)
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


async def test_standin_dead_gpu_and_held_faults(kubelet: FakeKubelet, dp_dir: str, short_tmp: str) -> None:
    """dead-gpu reports the first GPU's split devices Unhealthy (and Healthy once the file is gone); a
    fault held on by --faults holds whatever the folder says."""
    control = os.path.join(short_tmp, "control")
    os.mkdir(control)
    devices = hami_device_ids(["GPU-a", "GPU-b"])
    plugin = StandInPlugin(dp_dir, RESOURCE, devices=devices, register_timeout=5)
    plugin.first_gpu = tuple(devices[:10])
    async with plugin:
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices))
        open(os.path.join(control, DEAD_GPU), "w").close()
        open(os.path.join(control, NOREGISTER), "w").close()
        apply_control(plugin, control)
        assert applied(control) == f"{DEAD_GPU},{NOREGISTER}"  # what tests/node's fault_applied waits for
        os.unlink(os.path.join(control, NOREGISTER))
        apply_control(plugin, control)
        assert applied(control) == DEAD_GPU
        await wait_for(lambda: kubelet.unhealthy_devices(RESOURCE) == sorted(devices[:10]), what="GPU-a dead")
        assert kubelet.healthy_devices(RESOURCE) == sorted(devices[10:])
        assert all(d.startswith("GPU-a-") for d in kubelet.unhealthy_devices(RESOURCE))
        os.unlink(os.path.join(control, DEAD_GPU))
        apply_control(plugin, control)
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices), what="healthy")
        assert kubelet.unhealthy_devices(RESOURCE) == []

        # Held on: no file in the folder, and still in force (APPLIED says the folder's files only).
        held = parse_faults(f" {NOREGISTER}, {DEAD_GPU} ")
        apply_control(plugin, control, held)
        assert not plugin.register_enabled and plugin.gpu_dead
        assert applied(control) == ""
        await wait_for(lambda: len(kubelet.unhealthy_devices(RESOURCE)) == 10, what="GPU-a dead, held")
        attempts = plugin.register_attempts
        assert not await plugin.register()
        assert plugin.register_attempts == attempts
        apply_control(plugin, control)
        assert plugin.register_enabled and not plugin.gpu_dead


def applied(control: str) -> str:
    with open(os.path.join(control, APPLIED)) as f:
        return f.read()


async def test_standin_failed_start_and_xid(kubelet: FakeKubelet, dp_dir: str, short_tmp: str) -> None:
    """fail-register: the next Register is refused, the plugin stops (its socket goes) and starts again
    after its retry interval; a kubelet.sock created meanwhile starts it at once. xid: the first GPU's
    devices Unhealthy until the plugin restarts, whatever the folder says after."""
    control = os.path.join(short_tmp, "control")
    os.mkdir(control)
    devices = hami_device_ids(["GPU-a", "GPU-b"])
    plugin = StandInPlugin(dp_dir, RESOURCE, devices=devices, register_timeout=5, retry_interval=1.0)
    plugin.first_gpu = tuple(devices[:10])
    plugin.stop_on_register_failure = True
    async with plugin:
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices))

        open(os.path.join(control, FAIL_REGISTER), "w").close()
        apply_control(plugin, control)
        assert not os.path.exists(os.path.join(control, FAIL_REGISTER))  # one-shot
        await kubelet.restart()
        await wait_for(lambda: "not supported" in (plugin.last_register_error or ""), what="the refusal")
        assert plugin.register_attempts == 2
        await wait_for(lambda: not plugin.serving, what="the plugin stopped")
        assert not os.path.exists(plugin.socket_path)
        await wait_for(lambda: plugin.registrations == 2, timeout=5, what="the start tried again")
        assert plugin.register_attempts == 3 and plugin.serving

        # A failed start again, and kubelet.sock created before its retry: started at once.
        plugin.retry_interval = 60.0
        plugin.fail_next_register = True
        await kubelet.restart()
        await wait_for(lambda: not plugin.serving, what="the plugin stopped")
        await kubelet.restart()
        await wait_for(lambda: plugin.registrations == 3, timeout=5, what="started on kubelet.sock")
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices))

        open(os.path.join(control, XID), "w").close()
        apply_control(plugin, control)
        assert not os.path.exists(os.path.join(control, XID))
        await wait_for(lambda: sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices[10:]))
        apply_control(plugin, control)  # the file is gone; the device stays Unhealthy
        await asyncio.sleep(0.2)
        assert sorted(kubelet.healthy_devices(RESOURCE)) == sorted(devices[10:])


def test_standin_faults_flag() -> None:
    """--faults takes lasting faults only: a one-shot drop or an unknown name is refused."""
    assert parse_faults("") == frozenset()
    assert parse_faults(IGNORE_KUBELET_RESTART) == {IGNORE_KUBELET_RESTART}
    for bad in (DROP, "noregistr", f"{NOREGISTER},x"):
        with pytest.raises(ValueError, match="unknown fault"):
            parse_faults(bad)
        with pytest.raises(SystemExit) as e:
            main(["--faults", bad])
        assert e.value.code == 2


def test_standin_gpu_view_and_the_one_shot_patch_fault(short_tmp: str) -> None:
    """What the stand-in's HAMi annotation carries: one GPU per UUID of the split IDs, healthy while all its
    splits are, its UUID of NVML's shape (the sidecar compares only those with the kubelet's IDs);
    `annotation-patch-fails` is taken once, by the PATCH that fails."""
    assert gpu_of(f"GPU-{UUID_PREFIX}0001-9") == f"GPU-{UUID_PREFIX}0001"
    devices = dict.fromkeys(hami_device_ids(["GPU-a", "GPU-b"]), "Healthy")
    assert gpu_view(devices) == [Gpu("GPU-a"), Gpu("GPU-b")]
    devices["GPU-b-3"] = "Unhealthy"
    assert gpu_view(devices) == [Gpu("GPU-a"), Gpu("GPU-b", healthy=False)]
    assert not take_one_shot(os.path.join(short_tmp, "none"), ANNOTATION_PATCH_FAILS)
    open(os.path.join(short_tmp, ANNOTATION_PATCH_FAILS), "w").close()
    assert take_one_shot(short_tmp, ANNOTATION_PATCH_FAILS)
    assert not take_one_shot(short_tmp, ANNOTATION_PATCH_FAILS)
    assert not os.path.exists(os.path.join(short_tmp, ANNOTATION_PATCH_FAILS))
