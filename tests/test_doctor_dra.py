"""hami-doctor's DRA causes from the real plugin manager and DRA manager (tests/realdra): the evidence
the sidecar reads, and the kubelet's own log lines as the fixture's klog wrote them."""

from __future__ import annotations

import asyncio
import io
import json
import os

from doctor.cli import main
from doctor.dra.causes import dra_causes
from doctor.dra.evidence import gather_dra, scan_dra_log
from sidecar.dra.spec import DraSpec
from testing.realdra import RealDraDriver, RealDraKubelet, Release

DRIVER = "gpu.example.com"
# The end of a registration whose NotifyRegistrationStatus was refused, in the plugin manager's error line.
REFUSAL_LOGGED = b"failed to send registration status"


def kubelet_log(k: RealDraKubelet) -> bytes:
    with open(k.proc.log_path, "rb") as f:
        return f.read()


def refusals_logged(k: RealDraKubelet) -> int:
    """The refused registrations the kubelet has logged as over (klog writes an error line once for
    each severity at or below its own: one line, three times, to one output)."""
    return len({line for line in kubelet_log(k).splitlines() if REFUSAL_LOGGED in line})


async def test_refused_registration_and_the_health_noise(short_tmp: str, dra_release: Release) -> None:
    release = dra_release
    registry = os.path.join(short_tmp, "plugins_registry")
    os.makedirs(registry)
    kubelet_socket = os.path.join(short_tmp, "kubelet.sock")
    k = RealDraKubelet(registry, os.path.join(short_tmp, "state"), kubelet_socket, release=release)
    d = RealDraDriver(DRIVER, registry, os.path.join(short_tmp, "plugins", DRIVER), release=release)
    spec = DraSpec(DRIVER, os.path.join(registry, f"{DRIVER}-reg.sock"))
    try:
        await d.start()
        await d.set("refuse", True)
        await k.start()
        # Two refusals, each over: the kubelet registers the driver (its DRA manager connects to the
        # service), is refused the NotifyRegistrationStatus, deregisters it (closing that connection),
        # then logs the failure. The driver counts the call before all that, so a look right after the
        # count can find the connection still open.
        async with asyncio.timeout(15):
            while refusals_logged(k) < 2:
                await asyncio.sleep(0.05)
        assert d.calls("NotifyRegistrationStatus") >= 2
        readings = await gather_dra([spec], kubelet_socket, 1.0)
        log = scan_dra_log(kubelet_log(k), k.proc.log_path)
        serving, silent, registered, dra_log = dra_causes(readings, [log], k.version.lstrip("v"))
        assert serving.verdict == "ok", serving
        assert silent.verdict == "ok", silent
        assert registered.verdict == "problem", registered
        assert dra_log.verdict == "problem"
        assert any("refused (or did not answer) NotifyRegistrationStatus" in e for e in dra_log.evidence), (
            dra_log
        )
        # The refusal ends: registered, and on 1.36 the health stream's error is named as noise.
        await d.set("refuse", False)
        async with asyncio.timeout(30):
            while not await k.usable(DRIVER):
                await asyncio.sleep(0.1)
        if release == "old":
            await k.proc.wait_log("Error receiving from WatchResources stream", timeout=10)
        readings = await gather_dra([spec], kubelet_socket, 1.0)
        log = scan_dra_log(kubelet_log(k), k.proc.log_path)
        _, _, registered, dra_log = dra_causes(readings, [log], k.version.lstrip("v"))
        assert registered.verdict == "ok", registered
        noise = [e for e in dra_log.evidence if "known noise on Kubernetes 1.36" in e]
        assert bool(noise) == (release == "old"), dra_log
    finally:
        await d.close()
        await k.close()


async def test_the_doctor_command_names_dra_rows(short_tmp: str, dra_release: Release) -> None:
    """hami-doctor --dra-driver against a registered driver, then against one whose service died."""
    registry = os.path.join(short_tmp, "plugins_registry")
    dp_dir = os.path.join(short_tmp, "device-plugins")
    os.makedirs(registry)
    os.makedirs(dp_dir)
    k = RealDraKubelet(
        registry, os.path.join(short_tmp, "state"), os.path.join(dp_dir, "kubelet.sock"), release=dra_release
    )
    d = RealDraDriver(DRIVER, registry, os.path.join(short_tmp, "plugins", DRIVER), release=dra_release)
    argv = [
        "--device-plugin-dir",
        dp_dir,
        "--dra-driver",
        f"{DRIVER}={registry}/{DRIVER}-reg.sock",
        "--output",
        "json",
        "--sample-interval",
        "0.1",
    ]

    def rows() -> dict[str, dict[str, object]]:
        out = io.StringIO()
        main([*argv, "--kubelet-log", k.proc.log_path], out)
        return {c["id"]: c for c in json.loads(out.getvalue())["causes"]}

    try:
        await k.start()
        await d.start()
        async with asyncio.timeout(15):
            while not await k.usable(DRIVER):
                await asyncio.sleep(0.05)
        found = await asyncio.to_thread(rows)
        assert found["dra-not-serving"]["verdict"] == "ok"
        assert found["dra-not-registered"]["verdict"] == "ok", found["dra-not-registered"]
        assert found["dra-service-silent"]["verdict"] == "ok", found["dra-service-silent"]
        # The DRA service hangs while registration answers: the kubelet still holds the driver.
        await d.set("hang-service", True)
        found = await asyncio.to_thread(rows)
        assert found["dra-service-silent"]["verdict"] == "problem", found["dra-service-silent"]
        assert found["dra-not-serving"]["verdict"] == "ok", found["dra-not-serving"]
        assert found["dra-not-registered"]["verdict"] == "ok", found["dra-not-registered"]
        assert await k.usable(DRIVER)
        await d.set("hang-service", False)
        await d.service_off()
        async with asyncio.timeout(15):
            while await k.usable(DRIVER):
                await asyncio.sleep(0.05)
        found = await asyncio.to_thread(rows)
        assert found["dra-not-registered"]["verdict"] == "problem"
        fixes = found["dra-not-registered"]["fix"]
        assert isinstance(fixes, list) and any("its DRA gRPC server is down" in f for f in fixes)
    finally:
        await d.close()
        await k.close()
