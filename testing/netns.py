"""Network namespaces of their own, for tests: a device plugin that is not this pod's.

A pod's containers share one network namespace, and a Unix listener lives in the namespace of
the process that bound it, so "which pod serves this socket file" is "in which namespace is
its listener" (`hami_guard.node.unixdiag.socket_owner`). A test stands for the node like this: the
kubelet (the simulator) in the test's own namespace, the host's; this pod's plugin, and the
sidecar or hami-doctor that judge it, in one `Netns`; a competing plugin (the GPU Operator's
NVIDIA plugin beside HAMi) in another, re-binding the same socket path.

    with Netns() as pod, Netns() as other:
        ours = pod.plugin(dp_dir)                  # serves nvidia-gpu.sock, registers
        theirs = other.plugin(dp_dir, devices=["GPU-x"])   # re-binds it, registers last
        pod.run([sys.executable, "-m", "doctor", ...])     # judges from this pod's namespace

Needs root (`unshare --net`, `nsenter --net`, both util-linux). `unavailable()` says why not;
`require()` skips a test with that reason, and fails it in CI (CI=true), where root is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from testing.plugin import FakeDevicePlugin

HOLDER = "import sys; print('ready', flush=True); sys.stdin.read()"


def unavailable() -> str | None:
    """Why a network namespace of its own cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root for unshare --net (CI runs as root)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    try:
        done = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --net failed: {e}"
    if done.returncode != 0:
        return f"unshare --net failed: {done.stderr.strip() or done.returncode}"
    return None


def require() -> None:
    """In a test: return when namespaces can be made; else skip saying why, or fail in CI (CI=true)."""
    why = unavailable()
    if why is None:
        return

    if os.environ.get("CI") == "true":
        pytest.fail(f"a network namespace of its own is required in CI: {why}")
    pytest.skip(f"no network namespace of its own: {why}")


class Netns:
    """A new network namespace, kept alive by a holder process until `close()`."""

    def __init__(self) -> None:
        self._holder: subprocess.Popen[str] | None = None

    def start(self) -> Netns:
        holder = subprocess.Popen(
            ["unshare", "--net", sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        if holder.stdout.readline() != "ready\n":
            holder.kill()
            holder.wait()
            raise RuntimeError(f"unshare --net did not start (exit {holder.poll()}): {unavailable()}")
        self._holder = holder
        return self

    @property
    def pid(self) -> int:
        if self._holder is None:
            raise RuntimeError("the namespace is not started")
        return self._holder.pid

    @property
    def path(self) -> str:
        """The namespace's handle, for `nsenter --net=`."""
        return f"/proc/{self.pid}/ns/net"

    @property
    def inode(self) -> int:
        """The namespace's identity: /proc/<pid>/ns/net of every process in it has this inode."""
        return os.stat(self.path).st_ino

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.command(argv), check=False, **kwargs)

    def plugin(
        self,
        device_plugin_dir: str,
        resource: str = "nvidia.com/gpu",
        socket_name: str = "nvidia-gpu.sock",
        devices: Sequence[str] = ("GPU-0", "GPU-1"),
        register: bool = True,
    ) -> PluginProcess:
        """A `FakeDevicePlugin` in a process in this namespace: it removes whatever file is at the
        socket path and binds its own there (as HAMi and NVIDIA do), serves, then registers. Returns
        once it serves; it registers after that, so a simulator in the caller's loop can answer."""
        return PluginProcess.start(
            self,
            device_plugin_dir,
            resource=resource,
            socket_name=socket_name,
            devices=devices,
            register=register,
        )

    async def aplugin(self, device_plugin_dir: str, **kwargs: Any) -> PluginProcess:
        """`plugin()` without blocking the caller's event loop (where the simulated kubelet runs)."""
        return await asyncio.to_thread(self.plugin, device_plugin_dir, **kwargs)

    def close(self) -> None:
        holder, self._holder = self._holder, None
        if holder is None:
            return
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()

    def __enter__(self) -> Netns:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class PluginProcess:
    """A simulated device plugin running in a process of its own (in a `Netns`)."""

    def __init__(self, proc: subprocess.Popen[str], socket_path: str, socket_inode: int) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self.socket_inode = socket_inode  # the inode of the socket file it bound

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(
        cls,
        netns: Netns | None,
        device_plugin_dir: str,
        *,
        resource: str = "nvidia.com/gpu",
        socket_name: str = "nvidia-gpu.sock",
        devices: Sequence[str] = ("GPU-0", "GPU-1"),
        register: bool = True,
    ) -> PluginProcess:
        """The plugin in `netns`, or in this process's namespace when None."""
        argv = [
            sys.executable, "-m", "testing.netns",
            "--device-plugin-dir", device_plugin_dir,
            "--resource", resource,
            "--socket", socket_name,
            "--devices", ",".join(devices),
        ]  # fmt: skip
        if not register:
            argv.append("--no-register")
        command = netns.command(argv) if netns is not None else argv
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "serving":
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the plugin process did not serve (exit {proc.returncode})")
        return cls(proc, os.path.join(device_plugin_dir, socket_name), int(line[1]))

    def stop(self, remove_socket: bool = True, timeout: float = 10.0) -> None:
        """Stop serving and exit; without `remove_socket` its file stays behind, refusing connections."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("close\n" if remove_socket else "crash\n")
                self.proc.stdin.flush()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(BrokenPipeError):
                    stream.close()

    async def astop(self, remove_socket: bool = True) -> None:
        """`stop()` without blocking the caller's event loop."""
        await asyncio.to_thread(self.stop, remove_socket)


async def _serve(args: argparse.Namespace) -> None:

    plugin = FakeDevicePlugin(
        args.device_plugin_dir, args.resource, args.socket, [d for d in args.devices.split(",") if d]
    )
    plugin.register_enabled = False  # serve first and say so; register after (the kubelet dials back)
    await plugin.start()
    print("serving", os.stat(plugin.socket_path).st_ino, flush=True)
    if args.register:
        plugin.register_enabled = True
        await plugin.register()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str] = loop.create_future()

    def finish(command: str) -> None:
        if not done.done():
            done.set_result(command)

    loop.add_signal_handler(signal.SIGTERM, finish, "close")

    def read_command() -> None:
        line = sys.stdin.readline().strip() or "close"  # EOF: the test went away
        loop.call_soon_threadsafe(finish, line)

    loop.run_in_executor(None, read_command)
    if await done == "crash":
        await plugin.crash(remove_socket=False)
    else:
        await plugin.close()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m testing.netns")
    p.add_argument("--device-plugin-dir", required=True)
    p.add_argument("--resource", default="nvidia.com/gpu")
    p.add_argument("--socket", default="nvidia-gpu.sock")
    p.add_argument("--devices", default="GPU-0,GPU-1")
    p.add_argument("--register", action=argparse.BooleanOptionalAction, default=True)
    asyncio.run(_serve(p.parse_args(argv)))
    os._exit(0)  # the stdin reader thread may still wait on a line that never comes


if __name__ == "__main__":
    main()
