"""The node end-to-end tests' stand-in for HAMi's plugin (testing.standin), against the simulated
kubelet: it registers each vendor's device IDs on the vendor's socket, writes each vendor's annotation as
its plugin does, and each fault file does what tests/node/e2e_node.py relies on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from typing import Any

import pytest

from hami_guard import profiles
from sidecar.hami import annotation as anno
from sidecar.hami.compare import compare
from testing import FakeKubelet, hamiwriter, vendorids
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
    arguments,
    gpu_view,
    loop_starts,
    main,
    parse_faults,
    registrar,
    resolve,
    take_one_shot,
    write_annotations,
)
from tests import apiserver
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
        # The refusal, then the stop: `serving` alone is False a moment inside the restart, before it.
        await wait_for(lambda: "not supported" in (plugin.last_register_error or ""), what="the refusal")
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
    assert anno.gpu_of(f"GPU-{UUID_PREFIX}0001-9") == f"GPU-{UUID_PREFIX}0001"
    cards = vendorids.form("nvidia").cards(2, 10, RESOURCE)
    a, b = (c.device for c in cards)
    assert a == f"GPU-{UUID_PREFIX}0000" and cards[0].shares == tuple(hami_device_ids([a]))
    devices = dict.fromkeys((s for c in cards for s in c.shares), "Healthy")
    assert gpu_view(devices, cards) == [Gpu(a), Gpu(b)]
    devices[f"{b}-3"] = "Unhealthy"
    assert gpu_view(devices, cards) == [Gpu(a), Gpu(b, healthy=False)]
    assert gpu_view({}, cards) == []
    assert not take_one_shot(os.path.join(short_tmp, "none"), ANNOTATION_PATCH_FAILS)
    open(os.path.join(short_tmp, ANNOTATION_PATCH_FAILS), "w").close()
    assert take_one_shot(short_tmp, ANNOTATION_PATCH_FAILS)
    assert not take_one_shot(short_tmp, ANNOTATION_PATCH_FAILS)
    assert not os.path.exists(os.path.join(short_tmp, ANNOTATION_PATCH_FAILS))


# Each vendor's kubelet device IDs, as its plugin's code makes them (testing/vendorids.py cites where);
# written here apart from the generator, so that an ID of another vendor's shape fails even where the
# vendor's profile folds it (Ascend's `[devices] id` is any word).
KUBELET_FORMS = {
    "nvidia": r"GPU-[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}-\d+",  # NVML's UUID, HAMi's split
    "ascend": r"[0-9A-F]{8}(?:-[0-9A-F]{8}){4}-\d+",  # DCMI's VDie ID, the vNPU's number
    "dcu": r"DCU-\S+-fake-\d+",  # DCU-<serial>, generateFakeDevs
    "amd": r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]#\d",  # sysfs's PCI address, the split
    "biren": r"card_\d+",  # cardIDFormat
}
# AMD's annotation names its GPUs by AMD SMI's UUID (amdsmi_uuid_gen: version 1, variant 2, function ff).
AMD_SMI_UUID = r"[0-9a-f]{2}ff[0-9a-f]{4}-0000-1000-80[0-9a-f]{2}-[0-9a-f]{12}"
STAMPS = {  # the handshake value each plugin writes with its register patch (None: it writes none)
    "nvidia": None,
    "amd": None,
    "ascend": r"Reported_\d{4}\.\d\d\.\d\d \d\d:\d\d:\d\d",
    "dcu": r"Reported \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? [+-]\d{4} \S+ m=\+\d+\.\d{9}",
    "biren": r"Reported_\d{1,2}\d\d6\.\d\d\.\d\d \d\d:\d\d:\d\d",  # Go's reading of "2026.01.02 ..."
}
VENDORS = [p.name for p in profiles.PROFILES]


def test_every_profile_has_a_standin() -> None:
    """The stand-in knows the device IDs and the plugin of every vendor profile, and what it knows agrees
    with the profile: a plugin that stamps the handshake is one of its writers, stamps on its own timer
    as the profile says, and caches its annotation only where the profile says one failed patch sticks."""
    assert sorted(vendorids.FORMS) == sorted(hamiwriter.PLUGINS) == sorted(VENDORS) == sorted(KUBELET_FORMS)
    for p in profiles.PROFILES:
        v = hamiwriter.Vendor.of(p.name, p.resources.default)
        assert bool(v.stamp) == (p.hami.handshake_writer in ("device-plugin", "both")), p.name
        assert (bool(v.stamp) and not v.on_list_and_watch) == p.hami.stamps_on_timer, p.name
        assert v.cached == p.hami.stuck_cache and v.format == p.hami.register_format, p.name


def fold_check(profile: profiles.VendorProfile, ids: list[str], gpus: int, split: int) -> list[str]:
    """What is wrong with kubelet device IDs as `profile`'s plugin's for `gpus` devices split `split`
    ways: folded by the profile, exactly `gpus` devices of its form, each listed `split` times, every ID
    of the vendor's form."""
    folded = Counter(profile.physical_device(d) for d in ids)
    wrong = [f"{d} is not a device of {profile.name}'s" for d in folded if not profile.is_device(d)]
    if len(folded) != gpus or set(folded.values()) - {split}:
        wrong.append(f"{len(ids)} IDs fold to {dict(folded)}, not {gpus} devices listed {split} times")
    wrong += [
        f"{d} is not of {profile.name}'s form"
        for d in ids
        if not re.fullmatch(KUBELET_FORMS[profile.name], d)
    ]
    return wrong


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_ids_fold_to_their_devices(vendor: str) -> None:
    """Each vendor's IDs, for several device counts and splits, fold back by its profile to the devices;
    another vendor's IDs do not pass as this one's."""
    p = profiles.named(vendor)
    assert p is not None
    form = vendorids.form(vendor)
    for gpus in (1, 2, 5, 9):
        for split in sorted({1, 3, form.split} - ({2, 3} if form.most == 1 else set())):
            cards = form.cards(gpus, split, p.resources.default)
            ids = [s for c in cards for s in c.shares]
            assert fold_check(p, ids, gpus, split) == [], (gpus, split)
            assert [c.device for c in cards] == list(dict.fromkeys(p.physical_device(d) for d in ids))
            assert len(set(c.annotated for c in cards)) == gpus
    for other in VENDORS:
        theirs = vendorids.form(other)
        split = min(form.split, theirs.most or form.split)
        ids = [s for c in theirs.cards(2, split, p.resources.default) for s in c.shares]
        assert bool(fold_check(p, ids, 2, split)) == (other != vendor), other
    if form.most is not None:
        with pytest.raises(ValueError, match="lists each device"):
            form.cards(2, form.most + 1, p.resources.default)


@pytest.mark.parametrize("vendor", VENDORS)
async def test_the_standin_plays_each_vendor(
    vendor: str, kubelet: FakeKubelet, dp_dir: str, short_tmp: str
) -> None:
    """`python -m testing.standin --vendor NAME`, a process of its own, registers the vendor's default
    resource with the kubelet simulator on the vendor's socket, with its device IDs: folded by its profile,
    exactly --gpus devices each listed --split times. SIGTERM ends it: its socket goes, the stream ends."""
    p = profiles.named(vendor)
    assert p is not None
    resource, socket = p.resources.default, p.socket_for(p.resources.default)
    assert profiles.for_socket(socket) == (p, resource)
    split, gpus = vendorids.form(vendor).split, 3
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    env.pop("HAMI_STANDIN_FAULTS", None)
    log = os.path.join(short_tmp, "standin.log")
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "testing.standin", "--vendor", vendor, "--gpus", str(gpus),
            "--device-plugin-dir", dp_dir, "--control", os.path.join(short_tmp, "control"),
            env=env, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not (kubelet.connected(resource) and kubelet.healthy_devices(resource)):
            if time.monotonic() > deadline or proc.returncode is not None:
                pytest.fail(f"{vendor}'s stand-in did not register {resource}: {tail(log)}")
            await asyncio.sleep(0.02)
        ids = kubelet.healthy_devices(resource)
        assert fold_check(p, ids, gpus, split) == []
        assert kubelet.register_calls == Counter({resource: 1}) and socket in os.listdir(dp_dir)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0, tail(log)
    await wait_for(lambda: not kubelet.connected(resource), what="the stand-in's stream ended")
    assert socket not in os.listdir(dp_dir)


def tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-2000:]


class NodeApi:
    """The API server as the annotation loop asks it: a Node to GET, its PATCHes recorded."""

    def __init__(self) -> None:
        self.patches: list[dict[str, str]] = []

    async def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any:
        if method == "PATCH":
            self.patches.append(body["metadata"]["annotations"])
        return {"metadata": {"name": path.rsplit("/", 1)[-1]}}


@pytest.mark.parametrize("vendor", VENDORS)
async def test_the_standin_writes_each_vendors_annotation(
    vendor: str, kubelet: FakeKubelet, dp_dir: str, short_tmp: str
) -> None:
    """The stand-in's annotation loop for each vendor writes that vendor's register key in the format HAMi
    decodes for it, naming the devices the kubelet lists (AMD's by AMD SMI's UUID, its PCI address in
    custominfo), the plugin's own handshake stamp where it writes one, and patches again every round
    where the plugin keeps no cache; a dead device shows where the plugin reports health."""
    args = arguments().parse_args(["--vendor", vendor, "--gpus", "2", "--control", short_tmp])
    assert resolve(args) is None
    p, v = profiles.named(vendor), hamiwriter.Vendor.of(vendor, args.resource)
    assert p is not None
    cards = vendorids.form(vendor).cards(args.gpus, args.split, args.resource)
    devices = [s for c in cards for s in c.shares]
    plugin = StandInPlugin(dp_dir, args.resource, args.socket, devices, register_timeout=5)
    plugin.first_gpu = cards[0].shares
    plugin.order_held = True  # NVIDIA's map order held: its cached second round skips
    api = NodeApi()
    async with plugin:
        await wait_for(lambda: sorted(kubelet.healthy_devices(args.resource)) == sorted(devices))
        listed = frozenset(kubelet.healthy_devices(args.resource))
        assert loop_starts(plugin, v) == 1
        writer = registrar(plugin, args, cards, api, "node-a")
        assert await writer.register_once() and await writer.register_once()
        plugin.set_gpu_dead(True)
        assert await writer.register_once()
    assert len(api.patches) == (2 if v.cached else 3)
    first, dead = api.patches[0], api.patches[-1]
    register, handshake = p.register_key(args.resource), p.handshake_key(args.resource)
    stamp = STAMPS[vendor]
    assert set(first) == {register} | ({handshake} if stamp else set()) | set(dict(v.extra))
    if stamp:
        assert re.fullmatch(stamp, first[handshake]), first
    got = anno.parse_register(first[register], p.hami.register_format)
    assert got.gpus is not None and [g.id for g in got.gpus] == [c.annotated for c in cards]
    assert all(g.health and g.count == args.split for g in got.gpus), got
    if vendor == "amd":
        assert all(re.fullmatch(AMD_SMI_UUID, g.id) for g in got.gpus)
        entries = json.loads(first[register])
        assert [e["custominfo"]["pciBDF"] for e in entries] == [c.device for c in cards]
    else:
        assert compare(register, first[register], got, listed, None, resource=args.resource).code == "ok"
    after = anno.parse_register(dead[register], p.hami.register_format)
    assert after.gpus is not None
    assert [g.health for g in after.gpus] == [not v.info.reports_health, True]


@pytest.mark.slow
async def test_the_standin_writes_every_vendors_annotation_to_a_real_api_server(
    kubelet: FakeKubelet, dp_dir: str, short_tmp: str
) -> None:
    """Against kube-apiserver (tests/apiserver.py; `make node-bins`, etcd), as the plugin's ServiceAccount
    with the chart's verbs on nodes (get, patch): every vendor's stand-in, beside the others on one node as
    on the node in a box, starts its loop when the kubelet takes it (Biren's when the kubelet opens
    ListAndWatch) and patches its register annotation, its handshake stamp where its plugin writes one,
    and Ascend's `hami-vnpu-core`; the API server takes every key."""
    reason = apiserver.missing()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    server = apiserver.ApiServer(os.path.join(short_tmp, "api"))
    os.mkdir(server.root)
    node = "node-in-a-box"
    try:
        await server.start()
        await server.request("POST", "/api/v1/nodes", {"metadata": {"name": node}})
        await server.grant("hami-plugin", "hami-plugin", ["nodes"], ["get", "patch"])
        api = hamiwriter.InCluster(server.url, server.token_file("hami-plugin"), server.ca_file)
        async with contextlib.AsyncExitStack() as stack:
            writers = []
            for vendor in VENDORS:
                control = os.path.join(short_tmp, vendor)
                args = arguments().parse_args(["--vendor", vendor, "--control", control])
                assert resolve(args) is None
                args.annotation_interval = args.annotation_error_interval = 0.2
                cards = vendorids.form(vendor).cards(args.gpus, args.split, args.resource)
                devices = [s for c in cards for s in c.shares]
                plugin = StandInPlugin(dp_dir, args.resource, args.socket, devices, register_timeout=5)
                await stack.enter_async_context(plugin)
                task = asyncio.create_task(write_annotations(plugin, args, cards, api, node))
                stack.push_async_callback(stopped, task)
                writers.append((vendor, args, cards))

            async def annotations() -> dict[str, str]:
                n = await server.request("GET", f"/api/v1/nodes/{node}")
                got: dict[str, str] = n["metadata"].get("annotations") or {}
                return got

            deadline = time.monotonic() + 20
            while True:
                written = await annotations()
                want = {k for vendor, args, _ in writers for k in wanted_keys(vendor, args.resource)}
                if want <= set(written) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert want <= set(written), sorted(want - set(written))
            for vendor, args, cards in writers:
                p = profiles.named(vendor)
                assert p is not None
                got = anno.parse_register(written[p.register_key(args.resource)], p.hami.register_format)
                assert got.gpus is not None and [g.id for g in got.gpus] == [c.annotated for c in cards]
                if STAMPS[vendor]:
                    assert re.fullmatch(STAMPS[vendor] or "", written[p.handshake_key(args.resource)])
            assert written["hami-vnpu-core"] == "false"
            assert not any(k == "hami.io/node-handshake" for k in written)  # NVIDIA's: the scheduler's
    finally:
        server.stop()


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def wanted_keys(vendor: str, resource: str) -> set[str]:
    """The annotations a vendor's plugin writes."""
    p = profiles.named(vendor)
    assert p is not None
    v = hamiwriter.Vendor.of(vendor, resource)
    return (
        {p.register_key(resource)} | ({p.handshake_key(resource)} if v.stamp else set()) | set(dict(v.extra))
    )


def test_the_flags_default_to_the_vendors() -> None:
    """--vendor (or the profile owning --resource) gives the resource, socket, split and loop timing;
    --resource, --socket and --split override; a resource of another vendor's, a split the plugin cannot
    make or NVIDIA's UUID prefix for another vendor are refused."""

    def resolved(*argv: str) -> tuple[str, str, str, int, float, float]:
        args = arguments().parse_args(list(argv))
        assert resolve(args) is None
        return (
            args.vendor,
            args.resource,
            args.socket,
            args.split,
            args.annotation_interval,
            args.annotation_error_interval,
        )

    # tests/node/overlay/standin.yaml's and the node in a box's Ascend plugin.
    node = ("--gpus", "2", "--control", "/run/hami-standin")
    assert resolved(*node) == ("nvidia", RESOURCE, "nvidia-gpu.sock", 10, 30.0, 5.0)
    ascend = ("--vendor", "ascend", "--control", "/run/hami-standin-ascend")
    assert resolved(*ascend) == ("ascend", "huawei.com/Ascend910B3", "Ascend910B3.sock", 4, 30.0, 5.0)
    assert resolved("--vendor", "ascend", "--resource", "huawei.com/Ascend910A")[1:3] == (
        "huawei.com/Ascend910A",
        "Ascend910A.sock",
    )
    assert resolved("--resource", "amd.com/gpu") == ("amd", "amd.com/gpu", "amd.com_gpu", 10, 30.0, 5.0)
    assert resolved("--vendor", "dcu")[:4] == ("dcu", "hygon.com/dcunum", "hygon.com_dcunum", 4)
    assert resolved("--vendor", "biren") == ("biren", "birentech.com/gpu", "birentech.com_gpu", 1, 300, 300)
    assert resolved("--resource", "example.com/vgpu", "--split", "3")[:4] == (
        "nvidia",
        "example.com/vgpu",
        "nvidia-vgpu.sock",
        3,
    )
    assert resolved("--vendor", "dcu", "--socket", "x.sock", "--annotation-interval", "1")[2:5] == (
        "x.sock",
        4,
        1.0,
    )
    for bad, says in (
        (("--vendor", "ascend", "--resource", RESOURCE), "is nvidia's"),
        (("--vendor", "biren", "--split", "2"), "lists each device 1 to 1 time(s), not 2"),
        (("--vendor", "dcu", "--uuid-prefix", "x"), "NVIDIA GPUs' UUIDs"),
        (
            (
                "--split",
                "0",
            ),
            "not 0",
        ),
    ):
        args = arguments().parse_args(list(bad))
        assert says in (resolve(args) or ""), bad
        with pytest.raises(SystemExit) as e:
            main(list(bad))
        assert e.value.code == 2
