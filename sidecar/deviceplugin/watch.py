"""The device plugins' round: their evidence, read from the node, then `sidecar.deviceplugin.verdicts`.

Each round reads, in this order: the kubelet's connections to the plugin sockets (the kernel's
socket table, `hami_guard.node.unixdiag`), the live probes (`sidecar.deviceplugin.probes`),
pod-resources, the kubelet's checkpoint, HAMi's expectation for `--expect-devices auto`
(`sidecar.deviceplugin.hamiconfig`) and, while a plugin's socket is missing, the other sockets
served in the folder; the `RoundEvidence` of them goes to the `DevicePluginJudge`. A plugin socket
deleted is looked at again a moment later (`DevicePluginWatch.observe_vanished`). The DRA drivers'
round (`sidecar.dra.watch`) mirrors this one.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

from hami_guard.flags import Expect
from hami_guard.node import release
from hami_guard.node.unixdiag import (
    DIAG_DEADLINE,
    KUBELET_BOUND_PATH,
    KUBELET_PROCESS_NAMES,
    Connections,
    DiagUnavailable,
    SocketOwner,
    UnixSocket,
    diag_dump,
    kubelet_connections,
    kubelet_processes,
    socket_owner,
)
from sidecar.config import PluginSpec, Settings
from sidecar.deviceplugin import hamiconfig, hostdevices
from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME, Checkpoint
from sidecar.deviceplugin.evidence import (
    AfterDeletion,
    KubeletRules,
    Listener,
    PluginEvidence,
    RoundEvidence,
    Rules,
    kubelet_rules,
)
from sidecar.deviceplugin.listeners import PluginListener, file_id, listener_of, still_listening
from sidecar.deviceplugin.probes import (
    ProbeResult,
    Reading,
    SocketId,
    pod_resources_devices,
    pod_resources_held,
    probe_kubelet,
    probe_plugin,
    read_checkpoint_async,
    socket_identity,
    socket_refuses,
)
from sidecar.deviceplugin.recovery import NOT_READ, RecoveryEvidence
from sidecar.deviceplugin.table import Look, TableThread, gone_by_diag, gone_from
from sidecar.deviceplugin.verdicts import DevicePluginJudge

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Where the kubelet binds its plugins' sockets: a plugin whose folder is mounted elsewhere bound there.
BOUND_DIR = os.path.dirname(KUBELET_BOUND_PATH)
MAX_FOLDER_SOCKETS = 32  # other sockets tried in the folder per round
RELEASE_RETRY = 60.0  # seconds between reads of an unknown kubelet release


class Publisher(Listener, Protocol):
    """What the sidecar publishes of the plugins' verdicts (`sidecar.server.metrics.MetricsPublisher`)."""

    def series(self, resource: str, *, registrations: bool = True, recovery: bool = False) -> None:
        """Every series of a plugin's resource, from the start."""

    def probed(self, socket: str, latency: float) -> None:
        """A live probe of `socket` took `latency` seconds."""


@dataclass(frozen=True)
class _SocketTable:
    """The kernel's sockets bound to the files that matter, and the kubelet's connections among them."""

    mine: list[UnixSocket] | str  # this namespace's, or why they cannot be read
    listed: set[tuple[int, int]]  # the files (st_dev, st_ino) whose sockets were read
    connections: Connections | str  # the kubelet's, or why they cannot be seen
    ignored: tuple[str, ...] = ()  # processes named as the kubelet that are not it, and why


class DevicePluginWatch:
    """Each round: every plugin's evidence, then the judge's verdicts."""

    def __init__(
        self,
        settings: Settings,
        publish: Publisher,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        s = self.settings = settings
        rules = Rules(
            plugins=s.plugins,
            grace=s.registration_grace,
            kubelet_socket=s.kubelet_socket,
            expect_devices=s.expect_devices,
            device_glob=s.device_glob,
            drop_confirm=s.drop_confirm,
            refusal_confirm=s.refusal_confirm,
            missed_restart_after=s.missed_restart_after,
            recover_unhealthy_after=s.recover_unhealthy_after,
        )
        self.publish = publish
        self.judge = DevicePluginJudge(rules, publish, clock, wall)
        self.names = {*KUBELET_PROCESS_NAMES, s.kubelet_process_name}
        self.connections_source = ""  # where the last round read the kubelet's connections
        self.connections_read = False  # whether it could (else pod-resources is looked at between rounds)
        self.kubelets_ignored: tuple[str, ...] = ()  # processes named as the kubelet that are not it
        self.table_read_seconds = 0.0  # how long the last read of the socket table took
        self._table = TableThread(every=s.connection_interval)
        self.expectation: hamiconfig.Expectation | None = None  # auto's, as last read
        self._others: tuple[tuple[str, SocketId], ...] = ()
        self._reader: ThreadPoolExecutor | None = None
        self._rules: KubeletRules | None = None  # the kubelet's release rules, as its binary last said
        # The kubelet's version as this node's Node reports it (sidecar.hami reads the Node), "": unknown.
        self.node_kubelet_version = ""
        self.pod_resources: Reading[dict[str, frozenset[str]]] | None = None  # the last round's
        # Each plugin's kubelet connections as the last round read them (None: not known), and one read
        # of the table at a time: between rounds it is read again to see a drop within a second.
        self.last_ids: dict[str, frozenset[int] | None] = {}
        self._tables: tuple[str, ...] = ()  # the kubelet's /proc/<pid>/net/unix the last round read
        # Each plugin's connections that table showed at its path, the kubelet's or not (`listed`).
        self._listed: dict[str, frozenset[int]] = {}
        self._rules_read: tuple[int, float] = (-1, 0.0)  # (judge generation, monotonic) of that read
        self._clock = clock
        # Each plugin socket's listener as the last round saw it: its bound file (st_dev, st_ino), which
        # it outlives, and its own socket inode (None: not found in this namespace).
        self._listeners: dict[str, PluginListener] = {}
        for p in s.plugins:
            publish.series(p.resource, recovery=s.recover_unhealthy_after > 0)

    def start(self) -> None:
        """The thread that reads files (the checkpoint, HAMi's configuration, the folder) off the loop."""
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-sidecar-checkpoint")
        self._table.start()

    def close(self) -> None:
        """Stop the reading threads, dropping the reads not begun (a socket table's read under way is not
        waited for past a moment)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        self._table.close()

    async def round(self) -> list[PluginSpec]:
        """Read every plugin's evidence and judge it; the plugins whose socket the judge saw vanish, for
        the caller to follow up with `observe_vanished`."""
        s = self.settings
        generation = self.judge.generation
        rules = await self._kubelet_rules(generation)
        # The checkpoint's time before the connections: any record of a connection the next round sees
        # first is newer than it (docs/design.md#registration, rule 1.1).
        checkpoint_before = _mtime_ns(os.path.join(s.device_plugin_dir, CHECKPOINT_NAME))
        # The kubelet's connections before the probes: a probe's own connection lingers a few ms.
        table = await self._socket_table()
        kubelet, *plugins = await asyncio.gather(
            probe_kubelet(s.kubelet_path, s.probe_timeout),
            *(probe_plugin(s.plugin_path(p), s.probe_timeout) for p in s.plugins),
        )
        self.publish.probed("kubelet", kubelet.latency)
        # pod-resources before the checkpoint: the kubelet changes its live view before it rewrites
        # the file, so the other order can see devices recorded healthy that it no longer lists.
        pod_resources = await pod_resources_devices(s.pod_resources_socket, s.probe_timeout)
        self.pod_resources = pod_resources
        checkpoint = await self._checkpoint()
        auto = s.expect_devices.kind is Expect.AUTO
        host_devices = len(glob.glob(s.device_glob)) if auto else None
        self.expectation = await self._off_loop(self._expected, self.expectation) if auto else None
        others = await self._served_elsewhere(plugins)
        recovery = await self._recovery_evidence() if s.recover_unhealthy_after else NOT_READ
        observed = {}
        for plugin, result in zip(s.plugins, plugins, strict=True):
            self.publish.probed(plugin.socket, result.latency)
            observed[plugin.resource] = self._evidence(plugin, result, table)
            self.last_ids[plugin.resource] = observed[plugin.resource].connection_ids
        await self._find_listeners()
        connections = table.connections
        self.connections_source = connections if isinstance(connections, str) else connections.source
        self.connections_read = not isinstance(connections, str)
        self._tables = () if isinstance(connections, str) else connections.tables
        self._listed = {
            p.resource: connections.listed(s.plugin_path(p), _bound_as(p))
            for p in s.plugins
            if not isinstance(connections, str)
        }
        seen = RoundEvidence(
            kubelet,
            observed,
            checkpoint,
            pod_resources,
            host_devices,
            generation,
            expectation=self.expectation,
            others=others,
            checkpoint_before=checkpoint_before,
            kubelet_rules=rules,
            recovery=recovery,
        )
        return [self.judge.plugin_for(resource) for resource in self.judge.round(seen)]

    async def observe_vanished(self, plugin: PluginSpec) -> None:
        """Look at the folder a moment after a plugin socket was deleted; the judge judges.

        First once kubelet.sock's own events have landed; where no kubelet restart explains the
        removal, again when the restart window is over (a plugin re-creating its socket).
        """
        s = self.settings
        try:
            await asyncio.sleep(s.vanish_settle)
            # A sock_diag dump: off the loop (a host's namespace may hold 100,000 sockets).
            names = (s.plugin_path(plugin), *_bound_as(plugin))
            look = partial(still_listening, self._listeners.get(plugin.resource), names)
            for window_over in (False, True):
                listening = await self._off_loop(look, None)
                seen = AfterDeletion(
                    plugin=socket_identity(s.plugin_path(plugin)),
                    kubelet=socket_identity(s.kubelet_path),
                    kubelet_refuses=socket_refuses(s.kubelet_path),
                    listening=listening,
                )
                if not self.judge.judge_vanished(plugin.resource, seen, window_over):
                    break
                await asyncio.sleep(max(0.0, s.plugin_restart_window - s.vanish_settle))
        finally:
            # Never left waiting for a verdict that will not come: the next round judges the socket.
            self.judge.end_judgement(plugin.resource)

    def socket_created(self, plugin: PluginSpec) -> None:
        """A plugin socket's creation event: its file is noted at once (an lstat), so that its end is
        judged by its listener even where no round saw it (a plugin that served and stopped between two
        rounds); the listener itself is looked up by the rounds, and by that verdict."""
        path = self.settings.plugin_path(plugin)
        identity, bound = socket_identity(path), file_id(path)
        known = self._listeners.get(plugin.resource)
        if identity is None or bound is None or bound[1] != identity.ino:
            return
        if known is None or known.identity != identity:
            self._listeners[plugin.resource] = PluginListener(bound, None, identity)

    def _gone_as(self, plugin: PluginSpec) -> tuple[tuple[int, int], int] | None:
        """The file the plugin's listener bound and that listener's inode, as last found (its own socket
        file may be gone since: the kernel keeps the identity)."""
        known = self._listeners.get(plugin.resource)
        return (known.bound, known.ino) if known is not None and known.ino is not None else None

    async def _find_listeners(self) -> None:
        """Each plugin socket's listener, looked up (off the loop) when its file is a new one, and again
        each round until it is found: a Go server binds its file before it listens, and a lookup in
        between finds none. A file gone keeps the listener last found: it outlives its file."""
        for plugin in self.settings.plugins:
            path = self.settings.plugin_path(plugin)
            identity, bound = socket_identity(path), file_id(path)
            if identity is None or bound is None or bound[1] != identity.ino:
                continue  # gone (its listener, if found, is kept), or replaced between the two looks
            known = self._listeners.get(plugin.resource)
            if known is not None and known.identity == identity and known.ino is not None:
                continue
            names = (path, *_bound_as(plugin))
            ino = await self._off_loop(partial(listener_of, bound, names), None)
            self._listeners[plugin.resource] = PluginListener(bound, ino, identity)

    async def _kubelet_rules(self, generation: int) -> KubeletRules:
        """The rules of the kubelet's release: the setting, else its binary, read again after each kubelet
        restart (and every `RELEASE_RETRY` while unknown), off the loop."""
        s = self.settings
        if s.kubelet_version:
            minor = release.parse(s.kubelet_version)
            assert minor is not None  # the flag's type checked it
            return kubelet_rules(release.Release(s.kubelet_version, minor, "the setting --kubelet-version"))
        now = self._clock()
        last_generation, last_read = self._rules_read
        if (
            self._rules is not None
            and last_generation == generation
            and (self._rules.version or now - last_read < RELEASE_RETRY)
        ):
            return self._node_rules(self._rules)
        read = partial(release.from_process, self.names, s.kubelet_path)
        late = "the kubelet's binary could not be read in time"
        self._rules = kubelet_rules(await self._off_loop(read, late))
        self._rules_read = (generation, now)
        return self._node_rules(self._rules)

    def _node_rules(self, binary: KubeletRules) -> KubeletRules:
        """Where the binary names no release, the one this node's Node reports (status.nodeInfo)."""
        reported = self.node_kubelet_version
        minor = release.parse(reported) if reported and not binary.version else None
        if minor is None:
            return binary
        source = f"the Node's status.nodeInfo.kubeletVersion (the binary: {binary.source})"
        return kubelet_rules(release.Release(reported, minor, source))

    async def _socket_table(self) -> _SocketTable:
        """The kubelet's connections, read on the table's thread within the probe timeout or the dump's
        deadline (2 s), the longer."""
        # Not the probe timeout alone, which may be 50 ms: a read of 100,000 sockets takes a few hundred.
        wait = max(self.settings.probe_timeout, DIAG_DEADLINE)
        got = await self._table.read(self._read_socket_table, wait)  # after a look under way, if any
        table = _SocketTable(got, set(), got) if isinstance(got, str) else got
        self.kubelets_ignored = table.ignored
        self.table_read_seconds = self._table.last_read
        return table

    def watch_connections(self, held: set[str], then: Callable[[], object]) -> None:
        """Between rounds, the socket table alone (no gRPC call), looked at on the table's thread every
        connection interval: have the kubelet's connections to a plugin it holds (`held`: resources)
        changed since this round? A drop, a second Register (the kubelet closes the first connection):
        `then()` is called, from that thread, and the round that judges it is due now, not at the next
        interval. Only what the reader trusts counts: a set of connections, or 0 where a positive count
        is not trusted; a look that cannot tell leaves it to the next round. Set after each round; none
        where the round could not read them (a look would not either: podlook looks there)."""
        watched = [p for p in self.settings.plugins if p.resource in held]
        if not watched or not self.connections_read:
            self._table.watch(None)
            return
        known = {p.resource: self.last_ids.get(p.resource) for p in watched}
        if all(known.values()) and self.connections_source.startswith("this network namespace"):
            # Read by sock_diag in this namespace, each connection known: asked for one by one, which
            # costs microseconds however many sockets the namespace holds.
            ids = frozenset[int]().union(*(k for k in known.values() if k))
            self._table.watch(Look(partial(gone_by_diag, ids), False, then))
            return
        # The kubelet's namespace read through /proc: its table's inodes alone, one pass, no parse. The
        # connections the kubelet is known to hold, else every one the round saw at the plugin's path
        # (where the plugin's descriptors cannot be read: its own capabilities dropped): one of them
        # gone brings the round forward, which judges whose it was.
        seen = [self._listed.get(r) if (k := known[r]) is None else k for r in (p.resource for p in watched)]
        if self._tables and all(seen):
            ids = frozenset[int]().union(*(k for k in seen if k))
            self._table.watch(Look(partial(gone_from, self._tables, ids), False, then))
        else:
            # A count of 0, or connections not asked for by inode: the whole table, spaced by its cost.
            self._table.watch(Look(partial(self._connections_differ, watched, known), True, then))

    def _connections_differ(self, watched: list[PluginSpec], known: dict[str, frozenset[int] | None]) -> bool:
        """On the table's thread: does a whole read of the table differ from the round's for a plugin?"""
        connections = self._read_socket_table().connections
        if isinstance(connections, str):
            return False
        for plugin in watched:
            path = self.settings.plugin_path(plugin)
            found = connections.accepted(path, _bound_as(plugin), self._gone_as(plugin), strict=True)
            if not isinstance(found, str) and found != known[plugin.resource]:
                return True
        return False

    def _read_socket_table(self) -> _SocketTable:
        """The kubelet's connections, from the sockets bound to the files that matter only (a host
        namespace holds thousands)."""
        s = self.settings
        plugins = [s.plugin_path(p) for p in s.plugins]
        files = [s.kubelet_path, *plugins]
        bound = {os.path.join(BOUND_DIR, p.socket) for p in s.plugins}
        listed = {i for f in files if (i := file_id(f))}
        # A plugin's file gone: its listener's file, which the kernel keeps, still matches its connections.
        listed |= {g[0] for p in s.plugins if (g := self._gone_as(p))}
        try:
            mine: list[UnixSocket] | str = diag_dump(listed)
        except DiagUnavailable as e:
            mine = str(e)
        paths = {*files, *bound}
        kubelets = kubelet_processes(s.kubelet_path, names=self.names)
        connections = kubelet_connections(
            s.kubelet_path, names=self.names, mine=mine, paths=paths, served=plugins, kubelets=kubelets
        )
        return _SocketTable(mine, listed, connections, kubelets.ignored)

    def _evidence(self, plugin: PluginSpec, result: ProbeResult, table: _SocketTable) -> PluginEvidence:
        """One plugin's probe, the kubelet's connections to its socket and who serves it."""
        s = self.settings
        path = s.plugin_path(plugin)
        ids: frozenset[int] | None = None
        if isinstance(table.connections, str):
            held: Reading[int] = Reading.failed(table.connections)
        else:
            # Where the folder is mounted elsewhere, the plugin bound it at the kubelet's own path.
            found = table.connections.accepted(path, _bound_as(plugin), self._gone_as(plugin), strict=True)
            if isinstance(found, str):
                held = Reading.failed(found)
            else:
                ids, held = found, Reading(len(found))
        # A socket re-created since the table was read is not in it: no verdict on its owner.
        owner = (
            socket_owner(path, s.kubelet_path, table.mine, names=self.names)
            if result.ok and not isinstance(table.mine, str) and file_id(path) in table.listed
            else SocketOwner("unknown", "")
        )
        identity = socket_identity(path)
        listener = self._listeners.get(plugin.resource)
        if identity is None and ids and listener is not None:
            # The file is gone and its listener, still there, holds the kubelet's connections: they are
            # that file's, which the kernel keeps for the listener.
            identity = listener.identity
        return PluginEvidence(result, identity, held, owner.verdict, owner.reason, ids)

    async def _checkpoint(self) -> Reading[Checkpoint]:
        """The kubelet's checkpoint, read off the loop within the probe timeout."""
        s = self.settings
        assert self._reader is not None
        try:
            async with asyncio.timeout(s.probe_timeout):
                return await read_checkpoint_async(
                    os.path.join(s.device_plugin_dir, CHECKPOINT_NAME), self._reader
                )
        except TimeoutError:
            return Reading.failed(f"the checkpoint could not be read within {s.probe_timeout:g}s")

    async def _served_elsewhere(self, plugins: list[ProbeResult]) -> tuple[tuple[str, SocketId], ...]:
        """Other sockets served in the folder, only while a plugin's own is missing (under another name?)."""
        if not any(r.state == "absent" for r in plugins):
            return ()
        s = self.settings
        taken = {s.kubelet_socket, *(p.socket for p in s.plugins)}
        # A read cut short keeps the last answer: an empty one would make the next look like a restart.
        read = partial(_served_elsewhere, s.device_plugin_dir, taken)
        self._others = await self._off_loop(read, self._others)
        return self._others

    async def _recovery_evidence(self) -> RecoveryEvidence:
        """For --recover-unhealthy-after: who holds which device (pod-resources List), and the host's
        GPUs (the driver's UUIDs, the device nodes), read off the loop."""
        s = self.settings
        held = await pod_resources_held(s.pod_resources_socket, s.probe_timeout)
        late: tuple[Reading[frozenset[str]], int | None] = (Reading.failed("not read in time"), None)
        uuids, nodes = await self._off_loop(partial(_host_gpus, s.driver_gpus_dir, s.device_glob), late)
        return RecoveryEvidence(held, uuids, nodes)

    def _expected(self) -> hamiconfig.Expectation:
        s = self.settings
        return hamiconfig.expectation(
            hamiconfig.Sources(
                s.device_glob, s.hami_config, s.node_name, s.driver_gpus_dir, s.vfio_dir, profile=s.profile
            )
        )

    async def _off_loop(self, read: Callable[[], T], fallback: T) -> T:
        """`read` (files, connects) on the reader's thread within the probe timeout, never on the loop."""
        assert self._reader is not None
        try:
            async with asyncio.timeout(self.settings.probe_timeout):
                return await asyncio.get_running_loop().run_in_executor(self._reader, read)
        except TimeoutError:
            return fallback


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


def _host_gpus(gpus_dir: str, device_glob: str) -> tuple[Reading[frozenset[str]], int | None]:
    """The GPUs' UUIDs their driver lists (or why none), and the `device_glob` matches."""
    gpus, unread = hostdevices.read_gpus(gpus_dir)
    uuids = frozenset(g.uuid for g in gpus if g.uuid)
    reading = Reading(uuids) if uuids or not unread else Reading[frozenset[str]].failed(unread)
    try:
        nodes: int | None = len(glob.glob(device_glob))
    except Exception:  # a hostile pattern never costs the round
        nodes = None
    return reading, nodes


def _bound_as(plugin: PluginSpec) -> tuple[str]:
    """Where the plugin bound its socket when its folder is mounted elsewhere: the kubelet's own path."""
    return (os.path.join(BOUND_DIR, plugin.socket),)


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
