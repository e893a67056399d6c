"""Fault-to-verdict latency over N trials each, with the sidecar in its own process.

- plugin socket removed -> 503 (goal p99 <= 250 ms: the plugin's 0.1 s window to serve a new socket)
- plugin hung -> 503 (goal <= interval + 2 x timeout + 0.2 s confirmation + 50 ms)
- kubelet restarted, no re-registration -> 503 (goal: grace + <= 1 s)
- kubelet dropped the plugin -> 503 (goal p99 <= interval + timeout + 0.2 s)
And against the kubelet's own device manager (tests/realkubelet), where it is built:
- kubelet restarted, no re-registration -> 503, both releases (goal: grace + <= 1 s)
- kubernetes issue 121994 on the old release (the kubelet disconnects a re-registered plugin) -> 503
  (goal p99 <= interval + timeout + 0.2 s)
Compared with a probe-only design at Kubernetes defaults (periodSeconds 10 x failureThreshold 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from bench.common import GPU, node, real_node, summary
from testing.realkubelet import RealPlugin, Release, missing_reason

TRIALS = int(os.environ.get("TRIALS", "50"))
INTERVAL, TIMEOUT, GRACE = 1.0, 0.2, 1.0


async def removed() -> list[float]:
    out = []
    async with node("--probe-interval", "10") as n:
        for _ in range(TRIALS):
            await n.plugin.restart()
            await n.until(200)
            await asyncio.sleep(0.05)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await n.plugin.crash()
            await n.until(503)
            out.append(loop.time() - t0)
    return out


async def hung() -> list[float]:
    out = []
    async with node("--probe-interval", str(INTERVAL), "--probe-timeout", str(TIMEOUT)) as n:
        for _ in range(TRIALS):
            n.plugin.hung = False
            await n.until(200)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            n.plugin.hung = True
            await n.until(503)
            out.append(loop.time() - t0)
        n.plugin.hung = False
    return out


async def restart_without_registration() -> list[float]:
    out = []
    async with node("--registration-grace", str(GRACE), "--probe-interval", "10") as n:
        for _ in range(TRIALS):
            n.plugin.register_enabled = True
            await n.plugin.restart()
            await n.until(200)
            while not n.kubelet.healthy_devices(GPU):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            n.plugin.register_enabled = False
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await n.kubelet.restart()
            await n.until(503)
            out.append(loop.time() - t0)
    return out


async def dropped() -> list[float]:
    out = []
    async with node("--probe-interval", str(INTERVAL), "--probe-timeout", str(TIMEOUT)) as n:
        for _ in range(TRIALS):
            await n.plugin.restart()
            while not n.kubelet.connected(GPU) or not n.kubelet.healthy_devices(GPU):
                await asyncio.sleep(0.01)
            await n.until(200, path="/readyz")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await n.kubelet.drop(GPU)
            await n.until(503)
            out.append(loop.time() - t0)
    return out


REAL_TRIALS = int(os.environ.get("REAL_TRIALS", "20"))
REAL_ARGS = (
    "--probe-interval",
    str(INTERVAL),
    "--probe-timeout",
    str(TIMEOUT),
    "--registration-grace",
    str(GRACE),
)


async def real_restart_without_registration(release: Release) -> list[float]:
    out = []
    async with contextlib.AsyncExitStack() as stack:
        n = await stack.enter_async_context(real_node(release, *REAL_ARGS))
        plugin = await stack.enter_async_context(RealPlugin(n.dir, release=release, watch_kubelet=False))
        for _ in range(REAL_TRIALS):
            mark = plugin.mark()
            await plugin.restart()
            await plugin.wait_event("stream-open", after=mark)
            await n.sidecar.until(200, path="/readyz")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await n.kubelet.restart()  # the plugin misses kubelet.sock's creation
            await n.sidecar.until(503)
            out.append(loop.time() - t0)
    return out


async def real_issue_121994() -> list[float]:
    """A registered; B registers on the same socket path; A's stream ends: the old kubelet drops B."""
    out = []
    async with real_node("old", *REAL_ARGS) as n:
        for _ in range(REAL_TRIALS):
            a = RealPlugin(n.dir, release="old", watch_kubelet=False)
            b = RealPlugin(n.dir, release="old", watch_kubelet=False, devices=("GPU-0", "GPU-1", "GPU-2"))
            try:
                await a.start()
                await n.sidecar.until(200, path="/readyz")
                mark = b.mark()
                await b.start()
                await b.wait_event("stream-open", after=mark)
                await n.sidecar.until(200, path="/readyz")
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await a.crash(remove_socket=True)
                await n.sidecar.until(503)
                out.append(loop.time() - t0)
            finally:
                await a.close()
                await b.close()
    return out


async def real_figures() -> None:
    goal = (INTERVAL + TIMEOUT + 0.2) * 1000
    releases: tuple[Release, ...] = ("new", "old")
    for release in releases:
        why = missing_reason(release)
        if why is not None:
            print(f"real kubelet {release}: skipped ({why})")
            continue
        k = await real_restart_without_registration(release)
        print(
            f"real kubelet {release}: restart, no re-registration (grace {GRACE:g} s): {summary(k)}  "
            f"(goal <= {GRACE + 1:g} s)"
        )
    if missing_reason("old") is None:
        d = await real_issue_121994()
        print(f"real kubelet old: issue 121994, B dropped: {summary(d)}  (goal p99 <= {goal:.0f} ms)")


async def main() -> None:
    print(f"fault -> 503 on /healthz, {TRIALS} trials each, sidecar in its own process, polled back to back")
    r = await removed()
    print(f"plugin socket removed:                 {summary(r)}  (goal p99 <= 250 ms)")
    h = await hung()
    print(
        f"plugin hung (interval {INTERVAL:g} s, timeout {TIMEOUT:g} s): {summary(h)}  "
        f"(goal <= {(INTERVAL + 2 * TIMEOUT + 0.2) * 1000 + 50:.0f} ms)"
    )
    k = await restart_without_registration()
    print(f"kubelet restart, no re-registration (grace {GRACE:g} s): {summary(k)}  (goal <= {GRACE + 1:g} s)")
    d = await dropped()
    goal = (INTERVAL + TIMEOUT + 0.2) * 1000
    print(f"kubelet dropped the plugin (interval {INTERVAL:g} s): {summary(d)}  (goal p99 <= {goal:.0f} ms)")
    await real_figures()
    print(
        "probe-only design at Kubernetes defaults (exec probe every 10 s, 3 failures): 20-30 s to notice any "
        "of these, and never the lost registration unless the probe itself reads the kubelet's records"
    )


if __name__ == "__main__":
    asyncio.run(main())
