"""The sidecar: folder events and probe rounds in, check results out, one asyncio loop.

Data flows one way: watcher events and probe results -> HealthState -> HTTP views and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sidecar import __version__
from sidecar.checkpoint import CHECKPOINT_NAME
from sidecar.config import PluginSpec, Settings
from sidecar.health import Check, HealthState, Status
from sidecar.metrics import Metrics
from sidecar.probes import (
    Evidence,
    ProbeResult,
    SocketId,
    allocatable_devices,
    probe_kubelet,
    probe_plugin,
    read_checkpoint_async,
    registration_evidence,
    socket_identity,
    socket_refuses,
)
from sidecar.watcher import FolderWatcher, FsEvent

logger = logging.getLogger(__name__)

KUBELET_CHECK = "kubelet"
FOLDER_RETRY_SECONDS = 0.25
MIN_ROUND_GAP = 0.01


def plugin_check(resource: str) -> str:
    return f"plugin:{resource}"


def registered_check(resource: str) -> str:
    return f"registered:{resource}"


def devices_check(resource: str) -> str:
    return f"devices:{resource}"


@dataclass
class Attempt:
    resource: str
    cause: str
    opened_wall: float
    opened: float  # monotonic
    outcome: str = "open"  # open | registered | not registered within the grace
    latency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "cause": self.cause,
            "opened": _iso(self.opened_wall),
            "outcome": self.outcome,
            "latency_seconds": self.latency,
        }


class Sidecar:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.metrics = Metrics()
        self.state = HealthState(settings.registration_grace, clock, wall, self._on_transition)
        self.state.add(KUBELET_CHECK)
        for p in settings.plugins:
            self.state.add(plugin_check(p.resource))
            self.state.add(registered_check(p.resource))
            if settings.expect_devices is not None:
                self.state.add(devices_check(p.resource))
            self.metrics.attempts.labels(settings.plugin_label, p.resource)
            self.metrics.successes.labels(settings.plugin_label, p.resource)
            self.metrics.listandwatch_latency.labels(settings.plugin_label, p.resource)
        for check in self.state.checks.values():
            self.metrics.check_up.labels(check.name).set(check.status.up)
        self.started_wall = wall()
        self.started = clock()
        self.rounds = 0
        self.kubelet_restarts = 0
        self.history: deque[Attempt] = deque(maxlen=50)
        self.devices: dict[str, dict[str, int]] = {p.resource: {} for p in settings.plugins}
        self._attempts: dict[str, Attempt | None] = dict.fromkeys(
            (p.resource for p in settings.plugins), None
        )
        self._kubelet_down = False  # a kubelet restart is under way
        self._kubelet_id: SocketId | None = None  # kubelet.sock as last seen answering
        self._kubelet_recreated = False
        self._judging: set[str] = set()  # plugins whose vanished socket awaits its verdict
        self._vanished: dict[str, tuple[str, bool]] = {}  # a vanished socket's verdict and whether a crash
        self._plugin_ids: dict[str, SocketId | None] = {}  # each plugin socket as last seen answering
        self._by_socket = {p.socket: p for p in settings.plugins}
        self._trigger: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresh_handle: asyncio.TimerHandle | None = None
        self._watcher: FolderWatcher | None = None
        self._folder_id: tuple[int, int] | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._folder_waiting = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._trigger = asyncio.Event()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-sidecar-checkpoint")
        self._watcher = FolderWatcher(
            self.settings.device_plugin_dir,
            self._on_fs_event,
            loop,
            mode=self.settings.watch_mode,
            polling_interval=self.settings.polling_interval,
        )
        if not self._arm_watcher():
            self._await_folder()
        self._spawn(self._probe_loop(), "probe-loop")
        self._schedule_refresh()

    async def stop(self) -> None:
        if self._refresh_handle is not None:
            self._refresh_handle.cancel()
        if self._watcher is not None:
            self._watcher.stop()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self.rounds > 0

    @property
    def watch_mode(self) -> str:
        return self._watcher.active_mode if self._watcher else "none"

    def trigger(self) -> None:
        if self._trigger is not None:
            self._trigger.set()

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=f"hami-sidecar:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- the folder ------------------------------------------------------------------
    def _arm_watcher(self) -> bool:
        assert self._watcher is not None
        if not self._watcher.start():
            self._folder_id = None
            return False
        st = os.stat(self.settings.device_plugin_dir)
        self._folder_id = (st.st_dev, st.st_ino)
        logger.info("watching %s (%s)", self.settings.device_plugin_dir, self._watcher.active_mode)
        return True

    def _await_folder(self) -> None:
        """The folder is missing or was replaced: watch it again as soon as it is back."""
        if self._watcher is not None:
            self._watcher.stop()
        self._folder_id = None
        if not self._folder_waiting:
            self._folder_waiting = True
            self._spawn(self._wait_for_folder(), "folder-wait")

    async def _wait_for_folder(self) -> None:
        logger.warning("%s is missing or was replaced; waiting for it", self.settings.device_plugin_dir)
        try:
            while not self._arm_watcher():
                await asyncio.sleep(FOLDER_RETRY_SECONDS)
        finally:
            self._folder_waiting = False
        self.trigger()

    def _folder_replaced(self) -> bool:
        try:
            st = os.stat(self.settings.device_plugin_dir)
        except OSError:
            return self._folder_id is not None
        return self._folder_id != (st.st_dev, st.st_ino)

    def _on_fs_event(self, event: FsEvent) -> None:
        """Runs on the loop (the observer thread hands events over); decides, never blocks."""
        s = self.settings
        if event.kind == "folder-gone":
            self._kubelet_gone("the device-plugins folder was removed")
            self._await_folder()
        elif event.name == s.kubelet_socket:
            # Events trail the files by a few ms: when kubelet.sock is the one last seen answering,
            # the event is about an older file, and a probe has already judged the change.
            current = socket_identity(s.kubelet_path)
            stale = self._kubelet_id is not None and current == self._kubelet_id
            if event.kind == "deleted" and not stale:
                self._kubelet_gone(f"{s.kubelet_socket} was deleted")
            elif event.kind == "created" and not stale:
                self._kubelet_recreated = True
        elif event.name in self._by_socket:
            plugin = self._by_socket[event.name]
            if event.kind == "deleted":
                self._start_vanish_judge(plugin)
            elif event.kind == "created":
                self._plugin_socket_created(plugin)
        elif event.name != CHECKPOINT_NAME:
            return
        self.trigger()

    # -- kubelet restarts, registration cycles ------------------------------------------------
    def _kubelet_gone(self, why: str) -> None:
        """A kubelet restart (or stop) is under way: every plugin must register again."""
        if self._kubelet_down:
            return
        self._kubelet_down = True
        if self._kubelet_id is None:
            return  # never seen answering: nothing to restart from
        self.kubelet_restarts += 1
        self.metrics.kubelet_restarts.inc()
        logger.info("kubelet restart detected: %s", why)
        self.state.reset(self.state.checks)
        for p in self.settings.plugins:
            self._open_attempt(p.resource, "kubelet restart")

    def _plugin_socket_created(self, plugin: PluginSpec, identity: SocketId | None = None) -> None:
        """A new plugin socket: a new registration cycle, whichever saw it first, event or probe."""
        identity = identity or _known(socket_identity(self.settings.plugin_path(plugin)))
        if identity is not None and identity == self._plugin_ids.get(plugin.resource):
            return  # already accounted for: the event trails a probe that saw this socket first
        self._plugin_ids[plugin.resource] = identity
        self._judging.discard(plugin.resource)
        self._vanished.pop(plugin.resource, None)
        self.state.reset(self._plugin_checks(plugin))
        self._open_attempt(plugin.resource, "new plugin socket")

    def _open_attempt(self, resource: str, cause: str) -> None:
        if self._attempts[resource] is not None:
            return  # an open cycle absorbs what follows: restart + new socket is one attempt
        attempt = Attempt(resource, cause, self.wall(), self.clock())
        self._attempts[resource] = attempt
        self.history.append(attempt)
        self.metrics.attempts.labels(self.settings.plugin_label, resource).inc()

    def _close_attempt(self, resource: str, registered: bool) -> None:
        attempt = self._attempts[resource]
        if attempt is None:
            return
        self._attempts[resource] = None
        label = (self.settings.plugin_label, resource)
        if registered:
            attempt.outcome = "registered"
            attempt.latency = max(0.0, self.clock() - attempt.opened)
            self.metrics.successes.labels(*label).inc()
            self.metrics.listandwatch_latency.labels(*label).observe(attempt.latency)
        else:
            attempt.outcome = "not registered within the grace"

    def _start_vanish_judge(self, plugin: PluginSpec) -> None:
        self._judging.add(plugin.resource)
        self._spawn(self._judge_vanished(plugin), f"vanish:{plugin.resource}")

    async def _judge_vanished(self, plugin: PluginSpec) -> None:
        """A plugin socket vanished: a kubelet restart (pending) or a plugin crash (failed)?

        kubelet.sock tells (SPEC.md): a crash leaves the same kubelet.sock answering; a restart
        leaves it gone, dead, or a new file.
        """
        await asyncio.sleep(self.settings.vanish_settle)  # let kubelet.sock's own events land first
        if plugin.resource not in self._judging:
            return  # the socket is back already
        self._judging.discard(plugin.resource)
        path = self.settings.plugin_path(plugin)
        if socket_identity(path) is not None:
            return
        restart = self._restart_removed(plugin)
        if restart:
            self._kubelet_gone(f"{plugin.socket} was removed and {restart}")
            # The restart removed the socket: the plugin's checks wait for it again, even where a probe
            # saw the plugin answer between the restart's first sign and this removal.
            self.state.reset(self._plugin_checks(plugin))
            verdict = f"{path} was removed by a kubelet restart; waiting for the plugin"
        else:
            verdict = f"{path} was removed while the kubelet kept running: the plugin stopped serving"
        # A crash is not a registration still under way: it fails at once, grace or not.
        self._vanished[plugin.resource] = (verdict, not restart)
        self.state.report(plugin_check(plugin.resource), False, verdict, definitive=not restart)
        self._schedule_refresh()

    def _restart_removed(self, plugin: PluginSpec) -> str:
        """Why a kubelet restart explains the plugin socket's removal, or "" (the plugin crashed).

        A new kubelet deletes the sockets before it listens: while it does, kubelet.sock is gone or
        a dead file. A plugin socket created after the kubelet.sock that answers now was not
        removed by that kubelet's cleanup, whatever else is under way.
        """
        name, path = self.settings.kubelet_socket, self.settings.kubelet_path
        kid = socket_identity(path)
        if not isinstance(kid, SocketId):
            return f"{name} is gone"
        if socket_refuses(path):
            return f"{name} refuses connections"
        known = self._plugin_ids.get(plugin.resource)
        if known is not None and known.mtime_ns >= kid.mtime_ns:
            return ""
        if self._kubelet_down:
            return "a kubelet restart is under way"
        if self._kubelet_id is not None and kid != self._kubelet_id:
            return f"{name} is a new file"
        return ""

    def _plugin_checks(self, plugin: PluginSpec) -> list[str]:
        """The plugin's checks that exist (devices: only with --expect-devices)."""
        r = plugin.resource
        return [n for n in (plugin_check(r), registered_check(r), devices_check(r)) if n in self.state.checks]

    # -- probing ------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        assert self._trigger is not None
        while True:
            self._trigger.clear()
            try:
                await self.probe_round()
            except Exception:
                logger.exception("probe round failed")
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that arrives as the
            # event is set, and the loop would outlive stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.probe_interval):
                    await self._trigger.wait()
            # A storm of events (a plugin flapping a device's health rewrites the checkpoint each
            # time) coalesces into at most one round per MIN_ROUND_GAP instead of a busy core.
            await asyncio.sleep(MIN_ROUND_GAP)

    async def probe_round(self) -> None:
        s = self.settings
        if self._folder_id is not None and self._folder_replaced():
            self._await_folder()
        kubelet, *plugins = await asyncio.gather(
            probe_kubelet(s.kubelet_path, s.probe_timeout),
            *(probe_plugin(s.plugin_path(p), s.probe_timeout) for p in s.plugins),
        )
        self._observe_probe("kubelet", kubelet)
        self._judge_kubelet(kubelet)
        assert self._reader is not None
        checkpoint = await read_checkpoint_async(
            os.path.join(s.device_plugin_dir, CHECKPOINT_NAME), self._reader
        )
        pod_resources = await allocatable_devices(s.pod_resources_socket, s.probe_timeout)
        host_devices = len(glob.glob(s.device_glob)) if s.expect_devices == -1 else None
        for plugin, result in zip(s.plugins, plugins, strict=True):
            self._observe_probe(plugin.socket, result)
            self._judge_plugin(plugin, result)
            evidence = registration_evidence(checkpoint, plugin.resource, kubelet.identity, result.identity)
            self._judge_registration(plugin, evidence)
            self._count_devices(plugin, evidence, pod_resources, host_devices)
        self.rounds += 1
        self._schedule_refresh()

    def _observe_probe(self, socket: str, result: ProbeResult) -> None:
        if result.latency:
            self.metrics.probe_duration.labels(socket).observe(result.latency)

    def _judge_kubelet(self, k: ProbeResult) -> None:
        if k.ok:
            if self._kubelet_recreated or (self._kubelet_id is not None and k.identity != self._kubelet_id):
                self._kubelet_gone(f"a new {self.settings.kubelet_socket} answers")
            self._kubelet_down = False
            self._kubelet_recreated = False
            self._kubelet_id = k.identity
        elif k.state in ("absent", "refused"):
            self._kubelet_gone(k.reason)
        self.state.report(KUBELET_CHECK, k.ok, k.reason, k.latency, definitive=k.definitive)

    def _judge_plugin(self, plugin: PluginSpec, result: ProbeResult) -> None:
        name = plugin_check(plugin.resource)
        if plugin.resource in self._judging:
            return  # the vanished socket's verdict is being reached
        if result.ok and socket_identity(self.settings.plugin_path(plugin)) != result.identity:
            return  # removed or replaced while probed: its events decide
        if result.state == "absent":
            if self.state.checks[name].status is Status.OK:
                # Gone since the last round, and its deletion event is not here yet: same verdict path.
                self._start_vanish_judge(plugin)
                return
            if plugin.resource in self._vanished:
                verdict, crashed = self._vanished[plugin.resource]  # keep the verdict and its why
                self.state.report(name, False, verdict, definitive=crashed)
                return
        if result.ok and result.identity != self._plugin_ids.get(plugin.resource):
            if plugin.resource in self._plugin_ids:
                self._plugin_socket_created(plugin, result.identity)  # seen before its event
            else:
                self._plugin_ids[plugin.resource] = result.identity  # at start: the start's grace holds
        self.state.report(name, result.ok, result.reason, result.latency, definitive=result.definitive)

    def _judge_registration(self, plugin: PluginSpec, evidence: Evidence) -> None:
        name = registered_check(plugin.resource)
        if self._kubelet_down:
            self.state.report(name, False, "the kubelet is restarting; the plugin must register again")
            return
        self.state.report(name, evidence.ok, evidence.reason)
        if evidence.ok:
            self._close_attempt(plugin.resource, registered=True)

    def _count_devices(
        self, plugin: PluginSpec, evidence: Evidence, pod_resources: dict[str, int] | str, host: int | None
    ) -> None:
        counts = self.devices[plugin.resource]
        if evidence.devices is not None:
            counts["checkpoint"] = evidence.devices
        if isinstance(pod_resources, dict):
            counts["pod_resources"] = pod_resources.get(plugin.resource, 0)
        if host is not None:
            counts["host"] = host
        for source, n in counts.items():
            self.metrics.devices.labels(plugin.resource, source).set(n)
        expect = self.settings.expect_devices
        if expect is None:
            return
        want = host if expect == -1 else expect
        have = counts.get("pod_resources", counts.get("checkpoint", 0))
        source = "pod-resources" if "pod_resources" in counts else "checkpoint"
        if want is None or have >= want:
            self.state.report(devices_check(plugin.resource), True, f"the kubelet lists {have} (want {want})")
        else:
            where = f" ({self.settings.device_glob} on the host)" if expect == -1 else ""
            self.state.report(
                devices_check(plugin.resource),
                False,
                f"the kubelet lists {have} device(s) by {source}, {want} expected{where}",
            )

    # -- state changes -----------------------------------------------------------------
    def _schedule_refresh(self) -> None:
        """Fail pending checks when their grace runs out, without waiting for a probe."""
        deadline = self.state.refresh()
        if self._refresh_handle is not None:
            self._refresh_handle.cancel()
            self._refresh_handle = None
        if deadline is not None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                delay = max(0.0, deadline - self.clock()) + 0.001
                self._refresh_handle = loop.call_later(delay, self._schedule_refresh)

    def _on_transition(self, check: Check, old: Status) -> None:
        self.metrics.check_up.labels(check.name).set(check.status.up)
        log = logger.warning if check.status is Status.FAILED else logger.info
        log(
            "check %s: %s -> %s: %s",
            check.name,
            old.value,
            check.status.value,
            check.reason,
            extra={"check": check.name, "status": check.status.value, "previous": old.value},
        )
        if check.status is Status.FAILED and check.name.startswith("registered:"):
            self._close_attempt(check.name.removeprefix("registered:"), registered=False)

    # -- views ------------------------------------------------------------------------------
    def status_document(self) -> dict[str, Any]:
        s = self.settings
        return {
            "version": __version__,
            "uptime_seconds": round(self.clock() - self.started, 3),
            "ready": self.ready,
            "healthy": self.state.healthy(),
            "watch_mode": self.watch_mode,
            "checks": {
                c.name: {
                    "state": c.status.value,
                    "since": _iso(c.since),
                    "reason": c.reason,
                    "last_probe_latency_seconds": c.latency,
                    **(
                        {"grace_left_seconds": round(self.state.grace_left(c), 3)}
                        if c.status is Status.PENDING
                        else {}
                    ),
                }
                for c in self.state.checks.values()
            },
            "sockets": {
                s.kubelet_socket: _socket_info(s.kubelet_path),
                **{p.socket: {"resource": p.resource, **_socket_info(s.plugin_path(p))} for p in s.plugins},
                "pod-resources": _socket_info(s.pod_resources_socket),
            },
            "kubelet_restarts": self.kubelet_restarts,
            "probe_rounds": self.rounds,
            "runtime": _runtime(),
            "registration_history": [a.as_dict() for a in self.history],
            "devices": self.devices,
            "settings": {
                "device_plugin_dir": s.device_plugin_dir,
                "probe_interval": s.probe_interval,
                "probe_timeout": s.probe_timeout,
                "registration_grace": s.registration_grace,
                "plugins": {p.resource: p.socket for p in s.plugins},
            },
        }


def _known(identity: SocketId | str | None) -> SocketId | None:
    return identity if isinstance(identity, SocketId) else None


def _runtime() -> dict[str, Any]:
    """What a leak would show: tasks by coroutine, threads by name."""
    tasks: dict[str, int] = {}
    for t in asyncio.all_tasks():
        name = getattr(t.get_coro(), "__qualname__", "?")
        tasks[name] = tasks.get(name, 0) + 1
    return {
        "tasks": sum(tasks.values()),
        "task_kinds": dict(sorted(tasks.items())),
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def _socket_info(path: str) -> dict[str, Any]:
    try:
        st = os.lstat(path)
    except OSError:
        return {"path": path, "exists": False}
    return {
        "path": path,
        "exists": True,
        "is_socket": stat.S_ISSOCK(st.st_mode),
        "mode": f"{stat.S_IMODE(st.st_mode):04o}",
        "owner": f"{st.st_uid}:{st.st_gid}",
        "created": _iso(st.st_mtime),
    }


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
