"""A plugin socket removed by someone else after HAMi's in-process re-serve: liveness failures before
the grace, over TRIALS trials, the sidecar in its own process (docs/design.md#plugin-listener).

Each trial: the plugin re-serves in-process as HAMi does on a kubelet.sock creation (stop, unlink, bind,
then listen `LISTEN_DELAY` later, as Go's net.Listen binds first), registers again, and its new socket
file is unlinked while it still listens and the kubelet keeps its stream. The sidecar must answer
/healthz 200 throughout the grace (30 s here) and say the plugin still listens. Run it beside a load of
your choice (the figure in BENCHMARKS.md: two `go build`s beside).
"""

from __future__ import annotations

import asyncio
import os
import time

from bench.common import GPU, Node, node

TRIALS = int(os.environ.get("TRIALS", "50"))
LISTEN_DELAY = float(os.environ.get("LISTEN_DELAY", "0.05"))
WATCH = 1.5  # seconds of /healthz polling after each removal: past the 0.1 s restart window


async def trial(n: Node) -> tuple[int, int]:
    """(503s seen, answers seen) after one removal."""
    plugin = n.plugin
    plugin.listen_delay = LISTEN_DELAY
    target = plugin.registrations + 1
    await plugin.restart()
    while plugin.registrations < target or not n.kubelet.healthy_devices(GPU):
        await asyncio.sleep(0.01)
    await n.until(200, path="/healthz")
    os.unlink(plugin.socket_path)
    bad = seen = 0
    deadline = time.monotonic() + WATCH
    while time.monotonic() < deadline:
        seen += 1
        bad += await n.status("/healthz") == 503
        await asyncio.sleep(0.01)
    return bad, seen


async def main() -> None:
    failed = polls = 0
    async with node("--registration-grace", "30", "--probe-interval", "1") as n:
        await n.until(200)
        for i in range(TRIALS):
            bad, seen = await trial(n)
            failed += bool(bad)
            polls += seen
            if bad:
                print(f"trial {i}: {bad} of {seen} /healthz answers were 503")
    print(
        f"listener race: {failed} of {TRIALS} trials failed liveness before the grace "
        f"({polls} /healthz polls; listen gap {LISTEN_DELAY * 1000:.0f} ms; load {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    asyncio.run(main())
