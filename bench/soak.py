"""`make soak`: faults against the simulator while /healthz and /readyz are polled at 20 req/s each.

Two plugins, one whose socket name sorts before kubelet.sock (Ascend910B3.sock) and one after
(nvidia-gpu.sock). 200 kubelet restarts with re-registration, alternating the two orders in which a
restart's cleanup removes the sockets (plugin sockets first, kubelet.sock first), 100 plugin
crashes, 50 hangs, 30 kubelet drops, 20 restarts the plugin misses, all devices unhealthy, zero
devices, corrupt checkpoints, and at least 1,000 probe rounds. Passes only if every verdict was right
(no 503 during a healthy re-registration, a 503 within its bound for each real fault, liveness
200 for every fault a plugin restart would not mend), the log has no exception, open fds are
back to their count, RSS grew <= 2 MiB after warm-up, and no thread or task leaked. Bounded: it
stops by itself within 10 minutes. It prints the count of wrong verdicts (the goal is 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from bench.common import ASCEND, GPU, Node, node

START = time.monotonic()
DEADLINE = START + 600
INTERVAL, TIMEOUT, GRACE = 0.2, 0.1, 1.0
RESTARTS = int(os.environ.get("SOAK_RESTARTS", "200"))
CRASHES = int(os.environ.get("SOAK_CRASHES", "100"))
HANGS = int(os.environ.get("SOAK_HANGS", "50"))
CORRUPTIONS = int(os.environ.get("SOAK_CORRUPTIONS", "20"))
DROPS = int(os.environ.get("SOAK_DROPS", "30"))
MISSED = int(os.environ.get("SOAK_MISSED", "20"))
DEVICE_FAULTS = int(os.environ.get("SOAK_DEVICE_FAULTS", "20"))
CONFIRM = 0.2  # the sidecar's drop confirmation
ROUNDS = int(os.environ.get("SOAK_ROUNDS", "1000"))
# Phases where /healthz must answer 200 throughout: healthy ones, and faults no restart mends.
LIVE_PHASES = ("warm-up", "restarts", "steady", "corrupt", "unhealthy", "zero devices")
CORRUPT = [
    b"",
    b"{not json",
    b"null",
    b'{"Data":null}',
]


class Poller:
    """GET /healthz and /readyz 20 times a second, each answer tagged with the phase it fell in."""

    def __init__(self, n: Node) -> None:
        self.n, self.phase = n, "warm-up"
        self.samples: list[tuple[str, int, int]] = []  # phase, liveness, readiness
        self.wrong: list[str] = []  # the verbose answers of liveness failures where none is due
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        while True:
            phase = self.phase
            async with self.n.http.get(self.n.url + "/healthz?verbose") as r:
                live, body = r.status, await r.text()
            ready = await self.n.status("/readyz")
            if phase == self.phase:  # an answer that straddles two phases belongs to neither
                self.samples.append((phase, live, ready))
                if live != 200 and phase in LIVE_PHASES and len(self.wrong) < 5:
                    self.wrong.append(f"{phase}: {live} {body}")
            await asyncio.sleep(0.05)


async def registered(n: Node) -> None:
    """The kubelet has every plugin's devices and the sidecar has seen every check pass (never past the
    soak's deadline: a verdict that never comes ends the soak, failed)."""
    while not all(n.kubelet.healthy_devices(r) and n.kubelet.connected(r) for r in (GPU, ASCEND)):
        await asyncio.sleep(0.005)
        if time.monotonic() > DEADLINE:
            raise TimeoutError("the kubelet never listed every plugin's devices again")
    while await n.status("/readyz") != 200:
        await asyncio.sleep(0.005)
        if time.monotonic() > DEADLINE:
            raise TimeoutError("/readyz never answered 200 again")


async def kubelet_restart(n: Node, plugins_first: bool) -> None:
    """A kubelet restart whose cleanup removes the sockets in the order given (the kubelet's own walk
    of the folder does not sort: both orders happen on nodes)."""
    k = n.kubelet
    await k.stop()  # killed: kubelet.sock stays behind as a dead file
    sockets = [p.socket_path for p in (n.plugin, *n.others)]
    for path in [*sockets, k.socket_path] if plugins_first else [k.socket_path, *sockets]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    await k.start()


async def status(n: Node) -> dict[str, object]:
    async with n.http.get(n.url + "/status") as r:
        doc: dict[str, object] = json.loads(await r.read())
        return doc


@dataclass
class Footprint:
    """20 samples of the sidecar: a probe in flight holds sockets and tasks for a moment, a leak holds
    them in every sample. So the end's least must not exceed the baseline's most."""

    fds: tuple[int, int]  # least, most
    rss: int  # least
    threads: tuple[int, int]
    tasks: dict[str, tuple[int, int]]  # per coroutine


async def footprint(n: Node) -> Footprint:
    p = n.process
    fds, rss, threads, kinds = [], [], [], []
    for _ in range(20):
        kinds.append((await status(n))["runtime"]["task_kinds"])  # type: ignore[index]
        fds.append(p.num_fds())
        rss.append(p.memory_info().rss)
        threads.append(p.num_threads())
        await asyncio.sleep(0.037)
    names = {k for sample in kinds for k in sample}
    tasks = {k: (min(s.get(k, 0) for s in kinds), max(s.get(k, 0) for s in kinds)) for k in names}
    return Footprint((min(fds), max(fds)), min(rss), (min(threads), max(threads)), tasks)


def check(ok: bool, what: str, failures: list[str]) -> None:
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}", flush=True)


class Faults:
    """Each fault once: drive it, time the verdict, check its bound, recover. `failures` collects."""

    def __init__(self, n: Node, poll: Poller, failures: list[str]) -> None:
        self.n, self.poll, self.failures = n, poll, failures

    def verdict(self, phase: str, i: int, took: float, bound: float, what: str = "503") -> None:
        check(took <= bound, f"{phase} {i}: {what} after {took:.3f} s (bound {bound:.2f} s)", self.failures)

    async def restart(self, i: int) -> None:
        self.poll.phase = "restarts"
        seen = (await status(self.n))["kubelet_restarts"]
        await kubelet_restart(self.n, plugins_first=i % 2 == 0)
        # Ready again only once the sidecar counted this restart: its /readyz from before would pass
        # at once, and the next fault would meet a restart still being judged.
        until = time.monotonic() + 5
        while (await status(self.n))["kubelet_restarts"] == seen and time.monotonic() < until:
            await asyncio.sleep(0.005)
        check(time.monotonic() < until, f"restart {i}: not counted within 5 s", self.failures)
        await registered(self.n)

    async def crash(self, i: int) -> None:
        n = self.n
        self.poll.phase = "crash"
        await n.plugin.crash()
        self.verdict("crash", i, await n.until(503, timeout=5), 0.5)
        self.poll.phase = "recovering"
        await n.plugin.restart()
        await registered(n)

    async def hang(self, i: int) -> None:
        n = self.n
        self.poll.phase = "hang"
        n.plugin.hung = True
        # The next round's probe times out, then the confirming one.
        self.verdict("hang", i, await n.until(503, timeout=5), INTERVAL + 2 * TIMEOUT + CONFIRM + 0.5)
        self.poll.phase = "recovering"
        n.plugin.hung = False
        await registered(n)

    async def drop(self, i: int) -> None:
        n = self.n
        self.poll.phase = "drop"
        await n.kubelet.drop(GPU)  # the kubelet lets go; the plugin keeps serving
        self.verdict("drop", i, await n.until(503, timeout=5), INTERVAL + TIMEOUT + CONFIRM + 0.5)
        self.poll.phase = "recovering"
        await n.plugin.restart()
        await registered(n)

    async def missed(self, i: int) -> None:
        """The plugin misses kubelet.sock's creation and never registers again."""
        n = self.n
        self.poll.phase = "missed"
        n.plugin.register_enabled = False
        await kubelet_restart(n, plugins_first=i % 2 == 0)
        self.verdict("missed registration", i, await n.until(503, timeout=10), GRACE + 1.0)
        self.poll.phase = "recovering"
        n.plugin.register_enabled = True
        await n.plugin.restart()
        await registered(n)

    async def devices(self, i: int) -> None:
        """Every GPU unhealthy, or none at all: registered still, not ready, never restarted."""
        n = self.n
        self.poll.phase = "unhealthy" if i % 2 == 0 else "zero devices"
        if i % 2 == 0:
            for device in ("GPU-0", "GPU-1"):
                n.plugin.set_health(device, False)
        else:
            n.plugin.set_devices([])
        self.verdict(self.poll.phase, i, await n.until(503, timeout=5, path="/readyz"), 0.5, "/readyz 503")
        self.poll.phase = "recovering"
        n.plugin.set_devices(["GPU-0", "GPU-1"])
        await registered(n)

    async def corrupt(self, i: int) -> None:
        n = self.n
        self.poll.phase = "corrupt"
        tmp = n.kubelet.checkpoint_path + ".soak"
        with open(tmp, "wb") as f:
            f.write(CORRUPT[i % len(CORRUPT)])
        os.replace(tmp, n.kubelet.checkpoint_path)
        self.verdict(
            "corrupt checkpoint", i, await n.until(503, timeout=5, path="/readyz"), 0.5, "/readyz 503"
        )
        self.poll.phase = "recovering"
        n.plugin.set_health("GPU-0", True)  # any update makes the kubelet rewrite its checkpoint
        await registered(n)


async def main() -> int:
    log = tempfile.mktemp(prefix="hami-soak-", suffix=".log")
    failures: list[str] = []
    args = (
        "--probe-interval",
        str(INTERVAL),
        "--probe-timeout",
        str(TIMEOUT),
        "--registration-grace",
        str(GRACE),
        "--log-format",
        "json",
        "--expect-devices",
        "2",
    )
    # No keep-alive: every poll opens and closes its connection, so that the server's fds and tasks
    # at the end can be compared with the baseline's.
    async with node(*args, log=log, keepalive=False, ascend=True) as n:
        poll = Poller(n)
        faults = Faults(n, poll, failures)
        phases = [
            (RESTARTS, faults.restart, "kubelet restarts with re-registration, both removal orders"),
            (CRASHES, faults.crash, "plugin crashes and re-registrations"),
            (HANGS, faults.hang, "hangs"),
            (DROPS, faults.drop, "kubelet drops"),
            (MISSED, faults.missed, "restarts without re-registration"),
            (DEVICE_FAULTS, faults.devices, "device faults (all unhealthy, zero devices)"),
            (CORRUPTIONS, faults.corrupt, "corrupt checkpoints"),
        ]
        # Warm-up: every fault a few times and a whole phase of kubelet restarts (the densest: the
        # sidecar's RSS steps up by 2 to 3 MiB once during the first such burst, then stays flat
        # through every later phase), then the baseline: what grows after it is what is kept.
        for _, fault, _ in phases:
            for i in range(RESTARTS if fault == faults.restart else 4):
                await fault(i)
        poll.phase = "warm-up"
        await asyncio.sleep(1)
        base = await footprint(n)

        for count, fault, what in phases:
            for i in range(count):
                await fault(i)
                if time.monotonic() > DEADLINE:
                    break
            rss = n.process.memory_info().rss / 2**20
            print(f"{count} {what} ({time.monotonic() - START:.0f} s, RSS {rss:.1f} MiB)", flush=True)

        poll.phase = "steady"
        while (rounds := int((await status(n))["probe_rounds"])) < ROUNDS and time.monotonic() < DEADLINE:  # type: ignore[call-overload]
            await asyncio.sleep(1)
        print(f"{rounds} probe rounds ({time.monotonic() - START:.0f} s)", flush=True)
        check(rounds >= ROUNDS, f"only {rounds} probe rounds", failures)
        await asyncio.sleep(2)
        poll.task.cancel()

        end = await footprint(n)
        bad = [ph for ph, live, _ in poll.samples if live != 200 and ph in LIVE_PHASES]
        check(
            not bad, f"{len(bad)} liveness answers of 503 during phases it must pass ({set(bad)})", failures
        )
        print(f"wrong verdicts: {len(bad)} (goal 0)")
        for answer in poll.wrong:
            print(f"  a wrong liveness answer, then ?verbose: {answer}")
        check(end.fds[0] <= base.fds[1], f"open fds {base.fds} -> {end.fds} (least, most)", failures)
        check(end.threads[0] <= base.threads[1], f"threads {base.threads} -> {end.threads}", failures)
        leaked = {
            k: (base.tasks.get(k), v) for k, v in end.tasks.items() if v[0] > base.tasks.get(k, (0, 0))[1]
        }
        check(not leaked, f"tasks leaked: {leaked}", failures)
        growth = (end.rss - base.rss) / 2**20
        check(growth <= 2.0, f"RSS grew {growth:.2f} MiB after warm-up", failures)
        tasks = (sum(v[0] for v in base.tasks.values()), sum(v[0] for v in end.tasks.values()))
        print(
            f"polled /healthz {len(poll.samples)} times; fds {base.fds}->{end.fds}, threads {base.threads}->"
            f"{end.threads}, tasks {tasks[0]}->{tasks[1]}, "
            f"RSS {base.rss / 2**20:.1f}->{end.rss / 2**20:.1f} MiB"
            f" ({growth:+.2f})"
        )
    with open(log) as f:
        text = f.read()
    check(
        "Traceback" not in text and '"level": "error"' not in text,
        "an exception or error in the log",
        failures,
    )
    transitions = text.count('"check":')
    print(
        f"log: {len(text.splitlines())} lines, {transitions} check transitions, no exception: "
        f"{'Traceback' not in text}"
    )
    if not failures:
        os.unlink(log)
    else:
        print(f"log kept: {log}")
    print("soak: " + ("PASSED" if not failures else f"FAILED ({len(failures)} failures)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
