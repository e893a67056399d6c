"""The sidecar's wiring: folder events and probe rounds in, the judges' verdicts out, one asyncio loop.

Data flows one way: folder events and rounds (`sidecar.deviceplugin.watch`, `sidecar.dra.watch`)
-> the judges (`sidecar.deviceplugin.verdicts`, `sidecar.dra.verdicts`) -> the checks
(`sidecar.health`) -> HTTP views, /status and metrics (`sidecar.server`). Here are only the
lifecycle, the folder's watcher, the probe loop and the timing of refreshes; every reading is made in
the watches, every decision in the judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from hami_guard.node.unixdiag import KUBELET_PROCESS_NAMES
from sidecar.config import PluginSpec, Settings
from sidecar.deviceplugin import podlook
from sidecar.deviceplugin.candidates import CandidateWait, Where
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
from sidecar.deviceplugin.probes import socket_identity
from sidecar.deviceplugin.watch import DevicePluginWatch
from sidecar.dra.watch import DraWatch
from sidecar.hami import watch as hami
from sidecar.health import CheckKey, Kind, Status
from sidecar.rpc import GrpcRuntime
from sidecar.server.metrics import Metrics, MetricsPublisher
from sidecar.tasks import TaskSet
from sidecar.watcher import FolderWatcher, FsEvent

logger = logging.getLogger(__name__)

FOLDER_RETRY_SECONDS = 0.25
MIN_ROUND_GAP = 0.01


class Sidecar:
    """One node's watch: the device plugins' and DRA drivers' rounds, their checks and metrics."""

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self._wall = wall
        self._judging = False  # the watches below are built and started (else: the candidates' wait)
        self._made = False  # `device_plugins` exists (to be closed), started or not
        # Several candidate resources (--plugin-candidates): which one this node's plugin serves is learnt
        # first (sidecar.deviceplugin.candidates), and only then is the rest built, for that one. Until
        # then the views answer the wait's one check, its metrics and these settings.
        self.candidates: CandidateWait | None = None
        if settings.plugin_candidates:
            s = self.settings = settings
            self.metrics = Metrics()
            where = Where(s.device_plugin_dir, s.kubelet_socket, s.polling_interval, s.registration_grace)
            publish = MetricsPublisher(self.metrics, s.plugin_label, clock).check
            self.candidates = CandidateWait(where, s.plugin_candidates, publish, clock, wall)
            self.state = self.candidates.state
            self.dra: DraWatch | None = None
            self.hami: hami.HamiWatch | None = None
        else:
            self._build(settings)
            self._judging = True
        self.started = clock()
        self.rounds = 0
        self._hami_task: asyncio.Task[object] | None = None
        self._trigger: asyncio.Event | None = None
        self._tasks = TaskSet("hami-sidecar:")
        self._refresh_handle: asyncio.TimerHandle | None = None
        self._watcher: FolderWatcher | None = None
        self._folder_id: tuple[int, int] | None = None
        self._folder_waiting = False
        self._grpc = GrpcRuntime()

    def _build(self, settings: Settings) -> None:
        """The watches, judges and checks of `settings`, and their metrics."""
        s = self.settings = settings
        clock = self.clock
        self.metrics = Metrics()
        publish = MetricsPublisher(self.metrics, s.plugin_label, clock)
        self.device_plugins = DevicePluginWatch(s, publish, clock, self._wall)
        self._made = True
        self.judge = self.device_plugins.judge
        # Between rounds where the kubelet's connections cannot be read (a pod with neither the host's
        # network nor its pids): pod-resources alone, which only brings a round forward.
        self.pod_look = podlook.PodResourcesLook(
            s.pod_resources_socket, s.probe_timeout, s.connection_interval, self.trigger
        )
        self.state = self.judge.state
        # DRA drivers (sidecar.dra.verdicts): judged there, with their own grace, into the same checks.
        self.dra = None
        if s.dra_drivers:
            self.dra = DraWatch(
                s.dra_drivers,
                s.kubelet_path,
                grace=s.dra_grace,
                timeout=s.probe_timeout,
                clock=clock,
                names={*KUBELET_PROCESS_NAMES, s.kubelet_process_name},
                api=s.dra_api,
                node=s.node_name,
            )
            self.dra.attach(self.state, publish)
        # HAMi's own registration (sidecar.hami): judged beside the rounds, into the same checks.
        self.hami = hami.from_settings(s, clock)
        if self.hami is not None:
            self.hami.attach(self.state, publish)
        for check in self.state.checks.values():
            publish.check(check)

    @property
    def waiting(self) -> bool:
        """Not judging yet: still learning which of the candidates this node's plugin serves (or judging
        the one chosen could not start); nothing else runs."""
        return self.candidates is not None and not self._judging

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Watch the folder, and run the probe loop and the refreshes until `stop` (once this node's
        plugin is known, where there are candidates)."""
        loop = asyncio.get_running_loop()
        self._trigger = asyncio.Event()
        self._grpc.hold()
        if not self.waiting:
            self._start_device_plugins()
        self._watcher = FolderWatcher(
            self.settings.device_plugin_dir,
            self._on_fs_event,
            loop,
            mode=self.settings.watch_mode,
            polling_interval=self.settings.polling_interval,
        )
        if not self._arm_watcher():
            self._await_folder()
        if self.candidates is not None and self.waiting:
            self._tasks.spawn(self._learn_plugin(self.candidates), "plugin-candidates")
            return
        self._tasks.spawn(self._probe_loop(), "probe-loop")
        self._schedule_refresh()

    async def _learn_plugin(self, candidates: CandidateWait) -> None:
        """Wait for this node's plugin to serve one candidate, then judge it from the first round on."""
        chosen = await candidates.wait()
        waited = self.settings, self.metrics, self.state
        try:
            self._build(self.settings.resolved(chosen))
            self._start_device_plugins()
        except Exception as e:
            # The sidecar's own fault, which a restart of the plugin cannot mend: readiness fails with it
            # (the wait's check), never liveness. No exit either: the plugin's livenessProbe asks this
            # port, and a sidecar crash-looping would restart the plugin (docs/design.md#bad-config).
            logger.exception("judging %s could not start", chosen.resource)
            self.settings, self.metrics, self.state = waited
            candidates.broken(
                f"judging {chosen.resource} could not start: {e!r} (the sidecar's fault: its log)"
            )
            return
        self._judging = True
        self._tasks.spawn(self._probe_loop(), "probe-loop")
        self._schedule_refresh()

    def _start_device_plugins(self) -> None:
        self.device_plugins.start()
        if self.settings.connection_interval:
            self._tasks.spawn(self.pod_look.run(), "pod-resources-look")

    async def stop(self) -> None:
        """Stop watching and probing; every task and thread of the sidecar ends."""
        try:
            if self._refresh_handle is not None:
                self._refresh_handle.cancel()
            if self._watcher is not None:
                self._watcher.stop()
            await self._tasks.cancel()
            if self.hami is not None:
                await self.hami.close()
            if self.dra is not None:
                self.dra.close()
            if self._made:
                self.device_plugins.close()
        finally:
            self._grpc.release()

    @property
    def watch_mode(self) -> str:
        """How the folder is watched now: inotify, polling, or none (it is missing)."""
        return self._watcher.active_mode if self._watcher else "none"

    def trigger(self) -> None:
        """Run a probe round now (or as soon as the one running ends)."""
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
        if self.waiting:  # nothing is judged yet (the wait looks for itself): only the watch is kept
            if event.kind == "folder-gone":
                self._await_folder()
            return
        s = self.settings
        plugin = self.judge.plugin(event.name)
        if event.kind == "folder-gone":
            self.judge.folder_gone()
            self._await_folder()
        elif event.name == s.kubelet_socket:
            self.judge.kubelet_socket_event(event.kind, socket_identity(s.kubelet_path))
        elif plugin is not None:
            if event.kind == "deleted":
                if self.judge.plugin_socket_deleted(plugin.resource):
                    self._follow_vanished(plugin)
            elif event.kind == "created":
                identity = socket_identity(s.plugin_path(plugin))
                self.device_plugins.socket_created(plugin)
                self.judge.plugin_socket_created(plugin.resource, identity)
        elif event.name != CHECKPOINT_NAME:
            return
        self.trigger()

    def _follow_vanished(self, plugin: PluginSpec) -> None:
        self._tasks.spawn(self._observe_vanished(plugin), f"vanish:{plugin.resource}")

    async def _observe_vanished(self, plugin: PluginSpec) -> None:
        try:
            await self.device_plugins.observe_vanished(plugin)
        finally:
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

    def _watch_connections(self) -> None:
        """The kubelet's connections to the plugins it holds, looked at between rounds on the socket
        table's thread (the table alone, no gRPC call): a drop is judged within a second of happening,
        not at the next probe interval. Where the round could not read them, pod-resources' devices of
        those plugins, on the loop (`sidecar.deviceplugin.podlook`). Set from each round's reading."""
        s = self.settings
        if not s.connection_interval:
            return
        held = {
            p.resource
            for p in s.plugins
            if self.state.checks[CheckKey(Kind.REGISTERED, p.resource).name].status is Status.OK
        }
        loop = asyncio.get_running_loop()

        def wake() -> None:  # on the table's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the sidecar stops
                loop.call_soon_threadsafe(self.trigger)

        self.device_plugins.watch_connections(held, wake)
        unread = not self.device_plugins.connections_read
        self.pod_look.watch(podlook.listed(held, self.device_plugins.pod_resources) if unread else None)

    async def probe_round(self) -> None:
        """One round: the device plugins', then the DRA drivers' (their verdicts into the same checks)."""
        if self._folder_id is not None and self._folder_replaced():
            self._await_folder()
        if self.hami is not None:  # the kubelet's release as its Node reports it, where its binary is shut
            self.device_plugins.node_kubelet_version = self.hami.kubelet_version()
        for plugin in await self.device_plugins.round():
            self._follow_vanished(plugin)
        self._watch_connections()
        if self.dra is not None:
            await self.dra.round()
        self._read_hami()
        self.rounds += 1
        self._schedule_refresh()

    def _read_hami(self) -> None:
        """HAMi's registration, when due, in a task of its own: the API server never delays a round."""
        h = self.hami
        if h is None or not h.due() or (self._hami_task is not None and not self._hami_task.done()):
            return
        checks = hami.plugin_checks(self.state, [k.resource for k in h.keys])
        # The round's own pod-resources reading: one call, not two.
        read = h.round(checks, kubelet=self.device_plugins.pod_resources)
        self._hami_task = self._tasks.spawn(read, "hami")

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
        """The first probe round has run (or, while the candidates are waited for, their first look):
        before it, nothing is known. Once one is chosen, the first round of it."""
        return self.rounds > 0 or (self.candidates is not None and self.waiting and self.candidates.looks > 0)
