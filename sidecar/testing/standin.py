"""`python -m sidecar.testing.standin`: FakeDevicePlugin as a pod's `device-plugin` container.

The node end-to-end tests (tests/node) run it in place of HAMi's plugin, which needs a GPU: it serves
`nvidia-gpu.sock` in the kubelet's real device-plugins folder with HAMi's split device IDs
(`<GPU-UUID>-<n>`), registers `nvidia.com/gpu`, and serves and registers again when `kubelet.sock` is
created, as HAMi does. Faults are files in `--control` (a hostPath the tests write), read twice a
second, so they outlive a container restart the way a plugin's bug does:

- `ignore-kubelet-restart`: `kubelet.sock` re-created is ignored (the plugin stays unregistered after
  a kubelet restart until its container restarts);
- `noregister`: the plugin never registers (a plugin version that cannot register);
- `drop`: every open ListAndWatch stream ends once while the plugin keeps serving (the file is removed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from sidecar.testing.plugin import HAMI_SPLIT_COUNT, FakeDevicePlugin, hami_device_ids
from sidecar.watcher import FsEvent

logger = logging.getLogger(__name__)

IGNORE_KUBELET_RESTART = "ignore-kubelet-restart"
NOREGISTER = "noregister"
DROP = "drop"
CONTROL_INTERVAL = 0.5


class StandInPlugin(FakeDevicePlugin):
    """FakeDevicePlugin whose reaction to `kubelet.sock` re-creation can be switched off."""

    ignore_kubelet_restart = False

    def _on_event(self, event: FsEvent) -> None:
        if self.ignore_kubelet_restart:
            if event.kind == "created" and event.name == os.path.basename(self.kubelet_socket):
                logger.info("kubelet.sock created: ignored (%s)", IGNORE_KUBELET_RESTART)
            return
        super()._on_event(event)


def apply_control(plugin: StandInPlugin, control: str) -> None:
    """Reads the fault files in `control` into the plugin's switches (a missing folder means none)."""
    try:
        names = set(os.listdir(control))
    except OSError:
        names = set()
    plugin.ignore_kubelet_restart = IGNORE_KUBELET_RESTART in names
    plugin.register_enabled = NOREGISTER not in names
    if DROP in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(control, DROP))
        logger.info("ending every ListAndWatch stream (%s)", DROP)
        while plugin.streams_open:
            plugin.end_stream()


async def serve(args: argparse.Namespace) -> None:
    devices = hami_device_ids((f"GPU-{args.uuid_prefix}{n:04d}" for n in range(args.gpus)), args.split)
    plugin = StandInPlugin(args.device_plugin_dir, args.resource, args.socket, devices)
    apply_control(plugin, args.control)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with plugin:
        logger.info("serving %s on %s: %d devices", args.resource, plugin.socket_path, len(devices))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CONTROL_INTERVAL)
            apply_control(plugin, args.control)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.testing.standin", description=__doc__)
    parser.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    parser.add_argument("--resource", default="nvidia.com/gpu")
    parser.add_argument("--socket", default="nvidia-gpu.sock")
    parser.add_argument("--gpus", type=int, default=2, help="physical GPUs (each advertised --split times)")
    parser.add_argument("--split", type=int, default=HAMI_SPLIT_COUNT)
    parser.add_argument("--uuid-prefix", default="e2e0000-0000-0000-0000-00000000")
    parser.add_argument("--control", default="/run/hami-standin", help="folder of fault files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
