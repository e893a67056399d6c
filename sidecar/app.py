"""The sidecar's wiring: folder events and probe rounds in, the judges' verdicts out, one asyncio loop.

Data flows one way: watcher events and probe results -> DevicePluginJudge (sidecar.deviceplugin.verdicts)
-> HTTP views and metrics. Everything here is I/O and timing; every decision is made in
sidecar.deviceplugin.verdicts.
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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from hami_guard.node.unixdiag import (
    KUBELET_BOUND_PATH,
    KUBELET_PROCESS_NAMES,
    DiagUnavailable,
    SocketOwner,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    socket_owner,
)
from sidecar import __version__
from sidecar.config import PluginSpec, Settings
from sidecar.deviceplugin import hamiconfig
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
from sidecar.deviceplugin.probes import (
    ProbeResult,
    Reading,
    SocketId,
    pod_resources_devices,
    probe_kubelet,
    probe_plugin,
    read_checkpoint_async,
    socket_identity,
    socket_refuses,
)
from sidecar.deviceplugin.verdicts import (
    AfterDeletion,
    DevicePluginJudge,
    PluginEvidence,
    RoundEvidence,
    Rules,
    iso,
)
from sidecar.dra.verdicts import RESTART_BUDGET as DRA_RESTART_BUDGET
from sidecar.dra.watch import DraWatch
from sidecar.health import Check, CheckKey, Kind, Status
from sidecar.server.metrics import Metrics
from sidecar.tasks import TaskSet
from sidecar.watcher import FolderWatcher, FsEvent

logger = logging.getLogger(__name__)
T = TypeVar("T")

FOLDER_RETRY_SECONDS = 0.25
MIN_ROUND_GAP = 0.01
DEVICE_SOURCES = ("pod_resources", "checkpoint", "host")


class MetricsPublisher:
    """The judge's listener: metrics, and one log line per transition."""

    def __init__(self, metrics: Metrics, label: str) -> None:
        self.m = metrics
        self.label = label

    def attempt_opened(self, resource: str) -> None:
        self.m.attempts.labels(self.label, resource).inc()

    def attempt_closed(self, resource: str, latency: float | None) -> None:
        if latency is not None:
            self.m.successes.labels(self.label, resource).inc()
            self.m.listandwatch_latency.labels(self.label, resource).observe(latency)

    def kubelet_restarted(self) -> None:
        self.m.kubelet_restarts.inc()

    def restart_requested(self, resource: str) -> None:
        self.m.restart_requests.labels(self.label, resource).inc()

    def budget(self, resource: str, spent: bool) -> None:
        self.m.budget_spent.labels(self.label, resource).set(1 if spent else 0)

    def devices(self, resource: str, counts: Mapping[str, int]) -> None:
        for source in DEVICE_SOURCES:
            if source in counts:
                self.m.devices.labels(self.label, resource, source).set(counts[source])
            else:  # a count that is not current (a stale checkpoint) is no count
                with contextlib.suppress(KeyError):
                    self.m.devices.remove(self.label, resource, source)

    def connected(self, resource: str, count: int | None) -> None:
        gauge = self.m.kubelet_connected
        if count is None:
            with contextlib.suppress(KeyError):
                gauge.remove(self.label, resource)
        else:
            gauge.labels(self.label, resource).set(1 if count else 0)

    def check(self, check: Check) -> None:
        labels = (check.key.kind.value, check.key.resource, self.label)
        self.m.check_up.labels(*labels).set(check.status.up)
        self.m.check_restarts.labels(*labels).set(1 if check.live_failed else 0)

    def transition(self, check: Check, old: Status) -> None:
        self.check(check)
        log = logger.warning if check.status is Status.FAILED else logger.info
        effect = ""
        if check.status is Status.FAILED:
            effect = " (fails liveness)" if check.restarts else " (no restart: readiness only)"
        log(
            "check %s: %s -> %s%s: %s",
            check.name,
            old.value,
            check.status.value,
            effect,
            check.reason,
            extra={"check": check.name, "status": check.status.value, "previous": old.value},
        )


class Sidecar:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        s = self.settings = settings
        self.clock = clock
        self.metrics = Metrics()
        rules = Rules(
            plugins=s.plugins,
            grace=s.registration_grace,
            kubelet_socket=s.kubelet_socket,
            expect_devices=s.expect_devices,
            device_glob=s.device_glob,
            drop_confirm=s.drop_confirm,
        )
        publish = MetricsPublisher(self.metrics, s.plugin_label)
        self.judge = DevicePluginJudge(rules, publish, clock, wall)
        self.state = self.judge.state
        for p in s.plugins:
            # Every series exists from start: a series first seen at 1 hides that increase from increase().
            self.metrics.attempts.labels(s.plugin_label, p.resource)
            self.metrics.successes.labels(s.plugin_label, p.resource)
            self.metrics.listandwatch_latency.labels(s.plugin_label, p.resource)
            self.metrics.restart_requests.labels(s.plugin_label, p.resource)
            self.metrics.budget_spent.labels(s.plugin_label, p.resource).set(0)
        self._publish = publish
        # DRA drivers (sidecar.dra.verdicts): their checks are judged there, with their own grace.
        self.dra: DraWatch | None = None
        if s.dra_drivers:
            names = {*KUBELET_PROCESS_NAMES, s.kubelet_process_name}
            self.dra = DraWatch(
                s.dra_drivers,
                s.kubelet_path,
                grace=s.dra_grace,
                timeout=s.probe_timeout,
                clock=clock,
                names=names,
                api=s.dra_api,
                node=s.node_name,
            )
            for spec in s.dra_drivers:
                for kind in (Kind.DRA_PLUGIN, Kind.DRA_REGISTERED):
                    key = CheckKey(kind, spec.name)
                    self.state.add(key)
                    self.state.checks[key.name].judged_elsewhere = True
                self.metrics.restart_requests.labels(s.plugin_label, spec.name)
                self.metrics.budget_spent.labels(s.plugin_label, spec.name).set(0)
        for check in self.state.checks.values():
            publish.check(check)
        self.started = clock()
        self.rounds = 0
        self._connections_source = ""
        self._trigger: asyncio.Event | None = None
        self._tasks = TaskSet("hami-sidecar:")
        self._refresh_handle: asyncio.TimerHandle | None = None
        self._watcher: FolderWatcher | None = None
        self._folder_id: tuple[int, int] | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._folder_waiting = False
        self._expectation: hamiconfig.Expectation | None = None
        self._others: tuple[tuple[str, SocketId], ...] = ()

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
        self._tasks.spawn(self._probe_loop(), "probe-loop")
        self._schedule_refresh()

    async def stop(self) -> None:
        if self._refresh_handle is not None:
            self._refresh_handle.cancel()
        if self._watcher is not None:
            self._watcher.stop()
        await self._tasks.cancel()
        if self.dra is not None:
            self.dra.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)

    @property
    def watch_mode(self) -> str:
        return self._watcher.active_mode if self._watcher else "none"

    def trigger(self) -> None:
        if self._trigger is not None:
            self._trigger.set()

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
            self._tasks.spawn(self._wait_for_folder(), "folder-wait")

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
        plugin = self.judge.plugin(event.name)
        if event.kind == "folder-gone":
            self.judge.folder_gone()
            self._await_folder()
        elif event.name == s.kubelet_socket:
            self.judge.kubelet_socket_event(event.kind, socket_identity(s.kubelet_path))
        elif plugin is not None:
            if event.kind == "deleted":
                self._judge_vanished(plugin)
            elif event.kind == "created":
                identity = socket_identity(os.path.join(s.device_plugin_dir, plugin.socket))
                self.judge.plugin_socket_created(plugin.resource, identity)
        elif event.name != CHECKPOINT_NAME:
            return
        self.trigger()

    def _judge_vanished(self, plugin: PluginSpec) -> None:
        self.judge.plugin_socket_deleted(plugin.resource)
        self._tasks.spawn(self._observe_vanished(plugin), f"vanish:{plugin.resource}")

    async def _observe_vanished(self, plugin: PluginSpec) -> None:
        """Look at the folder a moment after a plugin socket was deleted; the judge judges.

        First once kubelet.sock's own events have landed; where no kubelet restart explains the
        removal, again when the restart window is over (a plugin re-creating its socket).
        """
        s = self.settings
        try:
            await asyncio.sleep(s.vanish_settle)
            for window_over in (False, True):
                seen = AfterDeletion(
                    plugin=socket_identity(os.path.join(s.device_plugin_dir, plugin.socket)),
                    kubelet=socket_identity(s.kubelet_path),
                    kubelet_refuses=socket_refuses(s.kubelet_path),
                )
                if not self.judge.judge_vanished(plugin.resource, seen, window_over):
                    break
                await asyncio.sleep(max(0.0, s.plugin_restart_window - s.vanish_settle))
        finally:
            # Never left waiting for a verdict that will not come: the next round judges the socket.
            self.judge.end_judgement(plugin.resource)
            self._schedule_refresh()
            self.trigger()

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
        generation = self.judge.generation
        # The kubelet's connections before the probes: a probe's own connection lingers a few ms.
        # Only the sockets bound to the files that matter are kept (a host namespace holds thousands).
        files = [s.kubelet_path, *(s.plugin_path(p) for p in s.plugins)]
        bound = {os.path.join(os.path.dirname(KUBELET_BOUND_PATH), p.socket) for p in s.plugins}
        listed = {i for f in files if (i := _file_id(f))}
        try:
            mine: list[UnixSocket] | str = diag_dump(listed)
        except DiagUnavailable as e:
            mine = str(e)
        names = {*KUBELET_PROCESS_NAMES, s.kubelet_process_name}
        paths = {*files, *bound}
        connections = kubelet_connections(s.kubelet_path, names=names, mine=mine, paths=paths)
        kubelet, *plugins = await asyncio.gather(
            probe_kubelet(s.kubelet_path, s.probe_timeout),
            *(probe_plugin(s.plugin_path(p), s.probe_timeout) for p in s.plugins),
        )
        self._observe_probe("kubelet", kubelet)
        # pod-resources before the checkpoint: the kubelet changes its live view before it rewrites
        # the file, so the other order can see devices recorded healthy that it no longer lists.
        pod_resources = await pod_resources_devices(s.pod_resources_socket, s.probe_timeout)
        assert self._reader is not None
        try:
            async with asyncio.timeout(s.probe_timeout):
                checkpoint = await read_checkpoint_async(
                    os.path.join(s.device_plugin_dir, CHECKPOINT_NAME), self._reader
                )
        except TimeoutError:
            checkpoint = Reading.failed(f"the checkpoint could not be read within {s.probe_timeout:g}s")
        host_devices = len(glob.glob(s.device_glob)) if s.expect_devices == -1 else None
        expectation = (
            await self._off_loop(self._expected, self._expectation) if s.expect_devices == -1 else None
        )
        self._expectation = expectation
        # Other sockets served in the folder, only while a plugin's own is missing (under another name?).
        others: tuple[tuple[str, SocketId], ...] = ()
        if any(r.state == "absent" for r in plugins):
            taken = {s.kubelet_socket, *(p.socket for p in s.plugins)}
            # A read cut short keeps the last answer: an empty one would make the next look like a restart.
            read = partial(_served_elsewhere, s.device_plugin_dir, taken)
            others = self._others = await self._off_loop(read, self._others)
        observed = {}
        for plugin, result in zip(s.plugins, plugins, strict=True):
            self._observe_probe(plugin.socket, result)
            path = s.plugin_path(plugin)
            ids: frozenset[int] | None = None
            if isinstance(connections, str):
                held: Reading[int] = Reading.failed(connections)
            else:
                # Where the folder is mounted elsewhere, the plugin bound it at the kubelet's own path.
                found = connections.accepted(
                    path, (os.path.join(os.path.dirname(KUBELET_BOUND_PATH), plugin.socket),)
                )
                if isinstance(found, str):
                    held = Reading.failed(found)
                else:
                    ids, held = found, Reading(len(found))
            # A socket re-created since the table was read is not in it: no verdict on its owner.
            owner = (
                socket_owner(path, s.kubelet_path, mine, names=names)
                if result.ok and not isinstance(mine, str) and _file_id(path) in listed
                else SocketOwner("unknown", "")
            )
            observed[plugin.resource] = PluginEvidence(
                result, socket_identity(path), held, owner.verdict, owner.reason, ids
            )
        self._connections_source = connections if isinstance(connections, str) else connections.source
        seen = RoundEvidence(
            kubelet,
            observed,
            checkpoint,
            pod_resources,
            host_devices,
            generation,
            expectation=expectation,
            others=others,
        )
        for resource in self.judge.round(seen):
            self._tasks.spawn(self._observe_vanished(self.judge.plugin_for(resource)), f"vanish:{resource}")
        if self.dra is not None:
            await self._dra_round()
        self.rounds += 1
        self._schedule_refresh()

    async def _dra_round(self) -> None:
        """The DRA drivers' verdicts (sidecar.dra.verdicts), into the same checks and metrics."""
        assert self.dra is not None
        label = self.settings.plugin_label
        for name, (ev, j) in (await self.dra.round()).items():
            for kind, v in ((Kind.DRA_PLUGIN, j.plugin), (Kind.DRA_REGISTERED, j.registered)):
                key = CheckKey(kind, name).name
                was = self.state.checks[key].live_failed
                self.state.assign(key, v.status, v.reason, restarts=v.restarts)
                if v.live_failed and not was:
                    self.metrics.restart_requests.labels(label, name).inc()
            self._publish.connected(name, ev.connections)
            self._publish.budget(name, j.restarts_in_vain >= DRA_RESTART_BUDGET)

    def _expected(self) -> hamiconfig.Expectation:
        s = self.settings
        return hamiconfig.expectation(
            hamiconfig.Sources(s.device_glob, s.hami_config, s.node_name, s.nvidia_gpus_dir, s.vfio_dir)
        )

    async def _off_loop(self, read: Callable[[], T], fallback: T) -> T:
        """`read` (files, connects) on the reader's thread within the probe timeout, never on the loop."""
        assert self._reader is not None
        try:
            async with asyncio.timeout(self.settings.probe_timeout):
                return await asyncio.get_running_loop().run_in_executor(self._reader, read)
        except TimeoutError:
            return fallback

    def _observe_probe(self, socket: str, result: ProbeResult) -> None:
        if result.latency:
            self.metrics.probe_duration.labels(socket).observe(result.latency)

    # -- state changes -----------------------------------------------------------------
    def _schedule_refresh(self) -> None:
        """Fail pending checks when their grace runs out, and confirm a lost connection, unprobed."""
        deadline = self.judge.refresh()
        if self._refresh_handle is not None:
            self._refresh_handle.cancel()
            self._refresh_handle = None
        confirm = self.judge.wake_at()
        wake = min((t for t in (deadline, confirm) if t is not None), default=None)
        if wake is not None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                delay = max(0.0, wake - self.clock()) + 0.001
                self._refresh_handle = loop.call_later(delay, self._wake, wake == confirm)

    def _wake(self, probe: bool) -> None:
        if probe:
            self.trigger()
        self._schedule_refresh()

    # -- views ------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The first probe round has run: before it, nothing is known."""
        return self.rounds > 0

    def _expected_devices(self) -> dict[str, Any]:
        """What the devices check wants, and why (auto: which devices HAMi registers, which it filters)."""
        expect = self.settings.expect_devices
        if expect == 0:
            return {"check": "off (--expect-devices 0)"}
        if expect is None:
            return {"check": "at least one healthy device", "want": 1}
        if expect != hamiconfig.AUTO:
            return {"check": "--expect-devices", "want": expect}
        if self._expectation is None:
            return {"check": "--expect-devices auto", "want": None, "notes": ["not read yet"]}
        return {"check": "--expect-devices auto", **self._expectation.as_dict()}

    def status_document(self) -> dict[str, Any]:
        s = self.settings
        state = self.state
        return {
            "version": __version__,
            "uptime_seconds": round(self.clock() - self.started, 3),
            "live": state.healthy(),
            "ready": self.ready and state.all_ok(),
            "watch_mode": self.watch_mode,
            "checks": {
                c.name: {
                    "state": c.status.value,
                    "fails_liveness": c.live_failed,
                    "since": iso(c.since),
                    "reason": c.reason,
                    "last_probe_latency_seconds": c.latency,
                    **(
                        {"grace_left_seconds": round(state.grace_left(c), 3)}
                        if c.status is Status.PENDING and not c.judged_elsewhere
                        else {}
                    ),
                }
                for c in state.checks.values()
            },
            "sockets": {
                s.kubelet_socket: _socket_info(s.kubelet_path),
                **{p.socket: {"resource": p.resource, **_socket_info(s.plugin_path(p))} for p in s.plugins},
                "pod-resources": _socket_info(s.pod_resources_socket),
            },
            "kubelet_connections_from": self._connections_source,
            **({"dra": self._dra_document()} if self.dra is not None else {}),
            "kubelet_restarts": self.judge.kubelet_restarts,
            "probe_rounds": self.rounds,
            "runtime": _runtime(),
            "registration": self.judge.registration(),
            "registration_history": [a.as_dict() for a in self.judge.history],
            "devices": self.judge.devices(),
            "expected_devices": self._expected_devices(),
            "settings": {
                "device_plugin_dir": s.device_plugin_dir,
                "probe_interval": s.probe_interval,
                "probe_timeout": s.probe_timeout,
                "registration_grace": s.registration_grace,
                "plugins": {p.resource: p.socket for p in s.plugins},
            },
        }

    def _dra_document(self) -> dict[str, Any]:
        assert self.dra is not None
        drivers: dict[str, Any] = {}
        for spec in self.dra.specs:
            ev, j = self.dra.last.get(spec.name, (None, None))
            drivers[spec.name] = {
                "registration_socket": _socket_info(spec.registration),
                "service_socket": ev.service if ev else spec.service,
                "getinfo": None
                if ev is None
                else {"answer": ev.info.kind, "reason": ev.info.reason, "versions": list(ev.info.versions)},
                "kubelet_connections": None if ev is None else ev.connections,
                "service": None
                if ev is None
                else {
                    "silent_since_seconds": _since(self.clock(), ev.service_silent_since),
                    "reading": ev.service_reason,
                },
                "resourceslices": None
                if ev is None or (ev.slices is None and not ev.slices_why)
                else {"slices": ev.slices[0], "devices": ev.slices[1]}
                if ev.slices is not None
                else {"no_evidence": ev.slices_why},
                "restarts_in_vain": 0 if j is None else j.restarts_in_vain,
                "spell_seconds": None if j is None else round(self.clock() - j.spell_started, 3),
            }
        return {
            "grace": self.dra.judge.grace,
            "kubelet_connections_from": self.dra.connections_source,
            "drivers": drivers,
        }


def _since(now: float, since: float | None) -> float | None:
    return None if since is None else round(now - since, 3)


MAX_FOLDER_SOCKETS = 32  # other sockets tried in the folder per round


def _served_elsewhere(folder: str, mine: set[str]) -> tuple[tuple[str, SocketId], ...]:
    """Socket files in the folder, not the kubelet's or a configured plugin's, that accept a connection."""
    out = []
    try:
        with os.scandir(folder) as entries:
            names = sorted(e.name for e in entries if e.name not in mine and e.name.endswith(".sock"))
    except OSError:
        return ()
    for name in names[:MAX_FOLDER_SOCKETS]:
        path = os.path.join(folder, name)
        identity = socket_identity(path)
        if identity is not None and not socket_refuses(path):
            out.append((name, identity))
    return tuple(out)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


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
        "created": iso(st.st_mtime),
    }
