"""The sidecar's DRA verdicts against the kubelet's real plugin manager and DRA manager (tests/realdra).

At "new" (k8s.io/kubernetes v1.37.2) and "old" (v1.36.5), or the releases $REALDRA_RELEASES names
(1.34 on; `make real-slow` runs every one). The kubelet's
truth is its own state (the DRA plugin manager's endpoints and whether gRPC reports them
connected); the sidecar's verdicts come from `sidecar.dra.watch.DraWatch`, whose judge runs on a
clock the test moves. Without the fixture (`make dra-fixtures`) the tests skip; under CI=true
they fail. Marked slow: `make real-slow` runs them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sidecar.dra.probes import get_info
from sidecar.dra.spec import DEFAULT_GRACE, DraSpec
from sidecar.dra.verdicts import Judgement
from sidecar.dra.watch import DraWatch
from sidecar.health import Status
from testing.realdra import FixtureError, RealDraDriver, RealDraKubelet, Release, minor, selected_releases
from tests.conftest import require_dra_fixture

DRIVER = "gpu.example.com"
RELEASES: list[Release] = selected_releases()
# About a minute a release: run by `make real-slow` (and .ci/run), not `make test`, which
# keeps tests/e2e/test_dra.py (the whole sidecar against the same fixture) and the wire vectors.
pytestmark = pytest.mark.slow


require_fixture = require_dra_fixture


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> Release:
    rel: Release = request.param
    require_fixture(rel)
    return rel


class Clock:
    """The judge's clock: moved by the test, never by waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """One test's node: a registry, a kubelet, drivers, and the sidecar's watch of one driver."""

    def __init__(self, root: str, release: Release) -> None:
        self.root = root
        self.release = release
        self.registry = os.path.join(root, "plugins_registry")
        self.plugins = os.path.join(root, "plugins")
        os.makedirs(self.registry)
        os.makedirs(self.plugins)
        self.kubelet_socket = os.path.join(root, "kubelet.sock")
        self.kubelet = RealDraKubelet(
            self.registry, os.path.join(root, "state"), self.kubelet_socket, release=release
        )
        self.drivers: list[RealDraDriver] = []
        self.watches: list[DraWatch] = []
        self.clock = Clock()

    def driver(
        self, name: str = DRIVER, *, rolling_uid: str = "", health: str = "off", refuse: bool = False
    ) -> RealDraDriver:
        d = RealDraDriver(
            name,
            self.registry,
            os.path.join(self.plugins, name),
            release=self.release,
            rolling_uid=rolling_uid,
            health=health,
            refuse=refuse,
        )
        self.drivers.append(d)
        return d

    def watch(self, registration: str, name: str = DRIVER, grace: float = DEFAULT_GRACE) -> DraWatch:
        watch = DraWatch(
            [DraSpec(name, registration)], self.kubelet_socket, grace=grace, timeout=2.0, clock=self.clock
        )
        self.watches.append(watch)
        return watch

    async def close(self) -> None:
        for w in self.watches:
            w.close()
        for d in self.drivers:
            await d.close()
        await self.kubelet.close()


@pytest.fixture
async def node(short_tmp: str, release: Release) -> AsyncIterator[Node]:
    require_fixture(release)
    n = Node(short_tmp, release)
    try:
        yield n
    finally:
        await n.close()


async def verdict(watch: DraWatch, name: str = DRIVER) -> Judgement:
    return (await watch.round())[name][1]


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0, what: str = "") -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.05)


async def settle(node: Node, watch: DraWatch, usable: bool, timeout: float = 30.0) -> Judgement:
    """Wait until the kubelet's truth is `usable` and the sidecar's reading agrees (the kernel's table
    and the kubelet's gRPC state change a few ms apart); the last verdict."""
    last: list[Judgement] = []

    async def agreed() -> bool:
        if await node.kubelet.usable(DRIVER) != usable:
            return False
        j = await verdict(watch)
        last[:] = [j]
        return (j.registered.status is Status.OK) == usable

    try:
        await until(agreed, timeout)
    except TimeoutError:
        pytest.fail(f"kubelet usable={usable} and the sidecar did not agree: {last}")
    return last[0]


async def test_registration_getinfo_only(node: Node) -> None:
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    # No kubelet yet: alive, not registered, pending (no restart asked for) within the grace.
    j = await verdict(watch)
    assert j.plugin.status is Status.OK, j
    assert j.registered.status is Status.FAILED and not j.registered.restarts, j  # the kubelet is down
    await node.kubelet.start()
    j = await settle(node, watch, usable=True)
    assert j.plugin.status is Status.OK
    assert "1 connection" in j.registered.reason
    (ep,) = await node.kubelet.endpoints(DRIVER)
    assert ep["endpoint"] == driver.service
    # The sidecar asks GetInfo, and the DRA service an empty NodePrepareResources (one per round at
    # most): no NotifyRegistrationStatus, no claim to prepare.
    status = await driver.status()
    notify, prepare = (
        status["calls"].get("NotifyRegistrationStatus"),
        status["calls"].get("NodePrepareResources", 0),
    )
    for _ in range(3):
        await verdict(watch)
    status = await driver.status()
    assert status["calls"].get("NotifyRegistrationStatus") == notify == 1
    assert 1 <= status["calls"].get("NodePrepareResources", 0) - prepare <= 3
    prepared = driver.proc.find("prepare", lambda e: True)
    assert prepared and all(e["claims"] == 0 for e in prepared), prepared
    assert (await node.kubelet.call(DRIVER))["ok"], "the kubelet's own call on its connection"


# Before 1.36 the plugin manager keeps a driver whose NotifyRegistrationStatus fails: the handler has
# registered it already, and pluginmanager/operationexecutor/operation_generator.go's
# GenerateRegisterPluginFunc returns the error without RemovePlugin or DeRegisterPlugin (both from 1.36).
NOTIFY_REFUSAL_DEREGISTERS = 36


def requires_deregistering_refusal(node: Node) -> None:
    if minor(node.release) < NOTIFY_REFUSAL_DEREGISTERS:
        pytest.skip(
            f"{node.kubelet.version} keeps a driver that refuses NotifyRegistrationStatus registered: "
            "the refusal cannot make it unregistered (test_a_refused_notify_is_kept_before_1_36)"
        )


async def test_a_refused_notify_is_kept_before_1_36(node: Node) -> None:
    """1.34 and 1.35: a driver that refuses NotifyRegistrationStatus stays registered (one call, no
    retry), its DRA service usable by the kubelet: the sidecar says registered."""
    if minor(node.release) >= NOTIFY_REFUSAL_DEREGISTERS:
        pytest.skip("from 1.36 the kubelet deregisters a refusing driver and retries")
    driver = node.driver()
    await driver.start()
    await driver.set("refuse", True)
    await node.kubelet.start()
    await until(lambda: _true(driver.calls("NotifyRegistrationStatus") >= 1), 15, "a refused attempt")
    watch = node.watch(driver.registration)
    j = await settle(node, watch, usable=True)
    assert j.registered.status is Status.OK, j
    assert len(await node.kubelet.endpoints(DRIVER)) == 1
    await asyncio.sleep(3)
    assert driver.calls("NotifyRegistrationStatus") == 1  # no retry: the kubelet holds it


async def test_refused_registration_fails_after_grace_then_retry_registers(node: Node) -> None:
    requires_deregistering_refusal(node)
    driver = node.driver()
    await driver.start()
    await driver.set("refuse", True)
    await node.kubelet.start()
    # The kubelet calls NotifyRegistrationStatus, is refused, deregisters and retries with backoff.
    await until(lambda: _true(driver.calls("NotifyRegistrationStatus") >= 2), 15, "two refused attempts")
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=False)
    assert not await node.kubelet.endpoints(DRIVER)
    j = await verdict(watch)
    assert j.registered.status is Status.PENDING, j
    node.clock.now += DEFAULT_GRACE + 1
    j = await verdict(watch)
    assert j.registered.status is Status.FAILED and j.registered.restarts, j  # fails liveness
    # The refusal ends: the kubelet's next retry (its backoff is still short here) registers it.
    await driver.set("refuse", False)
    j = await settle(node, watch, usable=True, timeout=30)
    assert j.registered.status is Status.OK


async def test_driver_restart_same_socket(node: Node) -> None:
    await node.kubelet.start()
    first = node.driver()
    await first.start()
    watch = node.watch(first.registration)
    await settle(node, watch, usable=True)
    await first.stop()  # orderly: both sockets go, the kubelet deregisters
    j = await settle(node, watch, usable=False)
    assert j.registered.status is Status.PENDING and j.plugin.status is Status.PENDING, j
    second = node.driver()
    await second.start()
    assert second.registration == first.registration
    j = await settle(node, watch, usable=True)
    assert j.plugin.status is Status.OK
    assert len(await node.kubelet.endpoints(DRIVER)) == 1


async def test_a_driver_restarted_between_two_rounds_is_a_new_instance(node: Node) -> None:
    """The kubelet restarts a driver that failed liveness for not being registered, quicker than one
    round: the socket files come back on the same paths. The new instance has its grace (no 503
    before it) and the restart counts against the budget. (ext4 may hand the old inode number back;
    whether it does here depends on the files made in between: tests/test_dra.py pins that case.)"""
    requires_deregistering_refusal(node)
    await node.kubelet.start()
    first = node.driver(refuse=True)
    await first.start()
    await until(lambda: _true(first.calls("NotifyRegistrationStatus") >= 1), 15, "a refused attempt")
    watch = node.watch(first.registration)
    await settle(node, watch, usable=False)
    node.clock.now += DEFAULT_GRACE + 1
    j = await verdict(watch)
    assert j.registered.live_failed, j
    inode = os.stat(first.registration).st_ino
    await first.stop()
    second = node.driver(refuse=True)
    await second.start()
    assert second.registration == first.registration
    await until(lambda: _true(second.calls("NotifyRegistrationStatus") >= 1), 15, "the new one refused")
    j = await settle(node, watch, usable=False)
    same = os.stat(second.registration).st_ino == inode
    assert j.registered.status is Status.PENDING and not j.registered.live_failed, (same, j)
    assert j.restarts_in_vain == 1, (same, j)
    node.clock.now += DEFAULT_GRACE + 1
    j = await verdict(watch)
    assert j.registered.live_failed, j  # its own grace over: the budget allows another restart


async def test_driver_crash_leaves_stale_sockets(node: Node) -> None:
    await node.kubelet.start()
    first = node.driver()
    await first.start()
    watch = node.watch(first.registration)
    await settle(node, watch, usable=True)
    await first.crash()  # SIGKILL: the files stay, nothing listens
    j = await settle(node, watch, usable=False)
    # Alive no more: the plugin check fails liveness at once (the container is dead anyway).
    assert j.plugin.status is Status.FAILED and j.plugin.restarts, j
    assert j.registered.status is not Status.OK and not j.registered.live_failed, j
    # The kubelet keeps the endpoint (the registration socket file is still there) and reconnects
    # to the new instance's service on the same path.
    assert len(await node.kubelet.endpoints(DRIVER)) == 1
    second = node.driver()
    await second.start()
    j = await settle(node, watch, usable=True)
    assert j.plugin.status is Status.OK


async def test_driver_restart_with_a_new_socket(node: Node) -> None:
    """Rolling update: each instance its own registration and service socket (pod UID)."""
    await node.kubelet.start()
    old = node.driver(rolling_uid="uid-a")
    await old.start()
    old_watch = node.watch(old.registration)
    await settle(node, old_watch, usable=True)
    new = node.driver(rolling_uid="uid-b")
    await new.start()
    assert new.registration != old.registration and new.service != old.service
    new_watch = node.watch(new.registration)

    async def both() -> bool:
        return len(await node.kubelet.endpoints(DRIVER)) == 2

    await until(both, 15)
    j = await settle(node, new_watch, usable=True)
    assert j.registered.status is Status.OK
    assert (await verdict(old_watch)).registered.status is Status.OK
    await old.stop()

    async def one() -> bool:
        return [e["endpoint"] for e in await node.kubelet.endpoints(DRIVER)] == [new.service]

    await until(one, 15)
    assert (await verdict(new_watch)).registered.status is Status.OK
    j = await verdict(old_watch)
    assert j.registered.status is Status.PENDING and j.plugin.status is Status.PENDING, j


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "crash"])
async def test_kubelet_restart_never_fails_liveness(node: Node, crash: bool) -> None:
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    seen: list[Judgement] = []
    stop = asyncio.Event()

    async def observe() -> None:
        while not stop.is_set():
            seen.append(await verdict(watch))
            await asyncio.sleep(0.02)

    task = asyncio.create_task(observe())
    try:
        # Down until a round has seen it (a quick restart can pass between two rounds unseen, 1 run in
        # about 20 here), then up again: the plugin watcher registers the driver anew.
        await (node.kubelet.crash() if crash else node.kubelet.stop())
        await until(
            lambda: _true(any(j.registered.status is not Status.OK for j in seen)), 10, "kubelet gone"
        )
        node.kubelet.restarts += 1
        await node.kubelet.start()
        await settle(node, watch, usable=True)
    finally:
        stop.set()
        await task
    assert seen and not any(j.registered.live_failed or j.plugin.live_failed for j in seen), seen


async def test_connection_loss_reconnects_and_service_loss_fails_after_grace(node: Node) -> None:
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    assert await driver.drop() >= 1
    # The kubelet reconnects at once (its HandleConn asks gRPC to): never a liveness failure.
    j = await settle(node, watch, usable=True)
    assert not j.registered.live_failed
    # The DRA service dies while registration answers: the kubelet cannot reconnect.
    await driver.service_off()
    j = await settle(node, watch, usable=False)
    assert j.plugin.status is Status.OK
    assert j.registered.status is Status.PENDING, j
    node.clock.now += DEFAULT_GRACE + 1
    j = await verdict(watch)
    assert j.registered.status is Status.FAILED and j.registered.restarts, j
    assert "does not exist" in j.registered.reason


async def test_hung_driver_fails_liveness(node: Node) -> None:
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    await driver.set("hang", True)
    j = await verdict(watch)
    assert j.plugin.status is Status.PENDING, j  # one timeout is not a hang
    j = await verdict(watch)
    assert j.plugin.status is Status.FAILED and j.plugin.restarts and "hung" in j.plugin.reason, j
    await driver.set("hang", False)
    assert (await verdict(watch)).plugin.status is Status.OK


@pytest.mark.parametrize("how", ["hang-service", "stall-service"])
async def test_hung_dra_service_fails_liveness_after_the_grace(node: Node, how: str) -> None:
    """Registration answers, the DRA service does not: its calls block (hang-service), or its listener
    stops accepting, connections left unread in the backlog (stall-service). The kubelet keeps the
    driver, reports its connection, wipes nothing; only its calls fail. The sidecar's dra-plugin
    fails liveness once the silence lasted the grace; dra-registered never does."""
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    mark = len(node.kubelet.proc.events)
    await (driver.set(how, True) if how == "hang-service" else driver.stall(True))
    # The kubelet's truth: still registered, its own call on its own connection fails.
    # (A call that raced the stall's end of the old connection fails Unavailable: the next one waits.)
    for _ in range(3):
        answer = await node.kubelet.call(DRIVER)
        assert answer["registered"] and not answer["ok"], answer
        if "DeadlineExceeded" in str(answer["error"]):
            break
    assert "DeadlineExceeded" in str(answer["error"]), answer
    assert len(await node.kubelet.endpoints(DRIVER)) == 1
    before = driver.calls("NodePrepareResources")
    j = await verdict(watch)
    assert j.plugin.status is Status.PENDING and "has not answered" in j.plugin.reason, j
    assert not j.registered.live_failed, j
    node.clock.now += DEFAULT_GRACE + 1
    seen = [await verdict(watch) for _ in range(2)]
    assert not any(j.registered.live_failed for j in seen), seen
    j = seen[-1]
    assert j.plugin.live_failed and "hung DRA service" in j.plugin.reason, j
    assert await node.kubelet.usable(DRIVER), "the kubelet reports it connected"
    assert not node.kubelet.wipes(DRIVER, mark)
    # One call in flight at most: three rounds of a silent service sent it one NodePrepareResources.
    assert driver.calls("NodePrepareResources") - before <= 1
    # The service answers again: the verdicts follow, and the kubelet's calls succeed.
    await (driver.set(how, False) if how == "hang-service" else driver.stall(False))
    j = await settle(node, watch, usable=True)

    async def answers() -> bool:
        return (await verdict(watch)).plugin.status is Status.OK

    await until(answers, 15)
    assert (await node.kubelet.call(DRIVER))["ok"]


async def test_the_sidecars_own_service_call_is_never_the_kubelets_connection(node: Node) -> None:
    """The sidecar's empty NodePrepareResources, held open by a hung service, is a connection to the
    service socket in this namespace; where the kubelet's descriptors cannot be read (the fixture's
    kubelet is no process named kubelet), only the sidecar's own descriptors tell it apart."""
    requires_deregistering_refusal(node)
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    await driver.set("refuse", True)
    await driver.drop()  # the kubelet's connection ends; refused, it does not come back
    await node.kubelet.restart()
    await until(lambda: _true(driver.calls("NotifyRegistrationStatus") >= 2), 15)
    await settle(node, watch, usable=False)
    await driver.set("hang-service", True)
    for _ in range(3):
        ev, j = (await watch.round())[DRIVER]
        assert ev.connections == 0, (ev, j)
        assert j.registered.status is not Status.OK, j
    assert not await node.kubelet.usable(DRIVER)
    await driver.set("hang-service", False)


async def test_health_stream_per_release(node: Node) -> None:
    """1.36 opens NodeWatchResources for every driver and logs an error each 5 s when it is not
    served; 1.37 opens it only for a driver that advertises DRAResourceHealth; 1.34 and 1.35 never
    (their ResourceHealthStatus feature gate is alpha, off)."""
    await node.kubelet.start()
    driver = node.driver()
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    mark = node.kubelet.proc.mark()
    await asyncio.sleep(6)
    message = "Error receiving from WatchResources stream"
    errors = node.kubelet.proc.find("log", lambda e: e.get("msg") == message, mark)
    (ep,) = await node.kubelet.endpoints(DRIVER)
    if minor(node.release) == 36:
        # The driver does not serve the service: gRPC answers Unimplemented before any handler (no
        # call reaches the driver's interceptor), and the kubelet logs it as an error, again and again.
        assert errors, "no health-stream error in 6 s"
        await node.kubelet.proc.wait_log(
            message, after=node.kubelet.proc.events.index(errors[-1]) + 1, timeout=7
        )
        assert "Unimplemented" in str(errors[0]["line"])
        assert "health_service" not in ep
    else:
        assert driver.calls("NodeWatchResources") == 0
        assert not errors
        # 1.34 and 1.35 keep no health service of a plugin at all.
        assert ep.get("health_service") == ("" if minor(node.release) >= 37 else None)
    # Either way the driver is registered, and the sidecar says so.
    assert (await verdict(watch)).registered.status is Status.OK


@pytest.mark.parametrize("release", ["new"])  # the 1.36 helper's driver here has no health service
async def test_health_stream_declined_on_the_new_release(node: Node) -> None:
    await node.kubelet.start()
    driver = node.driver(health="unsupported")
    await driver.start()
    watch = node.watch(driver.registration)
    await settle(node, watch, usable=True)
    await until(lambda: _true(driver.calls("NodeWatchResources") >= 1), 10)
    (ep,) = await node.kubelet.endpoints(DRIVER)
    assert ep["health_service"] == "v1.DRAResourceHealth"
    await asyncio.sleep(6)
    assert driver.calls("NodeWatchResources") == 1  # Unimplemented: the 1.37 kubelet stops watching
    assert (await verdict(watch)).registered.status is Status.OK


async def test_getinfo_names_another_driver(node: Node) -> None:
    driver = node.driver("other.example.com")
    await driver.start()
    watch = node.watch(driver.registration, name=DRIVER)
    j = await verdict(watch)
    assert j.plugin.status is Status.FAILED and not j.plugin.restarts, j
    assert not j.registered.live_failed


async def test_getinfo_reading_is_total(short_tmp: str) -> None:
    """Absent, a plain file, a stale socket: each a reason, never an exception."""
    path = os.path.join(short_tmp, "x-reg.sock")
    assert (await get_info(path, 0.5)).kind == "absent"
    with open(path, "w") as f:
        f.write("not a socket")
    assert (await get_info(path, 0.5)).kind == "not-socket"
    os.unlink(path)

    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    assert (await get_info(path, 0.5)).kind == "refused"
    assert (await get_info("\0bad", 0.5)).kind == "absent"


async def _true(value: bool) -> bool:
    return value


__all__ = ["FixtureError"]
