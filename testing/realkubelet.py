"""The kubelet's real device manager and device plugins, driven from asyncio.

`RealKubelet` and `RealPlugin` mirror `FakeKubelet` and `FakeDevicePlugin`, but each runs
a process of the Go fixture in `tests/realkubelet` (docs/real-kubelet.md): the device
manager, PodResources server and test plugin of `k8s.io/kubernetes` itself, at the newest served
patch of each minor release from 1.30 (docs/kubelet-releases.md); "new" names the newest (it
carries kubernetes PR 135437), "old" the newest without it. `make kubelet-fixtures` builds the newest
and the oldest (the releases `make test` runs), `make kubelet-fixtures-all` every one;
`fixture_binary()` answers None while one is missing.

Each process reads one command a line on stdin and answers each with one JSON line; its
events (`ready`, `checkpoint`, `stream-open`, `log`, ...) are kept in order and can be
waited for. Every wait has a timeout; every process is reaped by `close()` (the async
context managers call it), and any still alive at interpreter exit is killed.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME

# Every release the fixture is built at (the Makefile's KUBELET_RELEASES), oldest first.
VERSIONS = ("v1.30.14", "v1.31.12", "v1.32.9", "v1.33.13", "v1.34.4", "v1.35.4", "v1.36.5", "v1.37.2")
# A release by name ("new": the newest, with PR 135437; "old": the newest without it) or by version.
Release = Literal[
    "new", "old", "v1.30.14", "v1.31.12", "v1.32.9", "v1.33.13", "v1.34.4", "v1.35.4", "v1.36.5", "v1.37.2"
]
RELEASES: Mapping[str, str] = {"new": "v1.37.2", "old": "v1.36.5", **{v: v for v in VERSIONS}}
# Built by `make kubelet-fixtures` (and so by `make test`); the others by `make kubelet-fixtures-all`.
QUICK_VERSIONS = ("v1.37.2", "v1.30.14")
# What a test parametrized over releases runs at without $REALKUBELET_RELEASES: the newest (PR 135437)
# and the oldest supported (the code of issue 121994, the folder cleaning of 1.30 to 1.32, V1 reads).
DEFAULT_RELEASES: tuple[Release, ...] = ("new", "v1.30.14")
RELEASES_ENV = "REALKUBELET_RELEASES"
KUBELET_SOCKET = "kubelet.sock"
PROCESSED = "Processed device updates for resource"  # the manager's line for each ListAndWatch answer
BIN_ENV = "HAMI_GUARD_REALKUBELET_BIN"
_REPO = Path(__file__).resolve().parents[1]

Event = dict[str, Any]


START_ATTEMPTS = 20  # a kubelet start that finds the machine's inotify instances exhausted is retried


class FixtureError(Exception):
    """A fixture process failed, answered an error, or did not answer in time."""


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or _REPO / "tests" / "realkubelet" / "bin")


def fixture_binary(release: str) -> Path | None:
    """The fixture binary of a release ("new", "old" or a version), None while it is not built."""
    version = RELEASES.get(release, release)
    path = bin_dir() / f"realkubelet-{version}"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_hint(release: str) -> str:
    version = RELEASES.get(release, release)
    target = "kubelet-fixtures" if version in QUICK_VERSIONS else "kubelet-fixtures-all"
    return (
        f"the real-kubelet fixture for kubernetes {version} is not built: run `make {target}` "
        f"(needs Go >= 1.26; it writes {bin_dir() / f'realkubelet-{version}'})"
    )


def minor(release: str) -> int:
    """The minor version of a release: 37 for "new" and "v1.37.2"."""
    return int(RELEASES.get(release, release).split(".")[1])


def has_pr_135437(release: str) -> bool:
    """Whether the release tells endpoints apart by socket path (kubernetes PR 135437, from v1.37.0)."""
    return minor(release) >= 37


def disconnected_log(release: str) -> str:
    """The kubelet's last line for a client whose stream has ended (runClient -> Disconnect): client.go
    Disconnect's own "Device plugin disconnected" from v1.33; before, only manager.go
    PluginDisconnected's "Endpoint became unhealthy", logged just before."""
    return "Device plugin disconnected" if minor(release) >= 33 else "Endpoint became unhealthy"


def selected_releases(default: Iterable[Release] = DEFAULT_RELEASES) -> list[Release]:
    """The releases a test parametrized over releases runs at: $REALKUBELET_RELEASES (comma-separated
    names or versions, or "all" for every version) or `default`. A release whose binary is missing is
    still listed: the test skips it with the reason (fails under CI=true)."""
    raw = os.environ.get(RELEASES_ENV, "").strip()
    if not raw:
        return list(default)
    names = list(VERSIONS) if raw == "all" else [r.strip() for r in raw.split(",") if r.strip()]
    unknown = [n for n in names if n not in RELEASES]
    if unknown:
        raise ValueError(f"{RELEASES_ENV}: unknown releases {unknown}; known: {sorted(RELEASES)}")
    return cast("list[Release]", names)


def missing_reason(release: str) -> str | None:
    """Why the fixture of a release cannot run here, or None when it can."""
    if fixture_binary(release) is None:
        if shutil.which("go") is None:
            return f"Go is not installed; {build_hint(release)}"
        return build_hint(release)
    return None


def _binary(release: str) -> Path:
    path = fixture_binary(release)
    if path is None:
        raise FixtureError(build_hint(release))
    return path


# Process groups still alive: killed at interpreter exit whatever happened to the event loop.
_LIVE: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    for pgid in list(_LIVE):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


class FixtureProcess:
    """One fixture process: commands on stdin, replies and events from stdout, klog in a file."""

    def __init__(self, argv: list[str], label: str) -> None:
        self.argv = argv
        self.label = label
        self.events: list[Event] = []
        self._private = tempfile.mkdtemp(prefix="realkubelet-")
        self.log_path = os.path.join(self._private, f"{label}.log")
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[Event]] = {}
        self._ids = itertools.count(1)
        self._cond: asyncio.Condition | None = None
        self._eof = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def spawn(self) -> None:
        if self.alive:
            raise FixtureError(f"{self.label} is already running")
        self.events = []
        self._eof = False
        self._cond = asyncio.Condition()
        with open(self.log_path, "ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # its own process group: a kill reaches every process of it
            )
        _LIVE.add(self._proc.pid)
        self._reader = asyncio.create_task(self._read(self._proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and self._cond is not None
        cond = self._cond
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if "event" in msg:
                async with cond:
                    self.events.append(msg)
                    cond.notify_all()
            elif (fut := self._pending.pop(str(msg.get("id")), None)) is not None and not fut.done():
                fut.set_result(msg)
        async with cond:
            self._eof = True
            cond.notify_all()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(FixtureError(f"{self.label} exited before answering{self.log_tail()}"))
        self._pending.clear()

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            return ""
        return "\n--- " + self.label + " log ---\n" + "".join(tail) if tail else ""

    async def call(self, *words: str, timeout: float = 30.0) -> Event:
        """Send one command; its reply (raises FixtureError when it says ok=false)."""
        reply = await self.ask(*words, timeout=timeout)
        if not reply.get("ok"):
            raise FixtureError(f"{self.label}: {' '.join(words)}: {reply.get('error')}")
        return reply

    async def ask(self, *words: str, timeout: float = 30.0) -> Event:
        """Send one command; its reply, ok or not."""
        proc = self._proc
        if proc is None or proc.stdin is None or not self.alive or self._eof:
            raise FixtureError(f"{self.label} is not running")
        if not words or any(not w or any(c.isspace() for c in w) for w in words):
            raise ValueError(f"bad command words {words!r}")
        ident = str(next(self._ids))
        fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        proc.stdin.write(f"@{ident} {' '.join(words)}\n".encode())
        try:
            await proc.stdin.drain()
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise FixtureError(
                f"{self.label}: no answer to {words[0]} in {timeout}s{self.log_tail()}"
            ) from None
        except (BrokenPipeError, ConnectionResetError):
            raise FixtureError(f"{self.label} exited{self.log_tail()}") from None
        finally:
            self._pending.pop(ident, None)

    def mark(self) -> int:
        """A position in the event list: `wait_event(after=mark)` looks only at later events."""
        return len(self.events)

    def find(
        self, name: str, predicate: Callable[[Event], bool] | None = None, after: int = 0
    ) -> list[Event]:
        return [e for e in self.events[after:] if e["event"] == name and (predicate is None or predicate(e))]

    async def wait_event(
        self,
        name: str,
        predicate: Callable[[Event], bool] | None = None,
        *,
        after: int = 0,
        timeout: float = 10.0,
    ) -> Event:
        """The first event `name` (matching `predicate`) at or after position `after`."""
        cond = self._cond
        if cond is None:
            raise FixtureError(f"{self.label} was never started")
        try:
            async with asyncio.timeout(timeout), cond:
                while True:
                    found = self.find(name, predicate, after)
                    if found:
                        return found[0]
                    if self._eof:
                        raise FixtureError(f"{self.label} exited before {name}{self.log_tail()}")
                    await cond.wait()
        except TimeoutError:
            recent = [e for e in self.events[after:] if e["event"] != "log"][-12:]
            raise FixtureError(
                f"{self.label}: no {name} event in {timeout}s; events since: {recent}{self.log_tail()}"
            ) from None

    async def wait_log(self, message: str, *, after: int = 0, timeout: float = 10.0) -> Event:
        """A klog line whose message (the quoted text klog logs first) is `message`."""
        return await self.wait_event("log", lambda e: e.get("msg") == message, after=after, timeout=timeout)

    async def kill(self) -> None:
        """SIGKILL the process group and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        await self._reap(proc, timeout=10.0)

    async def finish(self, *words: str, timeout: float = 15.0) -> None:
        """Ask the process to end (a command that makes it exit), reap it; kill it if it does not."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            try:
                await self.call(*words, timeout=timeout)
                await self._reap(proc, timeout=timeout)
            except FixtureError:
                await self.kill()
                raise
            finally:
                if proc.returncode is None:
                    await self.kill()
        await self._reap(proc, timeout=timeout)

    async def _reap(self, proc: asyncio.subprocess.Process, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        # The process group may hold a child (the user-namespace fallback): end it too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.discard(proc.pid)
        if proc.stdin is not None:
            proc.stdin.close()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.wait_closed()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def cleanup(self) -> None:
        shutil.rmtree(self._private, ignore_errors=True)


class RealKubelet:
    """The kubelet's device manager (`devicemanager.NewManagerImpl` + `Start`) and PodResources server.

    It runs in a mount namespace of its own with `device_plugin_dir` bind-mounted at
    /var/lib/kubelet/device-plugins, the path the manager listens on.
    """

    def __init__(
        self,
        device_plugin_dir: str,
        pod_resources_socket: str | None = None,
        *,
        release: Release = "new",
        capacity_interval: float = 10.0,
        numa_nodes: int = 2,
        netns: bool = False,
        unique_name: bool = False,
    ) -> None:
        """`netns`: run in a network namespace of its own (root), as a kubelet beside a pod that does
        not use the host network: its connections to the plugins are then not in the test's. The
        process then also bears a name of its own (`process_name`, through a link to the binary),
        so that a sidecar told that name finds this kubelet and no other test's; `unique_name` gives it
        that name without the namespace."""
        self.dir = device_plugin_dir
        self.socket_path = os.path.join(device_plugin_dir, KUBELET_SOCKET)
        self.checkpoint_path = os.path.join(device_plugin_dir, CHECKPOINT_NAME)
        self.pod_resources_socket = pod_resources_socket
        self.release = release
        self.version = RELEASES[release]
        self.restarts = 0
        self._link_dir = ""
        binary = str(_binary(release))
        self.process_name = f"realkubelet-{self.version}"[:15]
        if netns or unique_name:
            self._link_dir = tempfile.mkdtemp(prefix="hg-kubelet-")
            self.process_name = f"kubelet-{os.path.basename(self._link_dir)[-6:]}"
            os.symlink(binary, os.path.join(self._link_dir, self.process_name))
            binary = os.path.join(self._link_dir, self.process_name)
        argv = [binary, "kubelet", "--dir", device_plugin_dir]
        if pod_resources_socket:
            argv += ["--pod-resources", pod_resources_socket]
        argv += ["--capacity-interval", f"{capacity_interval}s", "--numa-nodes", str(numa_nodes)]
        if netns:
            argv = ["unshare", "--net", "--", *argv]
        self.process = FixtureProcess(argv, f"kubelet-{self.version}")

    @property
    def running(self) -> bool:
        return self.process.alive

    async def start(self, timeout: float = 30.0) -> None:
        """Start: the manager reads its checkpoint, cleans the folder, listens; then pod-resources."""
        os.makedirs(self.dir, mode=0o750, exist_ok=True)
        for attempt in range(START_ATTEMPTS):
            await self.process.spawn()
            try:
                await self.process.wait_event("ready", timeout=timeout)
                return
            except FixtureError:
                await self.process.kill()
                # Every root process on the machine shares one limit of inotify instances
                # (fs.inotify.max_user_instances): another program's watchers can exhaust it for a
                # moment. The fixture fails before the manager starts (its checkpoint watch), so a
                # later start is the same start.
                failed = self.process.find("start-failed")
                busy = bool(failed) and "too many open files" in str(failed[-1].get("error"))
                if not busy or attempt == START_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.25)

    async def stop(self, unlink_socket: bool = False) -> None:
        """unlink_socket: a graceful stop (the manager's Stop unlinks kubelet.sock); else SIGKILL,
        which leaves `kubelet.sock` behind as a dead file, as a crashed kubelet does."""
        if unlink_socket:
            await self.process.finish("stop")
        else:
            await self.process.kill()

    async def restart(self, unlink_socket: bool = False) -> None:
        await self.stop(unlink_socket=unlink_socket)
        self.restarts += 1
        await self.start()

    async def close(self) -> None:
        """Stop (gracefully where it can), reap, and remove what it was started with."""
        try:
            await self._close()
        finally:
            if self._link_dir:
                shutil.rmtree(self._link_dir, ignore_errors=True)

    async def _close(self) -> None:
        try:
            if self.running:
                await self.stop(unlink_socket=True)
        finally:
            await self.process.kill()
            self.process.cleanup()

    async def __aenter__(self) -> RealKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def capacity(self) -> dict[str, Any]:
        """`GetCapacity` as the node status loop calls it: {capacity, allocatable, removed}."""
        reply = await self.process.call("capacity")
        return {k: reply[k] for k in ("capacity", "allocatable", "removed")}

    async def state(self) -> dict[str, Any]:
        """What the manager exposes: `devices` (GetAllocatableDevices: resource -> ID -> {health, numa}),
        `pods` (GetDevices per allocated container), `checkpoints_written` by this process."""
        return await self.process.call("state")

    def lists_processed(self, resource: str, after: int = 0) -> list[tuple[int, int]]:
        """(devices, healthy) of each `ListAndWatch` answer for `resource` the manager has applied, in
        order, from its own log line (`genericDeviceUpdateCallback` logs one for each answer, after
        its checkpoint write). The manager applies every answer it receives, whole, in order: it
        skips none and merges none, so a plugin's list is reflected once this has reached it."""
        out = []
        for e in self.process.find("log", lambda e: e.get("msg") == PROCESSED, after=after):
            parsed = _processed(str(e.get("line", "")))
            if parsed is not None and parsed[0] == resource:
                out.append(parsed[1:])
        return out

    async def healthy_devices(self, resource: str) -> list[str]:
        return sorted((await self.state())["devices"].get(resource, {}))

    async def allocate(self, pod: str, container: str, resource: str, n: int) -> list[str]:
        """A real Allocate through the manager (it calls the plugin, then writes its checkpoint)."""
        reply = await self.process.call("allocate", pod, container, resource, str(n))
        return list(reply["devices"])

    def mark(self) -> int:
        return self.process.mark()

    async def wait_event(
        self,
        name: str,
        predicate: Callable[[Event], bool] | None = None,
        *,
        after: int = 0,
        timeout: float = 10.0,
    ) -> Event:
        return await self.process.wait_event(name, predicate, after=after, timeout=timeout)

    async def wait_log(self, message: str, *, after: int = 0, timeout: float = 10.0) -> Event:
        return await self.process.wait_log(message, after=after, timeout=timeout)

    async def wait_checkpoint(self, *, after: int = 0, timeout: float = 10.0) -> Event:
        """The next write of the checkpoint (the manager renames a temp file over it)."""
        return await self.process.wait_event("checkpoint", after=after, timeout=timeout)


def _generation(reply: Event) -> int | None:
    value = reply.get("generation")
    return value if isinstance(value, int) else None


def _processed(line: str) -> tuple[str, int, int] | None:
    """(resource, totalCount, healthyCount) of a `Processed device updates for resource` line."""
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    try:
        return fields["resourceName"].strip('"'), int(fields["totalCount"]), int(fields["healthyCount"])
    except (KeyError, ValueError):
        return None


class RealPlugin:
    """A device plugin in a process of its own, on the kubelet's `pluginapi` types.

    impl="own": the fixture's plugin (tracks each ListAndWatch stream through its context, pushes
    every change to every open stream, counts calls, serves again after a stop).
    impl="stub": the kubelet's own test plugin (`Stub`), for the plain register path.
    """

    def __init__(
        self,
        device_plugin_dir: str,
        resource: str = "nvidia.com/gpu",
        socket_name: str = "nvidia-gpu.sock",
        devices: Iterable[str] = ("GPU-0", "GPU-1"),
        *,
        release: Release = "new",
        watch_kubelet: bool = True,
        impl: Literal["own", "stub"] = "own",
        register: bool = True,
        retry_interval: float = 0.0,
    ) -> None:
        self.dir = device_plugin_dir
        self.resource = resource
        self.socket_name = socket_name
        self.socket_path = os.path.join(device_plugin_dir, socket_name)
        self.devices = list(devices)
        self.release = release
        self.impl = impl
        self.register_at_start = register
        self.last_register_error: str | None = None
        self.inode: int | None = None  # the socket file this instance bound last
        argv = [str(_binary(release)), "plugin", "--dir", device_plugin_dir, "--socket", socket_name]
        argv += ["--resource", resource, "--impl", impl, "--register=false"]
        argv += ["--watch-kubelet=" + ("true" if watch_kubelet else "false")]
        if retry_interval:
            argv += ["--retry-interval", f"{retry_interval}s"]
        argv += [f"--devices={d}" for d in self.devices]
        self.process = FixtureProcess(argv, f"plugin-{socket_name}")

    @property
    def running(self) -> bool:
        return self.process.alive

    async def start(self, timeout: float = 30.0) -> None:
        """Serve first, then (unless register=False) register; `last_register_error` says how it went."""
        await self.process.spawn()
        try:
            await self.process.wait_event("ready", timeout=timeout)
        except FixtureError:
            await self.process.kill()
            raise
        self._note_inode()
        if self.register_at_start:
            await self.register()

    def _note_inode(self) -> None:
        served = self.process.find("serving")
        if served:
            self.inode = int(served[-1]["inode"])

    async def register(self) -> bool:
        """One Register call; True when the kubelet accepted it."""
        reply = await self.process.ask("register")
        self.last_register_error = None if reply.get("ok") else str(reply.get("error"))
        return bool(reply.get("ok"))

    async def set_devices(self, ids: Iterable[str]) -> int | None:
        """Replace the device list (ID or ID@numa[,numa]); pushed on every open stream.

        Returns the list's generation (own impl; None for the stub): each stream reports the
        generation of every list it sends in a `sent` event. A stream woken again before it sends
        sends only the newest list, so a generation may never be sent on its own."""
        self.devices = list(ids)
        return _generation(await self.process.call("devices", *self.devices))

    async def set_health(self, device: str, healthy: bool) -> int | None:
        """One device's health, as a new list pushed on every open stream; its generation (set_devices)."""
        return _generation(await self.process.call("health", device, "Healthy" if healthy else "Unhealthy"))

    async def stop_serving(self) -> None:
        """Stop the server (every stream ends) and unlink the socket if it is still this one's."""
        await self.process.call("stop")

    async def serve(self) -> None:
        await self.process.call("serve")
        self._note_inode()

    async def restart(self) -> bool:
        """What HAMi does when kubelet.sock is created: a new server on the same path, Register again."""
        reply = await self.process.ask("restart")
        self._note_inode()
        self.last_register_error = None if reply.get("ok") else str(reply.get("error"))
        return bool(reply.get("ok"))

    async def restart_server_only(self) -> None:
        """A new server on the same path, no Register (the kubelet's streams to the old one end)."""
        await self.process.call("restart-server-only")
        self._note_inode()

    async def end_stream(self, which: str = "oldest") -> int:
        """End one open ListAndWatch stream ("oldest", "newest" or its number) while the server keeps
        serving: the call completes, the kubelet's connection stays. Returns the stream's number."""
        reply = await self.process.call("end-stream", which)
        return int(reply["stream"])

    async def crash(self, remove_socket: bool = True) -> None:
        """SIGKILL: nothing serves. The socket file stays as a dead file unless remove_socket, and is
        removed only while it is still the one this instance bound (another may own the path)."""
        await self.process.kill()
        if remove_socket and self.inode is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.socket_path).st_ino == self.inode:
                    os.unlink(self.socket_path)

    async def close(self) -> None:
        try:
            if self.running:
                await self.process.finish("quit")
        finally:
            await self.process.kill()
            self.process.cleanup()

    async def __aenter__(self) -> RealPlugin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def state(self) -> dict[str, Any]:
        """streams_open, calls (per method), registrations, register_failures, last_error, serving, inode."""
        return await self.process.call("state")

    async def streams_open(self) -> int:
        """ListAndWatch streams open on this instance's server, seen from the plugin's side: the truth
        for "the kubelet holds a registration served by this listener" (own impl only)."""
        n = (await self.state())["streams_open"]
        if n is None:
            raise FixtureError("the kubelet's Stub cannot tell its open streams: use impl='own'")
        return int(n)

    async def calls(self) -> dict[str, int]:
        return dict((await self.state())["calls"] or {})

    def mark(self) -> int:
        return self.process.mark()

    async def wait_event(
        self,
        name: str,
        predicate: Callable[[Event], bool] | None = None,
        *,
        after: int = 0,
        timeout: float = 10.0,
    ) -> Event:
        return await self.process.wait_event(name, predicate, after=after, timeout=timeout)


async def fast_takeover(
    device_plugin_dir: str,
    *,
    release: Release = "new",
    resource: str = "nvidia.com/gpu",
    socket_name: str = "nvidia-gpu.sock",
    first_devices: Iterable[str] = ("GPU-0", "GPU-1"),
    second_devices: Iterable[str] = ("GPU-0", "GPU-1"),
) -> tuple[RealPlugin, RealPlugin]:
    """The state of kubernetes PR 139338's "fast takeover", reached for real.

    `first` serves `socket_name` without registering; `second` then binds the same path (the
    first's listener is left without a file); `first` registers, and the kubelet, dialing the path,
    reaches `second`'s server: accepted, with its ListAndWatch stream open on `second`. Returns
    (first, second) with `second` not registered; on a release with PR 135437 every
    `second.register()` is then rejected ("device plugin already connected").
    The caller closes both.
    """
    first = RealPlugin(
        device_plugin_dir,
        resource,
        socket_name,
        first_devices,
        release=release,
        watch_kubelet=False,
        register=False,
    )
    second = RealPlugin(
        device_plugin_dir,
        resource,
        socket_name,
        second_devices,
        release=release,
        watch_kubelet=False,
        register=False,
    )
    try:
        await first.start()
        await second.start()
        mark = second.mark()
        if not await first.register():
            raise FixtureError(f"the first instance's Register failed: {first.last_register_error}")
        await second.wait_event("stream-open", after=mark)
    except BaseException:
        await first.close()
        await second.close()
        raise
    return first, second
