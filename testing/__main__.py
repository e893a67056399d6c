"""`python -m testing`: a simulated kubelet and plugin in a folder, with faults typed at a prompt."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile

from testing.kubelet import FakeKubelet
from testing.plugin import FakeDevicePlugin

COMMANDS = """commands:
  restart          restart the kubelet (plugin sockets deleted; the plugin registers again)
  restart-unlink   same, but the old kubelet unlinks kubelet.sock first
  stop | start     stop the kubelet (kubelet.sock left as a dead file) / start it
  hang | unhang    the plugin accepts connections and never answers / answers again
  crash            the plugin dies and its socket is removed
  serve            the plugin serves and registers again
  noregister       the plugin stops registering (after a kubelet restart it stays unregistered)
  devices N        the plugin reports N devices
  status           what the kubelet knows
  quit"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing", description=__doc__)
    parser.add_argument("--device-plugin-dir", help="folder to use (default: a new temporary folder)")
    parser.add_argument("--pod-resources-socket", help="also serve pod-resources on this socket")
    parser.add_argument("--resource", default="nvidia.com/gpu")
    parser.add_argument("--socket", default="nvidia-gpu.sock")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    folder = args.device_plugin_dir or tempfile.mkdtemp(prefix="device-plugins-")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_interactive(folder, args.pod_resources_socket, args.resource, args.socket))
    return 0


async def _interactive(folder: str, pod_resources: str | None, resource: str, socket: str) -> None:
    async with (
        FakeKubelet(folder, pod_resources, dial_timeout=2.0) as kubelet,
        FakeDevicePlugin(folder, resource, socket) as plugin,
    ):
        print(f"kubelet: {kubelet.socket_path}\nplugin:  {plugin.socket_path}\n{COMMANDS}", flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line or line.strip() == "quit":
                return
            word, *rest = line.split() or [""]
            if word == "restart":
                await kubelet.restart()
            elif word == "restart-unlink":
                await kubelet.restart(unlink_socket=True)
            elif word == "stop":
                await kubelet.stop()
            elif word == "start":
                await kubelet.start()
            elif word in ("hang", "unhang"):
                plugin.hung = word == "hang"
            elif word == "crash":
                await plugin.crash()
            elif word == "serve":
                plugin.register_enabled = True
                await plugin.restart()
            elif word == "noregister":
                plugin.register_enabled = False
            elif word == "devices" and rest and rest[0].isdigit():
                plugin.set_devices(f"GPU-{i}" for i in range(int(rest[0])))
            elif word == "status":
                for r in kubelet.resources():
                    print(f"{r}: healthy={kubelet.healthy_devices(r)} registers={kubelet.register_calls[r]}")
            elif word:
                print(COMMANDS)


if __name__ == "__main__":
    raise SystemExit(main())
