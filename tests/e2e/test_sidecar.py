"""The sidecar's scenarios, each end to end: simulator, real sidecar, real HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hami_guard.flags import AUTO_DEVICES
from sidecar.cli import serve
from sidecar.config import PluginSpec
from sidecar.deviceplugin.probes import probe_kubelet, socket_identity
from sidecar.rpc import unix_target
from testing import FakeDevicePlugin, FakeKubelet, free_port
from testing.grpcserve import GoStyleUnimplemented
from tests.conftest import wait_for, wait_ready
from tests.e2e.conftest import FAST, GPU, Node, NodeFactory, Watch, sidecar_running
from tests.e2e.test_liveness import LIVE, READY

ASCEND = "huawei.com/Ascend910B3"


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


async def metrics(node: Node) -> str:
    code, body = await node.get("/metrics")
    assert code == 200
    return body


# 1
async def test_healthy_node_answers_200_with_every_check(make_node: NodeFactory) -> None:
    async with make_node() as node:  # how soon: bench/sidecar_listen.py's figure
        body = await node.until("/healthz?verbose", 200)
        assert body.splitlines() == [
            "[+]kubelet ok",
            "[+]checkpoint ok",
            "[+]plugin:nvidia.com/gpu ok",
            "[+]registered:nvidia.com/gpu ok",
            "[+]kubelet-client:nvidia.com/gpu ok",
            "[+]devices:nvidia.com/gpu ok",
            "healthz check passed",
        ]
        assert await node.get("/healthz") == (200, "ok")


# 2
async def test_removed_plugin_socket_fails_at_once_naming_it(make_node: NodeFactory) -> None:
    async with make_node(probe_interval=30.0) as node:  # only the event can explain a verdict before 30 s
        await node.until("/healthz", 200)
        await node.plugin.crash()
        # How fast is bench/fault_latency.py's figure; the bound here allows for CI's load.
        body = await node.until("/healthz", 503, timeout=5)
        assert f"[-]plugin:{GPU} failed: nvidia-gpu.sock was removed while the kubelet kept running" in body


# 3
async def test_hung_plugin_fails_within_interval_plus_two_timeouts(make_node: NodeFactory) -> None:
    """The next round's probe times out, and a confirming one after `drop_confirm` does too."""
    async with make_node() as node:
        await node.until("/healthz", 200)
        node.plugin.hung = True
        s = node.settings
        bound = s.probe_interval + 2 * s.probe_timeout + s.drop_confirm + 0.5
        body = await node.until("/healthz?verbose", 503, timeout=bound)
        assert f"[-]plugin:{GPU} failed: timeout: no answer on {node.plugin.socket_path} within 0.3s" in body
        node.plugin.hung = False
        await node.until("/healthz", 200, timeout=s.probe_interval + 1)


# 4
async def test_kubelet_restart_with_reregistration_never_fails(node: Node) -> None:
    before = await metrics(node)
    watch = Watch(node)
    await watch.started()
    started = time.monotonic()
    await node.kubelet.restart()
    await wait_for(lambda: node.kubelet.healthy_devices(GPU), what="re-registration")
    await wait_for(
        lambda: node.sidecar.judge.history and node.sidecar.judge.history[-1].outcome == "registered"
    )
    ended = time.monotonic()
    await node.wait_rounds()
    codes = await watch.stop()
    assert set(codes) == {200}, [b for _, c, b in watch.seen if c != 200][:1]
    during = [t for t, _, _ in watch.seen if started <= t <= ended]
    assert len(during) >= 3, "the transition was hardly polled"
    after = await metrics(node)
    labels = {"plugin": "hami", "resource": GPU}
    for name in ("device_plugin_registration_attempt_total", "device_plugin_registration_success_total"):
        assert metric(after, name, **labels) - metric(before, name, **labels) == 1, name
    hist = "device_plugin_listandwatch_latency_seconds_count"
    assert metric(after, hist, **labels) - metric(before, hist, **labels) == 1
    assert metric(after, "device_plugin_kubelet_restarts_total") == 1
    assert node.sidecar.judge.history[-1].latency is not None
    assert node.sidecar.judge.history[-1].latency < 2.0


# 5
async def test_kubelet_restart_without_reregistration_fails_when_the_grace_runs_out(
    make_node: NodeFactory,
) -> None:
    async with make_node(registration_grace=1.0) as node:
        await node.until("/healthz", 200)
        before = await metrics(node)
        node.plugin.register_enabled = False
        restarted = time.monotonic()
        await node.kubelet.restart()
        # Pending is seen only before the grace runs out: after it, the check has failed.
        body = await node.until("/healthz?verbose", 200, contains=f"[~]registered:{GPU} pending:")
        await node.until("/healthz", 503, timeout=3.0)
        elapsed = time.monotonic() - restarted
        assert elapsed >= 1.0, elapsed  # not before the grace ran out
        _, body = await node.get("/healthz?verbose")
        assert f"[-]registered:{GPU} failed: " in body
        after = await metrics(node)
        labels = {"plugin": "hami", "resource": GPU}
        assert (
            metric(after, "device_plugin_registration_attempt_total", **labels)
            - metric(before, "device_plugin_registration_attempt_total", **labels)
            == 1
        )
        assert metric(after, "device_plugin_registration_success_total", **labels) == metric(
            before, "device_plugin_registration_success_total", **labels
        )
        assert node.sidecar.judge.history[-1].outcome == "not registered within the grace"


# 6
async def test_kubelet_socket_without_the_registration_service_fails_with_unknown_service(
    dp_dir: str, short_tmp: str
) -> None:

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([GoStyleUnimplemented({})])  # a gRPC server serving something else
    server.add_insecure_port(unix_target(os.path.join(dp_dir, "kubelet.sock")))
    await server.start()
    settings = replace(
        FAST,
        device_plugin_dir=dp_dir,
        pod_resources_socket="/nonexistent",
        port=free_port(),
        registration_grace=0.5,
    )
    try:
        async with (
            FakeDevicePlugin(dp_dir, register_timeout=1),  # serves; its Register fails on that socket
            sidecar_running(settings) as (sidecar, _),
            aiohttp.ClientSession() as http,
        ):
            check = sidecar.state.checks["kubelet"]
            assert check.status.value == "failed"
            assert "unknown service v1beta1.Registration" in check.reason
            node = Node(dp_dir, None, None, sidecar, settings, http)  # type: ignore[arg-type]
            # A kubelet fault is never mended by a plugin restart: liveness holds for 3x the grace.
            await node.wait_rounds(
                lambda: sidecar.clock() - sidecar.started > 3 * settings.registration_grace
            )
            # The probe paths the shipped patch wires to the device-plugin container.
            assert await node.get(LIVE) == (200, "ok")
            code, body = await node.get(f"{READY}?verbose")
            assert code == 503
            assert (
                "[!]kubelet failed (no restart: a plugin restart would not mend it): something else" in body
            )
    finally:
        await server.stop(None)


# 7
async def test_the_sidecar_never_registers_nor_opens_listandwatch_nor_allocates(node: Node) -> None:
    await node.kubelet.restart()
    await wait_for(lambda: node.plugin.registrations == 2)
    for _ in range(5):
        node.sidecar.trigger()
        await asyncio.sleep(0.02)
    await node.until("/healthz", 200)
    calls = node.plugin.calls
    assert calls["GetDevicePluginOptions"] > node.plugin.registrations  # the sidecar's probes
    assert calls["ListAndWatch"] == node.plugin.registrations  # only the kubelet's streams
    assert calls["Allocate"] == calls["PreStartContainer"] == calls["GetPreferredAllocation"] == 0
    assert node.kubelet.register_calls[GPU] == node.plugin.register_attempts == 2


# 8
BAD_CHECKPOINTS = {
    "corrupt": (b"{\x00\xff not json", "not valid JSON"),
    "truncated": (
        b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":["GPU-0"',
        "not valid JSON",
    ),
    "empty": (b"", "empty"),
    "null": (b"null", "no Data object"),
    "Data null": (b'{"Data":null,"Checksum":1}', "no Data object"),
    "wrong types": (b'{"Data":{"RegisteredDevices":["nvidia.com/gpu"]}}', "not an object"),
}


@pytest.mark.parametrize("kind", list(BAD_CHECKPOINTS))
async def test_bad_checkpoint_is_lost_evidence_for_readiness_never_a_liveness_failure(
    node: Node, kind: str
) -> None:
    content, reason = BAD_CHECKPOINTS[kind]
    await node.until("/readyz", 200)
    write_checkpoint_bytes(node.kubelet.checkpoint_path, content)
    body = await node.until("/readyz?verbose", 503, contains=reason, timeout=2)
    assert "[!]checkpoint failed (no restart" in body
    assert f"[+]registered:{GPU} ok" in body  # the live connection decides
    assert await node.get("/healthz") == (200, "ok")


async def test_a_checkpoint_listing_the_resource_empty_is_no_verdict(node: Node) -> None:
    """`[]` (or null) is what the kubelet writes for a resource with no healthy device: nothing to fail."""
    await node.until("/readyz", 200)
    write_checkpoint_bytes(
        node.kubelet.checkpoint_path,
        b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":null}},"Checksum":null}',
    )
    await node.wait_rounds()
    assert await node.get("/readyz") == (200, "ok")


def write_checkpoint_bytes(path: str, content: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), ".test-checkpoint")
    with open(tmp, "wb") as f:
        f.write(content)
    os.replace(tmp, path)


async def test_huge_checkpoint_is_refused_unread(node: Node) -> None:
    await node.until("/healthz", 200)
    tmp = node.kubelet.checkpoint_path + ".big"
    with open(tmp, "wb") as f:
        f.truncate(50 * 1024 * 1024)
    os.replace(tmp, node.kubelet.checkpoint_path)
    body = await node.until("/readyz?verbose", 503, contains="over the", timeout=2)
    assert f"the checkpoint is {50 * 1024 * 1024} bytes" in body
    assert await node.get("/healthz") == (200, "ok")


async def test_checkpoint_replaced_by_a_folder(node: Node) -> None:
    await node.until("/healthz", 200)
    os.unlink(node.kubelet.checkpoint_path)
    os.mkdir(node.kubelet.checkpoint_path)
    await node.until("/readyz?verbose", 503, contains="not a regular file", timeout=2)
    assert await node.get("/healthz") == (200, "ok")


async def test_pre_1_20_checkpoint_is_read(node: Node) -> None:
    """Before 1.20, DeviceIDs was a plain list; RegisteredDevices is unchanged, so the verdict stands."""
    await node.until("/healthz", 200)
    old = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": "u",
                    "ContainerName": "c",
                    "ResourceName": GPU,
                    "DeviceIDs": ["GPU-0"],
                    "AllocResp": "",
                }
            ],
            "RegisteredDevices": {GPU: ["GPU-0", "GPU-1"]},
        },
        "Checksum": 1,
    }
    write_checkpoint_bytes(node.kubelet.checkpoint_path, json.dumps(old).encode())
    await node.wait_rounds()
    assert await node.get("/readyz") == (200, "ok")
    assert node.sidecar.judge.devices()[GPU]["checkpoint"] == 2


# 9
async def test_folder_deleted_and_recreated_is_watched_again(make_node: NodeFactory) -> None:
    async with make_node(probe_interval=30.0) as node:
        await node.until("/healthz", 200)
        shutil.rmtree(node.dir)
        # The kubelet's folder is gone: a kubelet fault, which a plugin restart would not mend.
        await node.until("/readyz", 503, timeout=node.settings.registration_grace + 1)
        assert await node.get("/healthz") == (200, "ok")
        os.mkdir(node.dir, 0o750)
        await node.kubelet.restart()
        await node.plugin.restart()  # its own watch died with the folder
        await node.until("/healthz?verbose", 200, timeout=3, contains=f"[+]registered:{GPU} ok")
        # The folder is looked for every 0.25 s: on a loaded machine a round may see the plugin
        # registered before the new folder is watched.
        await wait_for(lambda: node.sidecar.watch_mode == "inotify", 3, "the new folder watched")
        await node.plugin.crash()
        # Seen through the new watch: no round is due for 30 s. The bound allows for CI's load.
        body = await node.until("/healthz?verbose", 503, timeout=5)
        assert "was removed while the kubelet kept running" in body


def without_inotify(*command: str) -> list[str]:
    """`command` in a user namespace of its own whose inotify limit is 0, as on a node at its
    fs.inotify.max_user_instances: its inotify_init fails, and nothing else on the machine is touched
    (the limit is the namespace's; using up the real user's instances would starve every other test)."""
    limit = "echo 0 > /proc/sys/user/max_inotify_instances"
    return ["unshare", "--user", "--map-root-user", "sh", "-c", f'{limit} && exec "$@"', "sh", *command]


async def test_polling_fallback_detects_a_removed_socket_within_its_period(
    dp_dir: str, short_tmp: str
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    pod_resources = os.path.join(short_tmp, "pod-resources", "kubelet.sock")
    port = free_port()
    command = without_inotify(
        sys.executable, "-m", "sidecar", "--device-plugin-dir", dp_dir, "--listen", f"127.0.0.1:{port}",
        "--pod-resources-socket", pod_resources, "--probe-interval", "30", "--polling-interval", "0.2",
    )  # fmt: skip
    async with (
        FakeKubelet(dp_dir, pod_resources, dial_timeout=0.5),
        FakeDevicePlugin(dp_dir) as plugin,
        aiohttp.ClientSession() as http,
    ):
        proc = await asyncio.to_thread(subprocess.Popen, command, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"

        async def until(path: str, status: int, contains: str = "", timeout: float = 10) -> str:
            deadline = time.monotonic() + timeout
            while True:
                async with http.get(url + path) as r:
                    code, body = r.status, await r.text()
                if code == status and contains in body:
                    return body
                assert time.monotonic() < deadline, f"{path} answered {code}: {body}"
                await asyncio.sleep(0.05)

        try:
            await asyncio.to_thread(wait_ready, url, proc, 10)
            await until("/healthz?verbose", 200, f"[+]registered:{GPU} ok")
            assert json.loads(await until("/status", 200))["watch_mode"] == "polling"
            await plugin.crash()
            await until("/healthz", 503, timeout=5)  # a polling period, not the 30 s round
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
            print(err, file=sys.stderr)
        assert "inotify unavailable" in err
        assert "Traceback" not in err


# 10
async def test_two_plugins_one_failing(dp_dir: str, short_tmp: str) -> None:

    settings = replace(
        FAST,
        device_plugin_dir=dp_dir,
        pod_resources_socket="/nonexistent",
        port=free_port(),
        plugins=(PluginSpec(GPU, "nvidia-gpu.sock"), PluginSpec(ASCEND, "Ascend910B3.sock")),
    )
    async with (
        FakeKubelet(dp_dir, dial_timeout=0.5) as kubelet,
        FakeDevicePlugin(dp_dir, register_timeout=5),
        FakeDevicePlugin(dp_dir, ASCEND, "Ascend910B3.sock", ["npu-0"], register_timeout=5) as ascend,
    ):
        await wait_for(lambda: kubelet.healthy_devices(GPU) and kubelet.healthy_devices(ASCEND))
        async with sidecar_running(settings), aiohttp.ClientSession() as http:
            node = Node(dp_dir, kubelet, ascend, None, settings, http)  # type: ignore[arg-type]
            await node.until("/healthz", 200)
            ascend.hung = True
            body = await node.until("/healthz?verbose", 503, timeout=2)
            assert f"[-]plugin:{ASCEND} failed: timeout" in body
            assert f"[+]plugin:{GPU} ok" in body
            assert f"[+]registered:{ASCEND} ok" in body
            assert await node.get(f"/healthz?exclude=plugin:{ASCEND}") == (200, "ok")
            assert await node.get(f"/healthz/plugin:{GPU}") == (200, "ok")
            code, text = await node.get(f"/healthz/plugin:{ASCEND}")
            assert code == 503
            assert text.startswith(f"[-]plugin:{ASCEND} failed: timeout")
            m = await metrics(node)
            assert metric(m, "device_plugin_check_up", check="plugin", resource=ASCEND, plugin="hami") == 0
            assert metric(m, "device_plugin_check_up", check="plugin", resource=GPU) == 1
            assert metric(m, "device_plugin_devices", resource=ASCEND, source="checkpoint") == 1
            ascend.hung = False


# 11
SPEC_METRICS = {
    "device_plugin_registration_attempt",
    "device_plugin_registration_success",
    "device_plugin_listandwatch_latency_seconds",
    "device_plugin_probe_duration_seconds",
    "device_plugin_check_up",
    "device_plugin_devices",
    "device_plugin_kubelet_restarts",
}


async def test_metrics_status_readyz_and_errors(node: Node) -> None:
    await node.kubelet.restart()
    await wait_for(
        lambda: node.sidecar.judge.history and node.sidecar.judge.history[-1].outcome == "registered"
    )
    await node.wait_rounds()  # the round after the registration reads the rewritten checkpoint
    text = await metrics(node)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) >= SPEC_METRICS
    labels = {"plugin": "hami", "resource": GPU}
    assert metric(text, "device_plugin_registration_attempt_total", **labels) == 1
    assert metric(text, "device_plugin_registration_success_total", **labels) == 1
    assert metric(text, "device_plugin_listandwatch_latency_seconds_count", **labels) == 1
    assert metric(text, "device_plugin_kubelet_restarts_total") == 1
    assert metric(text, "device_plugin_check_up", check="registered", resource=GPU, plugin="hami") == 1
    assert metric(text, "device_plugin_kubelet_connected", resource=GPU, plugin="hami") == 1
    assert metric(text, "device_plugin_restart_budget_spent", resource=GPU, plugin="hami") == 0
    assert metric(text, "device_plugin_devices", resource=GPU, source="checkpoint", plugin="hami") == 2
    assert metric(text, "device_plugin_devices", resource=GPU, source="pod_resources", plugin="hami") == 2
    assert metric(text, "device_plugin_probe_duration_seconds_count", socket="kubelet") >= 1

    code, body = await node.get("/status")
    assert code == 200
    doc = json.loads(body)
    assert set(doc) >= {
        "version",
        "uptime_seconds",
        "checks",
        "sockets",
        "kubelet_restarts",
        "registration_history",
        "devices",
    }
    assert set(doc["checks"][f"registered:{GPU}"]) >= {
        "state",
        "since",
        "reason",
        "last_probe_latency_seconds",
    }
    assert set(doc["sockets"]["kubelet.sock"]) >= {"path", "exists", "mode", "owner", "created"}
    assert doc["sockets"]["nvidia-gpu.sock"]["exists"] is True
    assert doc["kubelet_restarts"] == 1
    assert doc["registration_history"][-1]["outcome"] == "registered"
    assert doc["devices"][GPU] == {"checkpoint": 2, "pod_resources": 2}

    assert (await node.get("/nope"))[0] == 404
    assert (await node.get("/healthz/no-such-check"))[0] == 404
    for method in ("POST", "PUT", "DELETE"):
        async with node.http.request(method, node.url + "/healthz") as r:
            assert r.status == 405
    async with node.http.head(node.url + "/healthz") as r:
        assert r.status == 200


async def test_sidecarz_is_503_until_the_first_round_finishes(make_node: NodeFactory, dp_dir: str) -> None:

    async with FakeKubelet(dp_dir, dial_timeout=0.5), FakeDevicePlugin(dp_dir) as plugin:
        plugin.hung = True  # the first round waits for its probe timeout
        settings = replace(
            FAST, device_plugin_dir=dp_dir, pod_resources_socket="/none", port=free_port(), probe_timeout=0.5
        )
        stop = asyncio.Event()

        task = asyncio.get_running_loop().create_task(serve(settings, stop))
        url = f"http://127.0.0.1:{settings.port}/sidecarz"
        async with aiohttp.ClientSession() as http:
            codes = []
            for _ in range(200):
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    async with http.get(url) as r:
                        codes.append(r.status)
                        if r.status == 200:
                            break
                await asyncio.sleep(0.01)
        stop.set()
        await task
        plugin.hung = False
    assert codes[0] == 503
    assert codes[-1] == 200


# 12
def test_sigterm_exits_0_within_2s(dp_dir: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "--device-plugin-dir",
            dp_dir,
            "--listen",
            f"127.0.0.1:{port}",
            "--pod-resources-socket",
            "/nonexistent",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=10)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
        assert time.monotonic() - sent < 2.0
        assert proc.returncode == 0
        assert proc.stderr is not None
        log = proc.stderr.read()
        assert "Traceback" not in log
        assert "stopped" in log
    finally:
        proc.kill()


async def test_stop_leaves_no_thread_nor_task(dp_dir: str) -> None:

    async with FakeKubelet(dp_dir, dial_timeout=0.5), FakeDevicePlugin(dp_dir):
        threads_before = set(threading.enumerate())
        tasks_before = asyncio.all_tasks()
        settings = replace(FAST, device_plugin_dir=dp_dir, pod_resources_socket="/none", port=free_port())
        async with sidecar_running(settings) as (sidecar, _):
            await wait_for(lambda: sidecar.rounds >= 1)
            assert set(threading.enumerate()) - threads_before  # the observer, the checkpoint reader
        await asyncio.sleep(0)
        leaked_threads = [t.name for t in set(threading.enumerate()) - threads_before]
        assert leaked_threads == []
        # The simulator's gRPC servers finish their side of the sidecar's last calls by themselves.
        await wait_for(
            lambda: not [t for t in asyncio.all_tasks() - tasks_before if not _grpc_server_task(t)]
        )
        leaked = [t.get_name() for t in asyncio.all_tasks() - tasks_before if not _grpc_server_task(t)]
        assert leaked == []


def _grpc_server_task(task: asyncio.Task[object]) -> bool:
    """grpcio's own server tasks, which the simulator's servers keep for their next request."""
    return "grpc/_cython" in repr(task)


async def test_one_log_line_per_transition_none_per_probe(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    async with make_node(probe_interval=0.1, probe_timeout=0.05) as node:
        await node.until("/healthz?verbose", 200, contains=f"[+]registered:{GPU} ok")
        rounds = node.sidecar.rounds
        await wait_for(lambda: node.sidecar.rounds >= rounds + 5)
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.name == "sidecar.server.metrics" and "check " in r.getMessage()
        ]
        assert sorted(lines) == sorted(
            [
                "check kubelet: pending -> ok: serving v1beta1.Registration",
                "check checkpoint: pending -> ok: read: 1 resource(s)",
                f"check plugin:{GPU}: pending -> ok: GetDevicePluginOptions answered",
                f"check registered:{GPU}: pending -> ok: the kubelet holds a connection to nvidia-gpu.sock; "
                "pod-resources lists 2 healthy device(s)",
                f"check kubelet-client:{GPU}: pending -> ok: no refused Register seen: the kubelet keeps the "
                "plugin's client",
                f"check devices:{GPU}: pending -> ok: the kubelet lists 2 (want 1: a registered plugin "
                "with no healthy device is not ready; --expect-devices 0 opts out)",
            ]
        )


async def test_expected_devices_check_counts_what_the_kubelet_lists(
    make_node: NodeFactory, short_tmp: str
) -> None:
    host = os.path.join(short_tmp, "dev")
    os.mkdir(host)
    for i in range(3):  # nvidia-smi would see three GPUs
        open(os.path.join(host, f"nvidia{i}"), "w").close()
    open(os.path.join(host, "nvidiactl"), "w").close()
    async with make_node(expect_devices=AUTO_DEVICES, device_glob=os.path.join(host, "nvidia[0-9]*")) as node:
        body = await node.until("/readyz?verbose", 503, timeout=3, contains=f"devices:{GPU} failed")
        assert (
            f"[!]devices:{GPU} failed (no restart: readiness only: a lost or broken GPU is the node's; a "
            "device HAMi marked unhealthy on a transient fault comes back with a plugin restart: "
            "--recover-unhealthy-after): the kubelet lists 2 healthy device(s) by pod-resources, 3 expected "
            "(--expect-devices auto: 3 device node(s) on the host; no HAMi node configuration at "
        ) in body
        assert await node.get("/healthz") == (200, "ok")  # a device shortfall restarts nothing
        node.plugin.set_devices(["GPU-0", "GPU-1", "GPU-2"])
        await node.until("/readyz", 200, timeout=3)
        m = await metrics(node)
        assert metric(m, "device_plugin_devices", resource=GPU, source="host") == 3


def test_demo_tour_runs_and_exits() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "testing.demo"],
        env={**os.environ, "DEMO_TOUR_ONLY": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Each step shows /healthz, then /readyz: (liveness, readiness) per step.
    expected = {
        "1. a healthy node": (200, 200),
        "2. the kubelet restarts; the plugin registers again": (200, 200),
        "3. the kubelet restarts and the plugin does NOT register again": (503, 503),
        "4. the kubelet restarts the plugin": (200, 200),
        "5. the kubelet drops the plugin": (503, 503),
        "6. a plugin restart registers it again": (200, 200),
        "7. the plugin hangs": (503, 503),
        "8. the plugin answers again": (200, 200),
        "9. every GPU turns unhealthy": (200, 503),
        "10. the GPUs recover": (200, 200),
    }
    sections = out.split("\n== ")[1:]
    assert [next(t for t in expected if sec.startswith(t)) for sec in sections[:-1]] == list(expected)
    for section, (live, ready) in zip(sections, expected.values(), strict=False):
        assert f"/healthz?verbose   -> HTTP {live}" in section, section
        assert f"/readyz?verbose   -> HTTP {ready}" in section, section
    # Three cycles end registered (steps 2, 4, 6); the plugin's own re-creation of its socket may add one.
    success = re.search(
        r'device_plugin_registration_success_total\{plugin="hami",resource="[^"]+"\} (\S+)', out
    )
    assert success is not None
    assert float(success.group(1)) >= 3
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("order", ["plugin socket first, kubelet.sock dead", "kubelet.sock unlinked first"])
async def test_restart_in_any_removal_order_is_pending_not_failed(node: Node, order: str) -> None:
    """A restart removes the sockets in no guaranteed order (docs/kubelet.md#kubelet-restart)."""
    await node.until("/healthz?verbose", 200, contains=f"[+]registered:{GPU} ok")
    watch = Watch(node)
    if order.startswith("plugin"):
        await node.kubelet.stop()  # the old kubelet dies; kubelet.sock stays as a dead file
        os.unlink(node.plugin.socket_path)  # the new kubelet's cleanup reaches the plugin socket first
    else:
        await node.kubelet.stop(unlink_socket=True)  # a graceful stop unlinks kubelet.sock first
        await wait_for(lambda: node.sidecar.judge.kubelet_restarts == 1, what="the stop seen")
        os.unlink(node.plugin.socket_path)
    plugin = node.sidecar.state.checks[f"plugin:{GPU}"]
    await wait_for(lambda: "removed by a kubelet restart" in plugin.reason, what="the removal's verdict")
    await node.kubelet.start()
    await wait_for(lambda: node.kubelet.healthy_devices(GPU), what="re-registration")
    await node.until("/healthz?verbose", 200, contains=f"[+]registered:{GPU} ok")
    codes = await watch.stop()
    assert set(codes) == {200}, [b for _, c, b in watch.seen if c != 200][:1]
    assert node.sidecar.judge.kubelet_restarts == 1


class _ReplacedWhileProbed(grpc.GenericRpcHandler):
    """A kubelet.sock whose answer arrives after a new kubelet has bound a new file over it."""

    def __init__(self, path: str, spare: str) -> None:
        self.path, self.spare = path, spare
        self.new: socket.socket | None = None
        self.unknown = GoStyleUnimplemented({"v1beta1.Registration": None})

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if self.new is None:
            self.new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.new.bind(self.spare)
            self.new.listen()
            os.rename(self.spare, self.path)
        return self.unknown.service(details)


async def test_a_kubelet_sock_replaced_while_probed_is_not_taken_as_the_old_one_answering(
    short_tmp: str,
) -> None:
    """The answer may come from either file: taken as the old one's, a round would record the old file
    as answering, and the next round would count the new file as a second kubelet restart."""
    path = os.path.join(short_tmp, "kubelet.sock")
    handler = _ReplacedWhileProbed(path, os.path.join(short_tmp, "new.sock"))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler])
    server.add_insecure_port(unix_target(path))
    await server.start()
    try:
        old = socket_identity(path)
        result = await probe_kubelet(path, timeout=5.0)
        assert handler.new is not None, "the probe never called"
        assert not result.ok and "replaced while probed" in result.reason
        assert result.identity == socket_identity(path) != old
        assert (await probe_kubelet(path, timeout=0.3)).state == "timeout"  # the new file: nobody serves
    finally:
        await server.stop(None)
        if handler.new is not None:
            handler.new.close()
