"""An oracle for DRA drivers: seeded random events through the kubelet's real plugin manager and DRA
manager (tests/realdra), the sidecar's DRA verdicts compared at every quiet point with the kubelet's
truth.

The truth: the DRA plugin manager has an endpoint of the driver that gRPC reports connected (its
`usable`, which decides the ResourceSlice wipe). The sidecar's `dra-registered` must be ok exactly
then (within SETTLE seconds); it must never fail liveness while the driver is usable and answers,
nor while the kubelet is down; and once the grace has passed (the judge's clock is the test's) with
the kubelet up, the driver answering and not usable, it must fail liveness, unless the restart
budget is spent.

A silent DRA service (its calls block, or its listener stops accepting while registration answers)
is the exception to "usable": the kubelet keeps such a driver and reports its connection (gRPC
reports it connected before the server's first frame), while none of its calls can succeed. Then
dra-registered must never fail liveness, and once the grace has passed dra-plugin must.

Marked slow: `make real-slow` runs 200 events with three seeds on each release, the two releases side
by side (ORACLE_EVENTS, ORACLE_SEEDS; 5 events and seed 1 by default).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

import pytest

from sidecar.dra.spec import DraSpec
from sidecar.dra.verdicts import RESTART_BUDGET, Judgement
from sidecar.dra.watch import DraWatch
from sidecar.health import Status
from testing.realdra import RealDraDriver, RealDraKubelet, Release
from tests.test_realdra import Clock

EVENTS = int(os.environ.get("ORACLE_EVENTS", "5"))
SEEDS = [int(s) for s in os.environ.get("ORACLE_SEEDS", "1").split(",")]
SETTLE = 8.0  # the kubelet's registration (its 1 s reconciler, its retry backoff) and reconnection
GRACE = 150.0
QUIET = 1.5
DRIVER = "gpu.example.com"


@dataclass
class Oracle:
    root: str
    release: Release
    rng: random.Random
    kubelet: RealDraKubelet
    driver: RealDraDriver
    watch: DraWatch
    clock: Clock
    history: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    kubelet_up: bool = True
    alive: bool = True  # the driver process runs
    service: bool = True  # its DRA service listens
    hung: bool = False
    service_hung: bool = False  # the DRA service's calls block
    stalled: bool = False  # the DRA service's listener does not accept
    refusing: bool = False
    rounds: int = 0
    seen_usable: set[bool] = field(default_factory=set)

    def new_driver(self) -> RealDraDriver:
        return RealDraDriver(
            DRIVER, self.kubelet.registry, os.path.join(self.root, "plugins", DRIVER), release=self.release
        )

    async def usable(self) -> bool:
        return self.kubelet_up and await self.kubelet.usable(DRIVER)

    async def judge(self) -> Judgement:
        self.rounds += 1
        return (await self.watch.round())[DRIVER][1]

    @property
    def silent(self) -> bool:
        return self.alive and self.service and (self.service_hung or self.stalled)

    def check_liveness(self, j: Judgement, usable: bool) -> None:
        if self.silent and j.registered.live_failed:
            self.mismatches.append(
                f"dra-registered fails liveness for a silent service: {self.history[-6:]}: {j}"
            )
        if (
            usable
            and not self.hung
            and not self.silent
            and (j.registered.live_failed or j.plugin.live_failed)
        ):
            self.mismatches.append(f"wrong liveness failure while usable, after {self.history[-6:]}: {j}")
        if not self.kubelet_up and j.registered.live_failed:
            self.mismatches.append(
                f"liveness failure while the kubelet is down, after {self.history[-6:]}: {j}"
            )

    async def quiet(self) -> None:
        """Until the kubelet's truth has not changed for QUIET seconds (its reconciler runs each
        second; a registration or a reconnection lands within that), at most SETTLE."""
        started = stable = time.monotonic()
        last = await self.usable()
        while time.monotonic() - stable < QUIET and time.monotonic() - started < SETTLE:
            await asyncio.sleep(0.1)
            now = await self.usable()
            if now != last:
                last, stable = now, time.monotonic()

    async def settle(self) -> None:
        await self.quiet()
        deadline = time.monotonic() + SETTLE
        while True:
            usable = await self.usable()
            self.seen_usable.add(usable)
            j = await self.judge()
            self.check_liveness(j, usable)
            if (j.registered.status is Status.OK) == usable:
                break
            if self.silent and j.registered.status is not Status.OK:
                break  # a stalled service's connection waits in its backlog, invisible; usable flaps
            if time.monotonic() > deadline:
                self.mismatches.append(
                    f"after {self.history[-6:]}: sidecar {j.registered}, kubelet usable={usable}"
                )
                return
            await asyncio.sleep(0.1)
        # The grace side: once it passed, a driver that answers and is not usable fails liveness.
        if self.history and self.history[-1] == "time passes" and self.silent:
            j = await self.judge()  # a second round: one round's silence is not a hang
            self.check_liveness(j, await self.usable())
            if not j.plugin.live_failed and not self.hung:
                self.mismatches.append(f"after {self.history[-6:]}: a silent service passes liveness: {j}")
        elif self.history and self.history[-1] == "time passes":
            expect = (
                not usable
                and self.kubelet_up
                and self.alive
                and not self.hung
                and self.clock.now - j.spell_started >= GRACE
                and j.restarts_in_vain < RESTART_BUDGET
            )
            if j.registered.live_failed != expect:
                self.mismatches.append(
                    f"after {self.history[-6:]}: dra-registered fails liveness={j.registered.live_failed}, "
                    f"expected {expect} (usable={usable}, alive={self.alive}, kubelet up={self.kubelet_up})"
                )

    async def step(self) -> None:
        k, rng = self.kubelet, self.rng
        event = rng.choice(
            [
                "kubelet-restart",
                "kubelet-down",
                "driver-restart",
                "driver-crash",
                "refuse",
                "drop",
                "service-off",
                "hang",
                "hang-service",
                "stall-service",
                "time",
            ]
        )
        if not self.kubelet_up:
            event = "kubelet-up" if rng.random() < 0.7 else "time"
        elif not self.alive:
            event = "driver-start" if rng.random() < 0.7 else "time"
        if event == "kubelet-restart":
            crash = rng.random() < 0.5
            await k.restart(crash=crash)
            self.history.append(f"kubelet restart crash={crash}")
        elif event == "kubelet-down":
            crash = rng.random() < 0.5
            await (k.crash() if crash else k.stop())
            self.kubelet_up = False
            self.history.append(f"kubelet down crash={crash}")
        elif event == "kubelet-up":
            await k.start()
            self.kubelet_up = True
            self.history.append("kubelet up")
        elif event in ("driver-restart", "driver-crash"):
            crash = event == "driver-crash"
            if not crash:  # an orderly stop waits for the calls in flight
                if self.hung:
                    await self.driver.set("hang", False)
                if self.service_hung:
                    await self.driver.set("hang-service", False)
            await (self.driver.crash() if crash else self.driver.stop())
            await self.driver.close()
            self.alive, self.service, self.hung, self.refusing = False, False, False, False
            self.service_hung = self.stalled = False
            self.history.append("driver crash" if crash else "driver stop")
            if rng.random() < 0.6:
                await self.start_driver()
        elif event == "driver-start":
            await self.start_driver()
        elif event == "refuse":
            self.refusing = not self.refusing
            await self.driver.set("refuse", self.refusing)
            self.history.append(f"refuse {self.refusing}")
        elif event == "drop" and self.service:
            n = await self.driver.drop()
            self.history.append(f"drop {n} connections")
        elif event == "service-off" and self.service:
            already = await self.driver.service_off()
            self.service = False
            errors = [e.get("error") for e in self.driver.proc.find("driver-error", lambda e: True)]
            self.history.append(f"service off (already closed: {errors})" if already else "service off")
        elif event == "hang-service" and self.service:
            self.service_hung = not self.service_hung
            await self.driver.set("hang-service", self.service_hung)
            self.history.append(f"hang-service {self.service_hung}")
        elif event == "stall-service" and self.service:
            self.stalled = not self.stalled
            await self.driver.stall(self.stalled)
            self.history.append(f"stall-service {self.stalled}")
        elif event == "hang":
            self.hung = not self.hung
            await self.driver.set("hang", self.hung)
            self.history.append(f"hang {self.hung}")
        else:
            self.clock.now += GRACE + 1
            self.history.append("time passes")

    async def start_driver(self) -> None:
        self.driver = self.new_driver()
        await self.driver.start()
        self.alive, self.service = True, True
        self.history.append("driver start")


@pytest.fixture
def oracle_parts(short_tmp: str, dra_release: Release) -> tuple[str, Release]:
    return short_tmp, dra_release


@pytest.mark.slow
@pytest.mark.timeout(max(120, EVENTS * 12))
@pytest.mark.parametrize("seed", SEEDS)
async def test_dra_verdicts_agree_with_the_real_dra_manager_over_random_events(
    oracle_parts: tuple[str, Release], seed: int
) -> None:
    root, release = oracle_parts
    registry = os.path.join(root, "plugins_registry")
    os.makedirs(registry)
    kubelet_socket = os.path.join(root, "kubelet.sock")
    kubelet = RealDraKubelet(registry, os.path.join(root, "state"), kubelet_socket, release=release)
    clock = Clock()
    watch = DraWatch(
        [DraSpec(DRIVER, os.path.join(registry, f"{DRIVER}-reg.sock"))],
        kubelet_socket,
        grace=GRACE,
        timeout=0.5,
        clock=clock,
    )
    driver = RealDraDriver(DRIVER, registry, os.path.join(root, "plugins", DRIVER), release=release)
    oracle = Oracle(root, release, random.Random(seed), kubelet, driver, watch, clock)
    try:
        await kubelet.start()
        await driver.start()
        await oracle.settle()
        started = time.monotonic()
        for _ in range(EVENTS):
            await oracle.step()
            await oracle.settle()
        took = time.monotonic() - started
        print(
            f"DRA oracle seed {seed} on {kubelet.version}: {EVENTS} events, "
            f"{oracle.rounds} rounds, {took:.0f} s"
        )
        print("  " + "; ".join(oracle.history))
        print(f"  usable seen: {sorted(oracle.seen_usable)}")
    finally:
        watch.close()
        await oracle.driver.close()
        await kubelet.close()
    assert not oracle.mismatches, "\n".join(oracle.mismatches[:10])
