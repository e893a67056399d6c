"""`python -m testing.standin`: FakeDevicePlugin as a pod's `device-plugin` container.

The node end-to-end tests (tests/node) run it in place of HAMi's plugin, which needs a GPU: it serves
`nvidia-gpu.sock` in the kubelet's real device-plugins folder with HAMi's split device IDs
(`<GPU-UUID>-<n>`), registers `nvidia.com/gpu`, and serves and registers again when `kubelet.sock` is
created, as HAMi does. Like HAMi, a refused `Register` stops the plugin (its socket goes) and the whole
start is tried again 30 s later ("Failed to start one or more plugins. Retrying in 30s..." in HAMi's
cmd/device-plugin/nvidia/main.go), and a device once reported Unhealthy on an XID event stays so for the
life of the process (the FIXME in HAMi's nvinternal/plugin/server.go). Faults are files in `--control`
(a hostPath the tests write), read twice a second (the lasting ones applied are then written to
`.applied` in the folder), so they outlive a container restart the way a plugin's bug does:

- `ignore-kubelet-restart`: `kubelet.sock` re-created is ignored (the plugin stays unregistered after
  a kubelet restart until its container restarts);
- `noregister`: the plugin never registers (a plugin version that cannot register);
- `drop`: every open ListAndWatch stream ends once while the plugin keeps serving (the file is removed);
- `fail-register`: the next `Register` is refused by the kubelet (it names an API version no kubelet
  supports), once (the file is removed): HAMi's failed start, retried 30 s later;
- `xid`: an XID event on the first GPU: its devices Unhealthy for the rest of the process's life, as HAMi
  never marks a device Healthy again (the file is removed; a restart of the plugin lists them Healthy);
- `dead-gpu`: the first GPU's devices (its split IDs) are reported Unhealthy, healthy again once the file
  is removed;
- `annotation-patch-fails`: the next PATCH of HAMi's node annotation fails (the file is removed as the
  PATCH is sent; the API server refuses it, 409);
- `map-order-held`: HAMi's annotation loop lists the GPUs in one order every round, as a one-GPU node's
  Go map always does (without it, a new order each round, as Go's map iteration gives HAMi's plugin:
  a round in another order patches a stale annotation again).

In a Pod (KUBERNETES_SERVICE_HOST and NODE_NAME set), it also writes HAMi's node annotation
`hami.io/node-nvidia-register` as HAMi's plugin does (another vendor's resource: that vendor's key, format
and stamp, `hamiwriter.Vendor`), with the ServiceAccount's token: after each
Register the kubelet accepts, a `WatchAndRegister` loop with an empty cache (testing/hamiwriter.py:
the GPUs in Go's map order, a new one each round, compared as a string with the cache, the cache written
before the PATCH; `--annotation-interval`, `--annotation-error-interval`: HAMi's 30 s and 5 s).
HAMi's restart on a new `kubelet.sock` builds new plugin objects with a loop of their own; the
stand-in's new loop replaces the old one (HAMi leaves the old one running on its old plugin objects:
not mirrored), so one loop writes, and one failed PATCH sticks (until a round in another order) as it
does in a plugin that never saw a kubelet restart.

`--faults` (default: the environment's HAMI_STANDIN_FAULTS), comma-separated names of the lasting faults
above, holds them on whatever the folder says: a pod template that carries a fault (a plugin version
that cannot register, rolled out to a DaemonSet).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import tempfile

from sidecar.watcher import FsEvent
from testing import hamiwriter
from testing.plugin import HAMI_SPLIT_COUNT, FakeDevicePlugin, hami_device_ids

logger = logging.getLogger(__name__)

IGNORE_KUBELET_RESTART = "ignore-kubelet-restart"
NOREGISTER = "noregister"
DROP = "drop"
DEAD_GPU = "dead-gpu"
FAIL_REGISTER = "fail-register"
XID = "xid"
ANNOTATION_PATCH_FAILS = "annotation-patch-fails"
MAP_ORDER_HELD = "map-order-held"
UNSUPPORTED_VERSION = "v1alpha0"  # no kubelet supports it: its Register is refused
LASTING = frozenset({IGNORE_KUBELET_RESTART, NOREGISTER, DEAD_GPU, MAP_ORDER_HELD})
CONTROL_INTERVAL = 0.5
UUID_PREFIX = "e2e00000-0000-0000-0000-00000000"  # GPU-<prefix><nnnn>: NVML's UUID shape, 8-4-4-4-12 hex
# The lasting fault files last applied, comma-separated: a test that must know the plugin acts on a
# change (before it restarts the kubelet) waits for it here.
APPLIED = ".applied"


class StandInPlugin(FakeDevicePlugin):
    """FakeDevicePlugin whose reaction to `kubelet.sock` re-creation can be switched off."""

    ignore_kubelet_restart = False
    first_gpu: tuple[str, ...] = ()  # the devices `dead-gpu` and `xid` report Unhealthy
    gpu_dead = False
    xid = False  # an XID event was seen on the first GPU: Unhealthy for the life of the process
    fail_next_register = False
    order_held = False  # MAP_ORDER_HELD: the annotation loop lists the GPUs in one order
    applied: str | None = None  # what APPLIED says, once written

    async def register(self) -> bool:
        if not self.fail_next_register or not self.register_enabled:
            return await super().register()
        self.fail_next_register = False
        logger.info(
            "Register with version %s, which the kubelet refuses (%s)", UNSUPPORTED_VERSION, FAIL_REGISTER
        )
        version, self.api_version = self.api_version, UNSUPPORTED_VERSION
        try:
            return await super().register()
        finally:
            self.api_version = version

    def set_gpu_dead(self, dead: bool) -> None:
        """The first GPU's devices Unhealthy (or Healthy again), pushed on the streams on a change only."""
        if dead == self.gpu_dead:
            return
        self.gpu_dead = dead
        logger.info("%s: %d devices %s", DEAD_GPU, len(self.first_gpu), "Unhealthy" if dead else "Healthy")
        for device in self.first_gpu:
            self.set_health(device, not dead)

    def _on_event(self, event: FsEvent) -> None:
        created = event.kind == "created" and event.name == os.path.basename(self.kubelet_socket)
        if self.ignore_kubelet_restart:
            if created:
                logger.info("kubelet.sock created: ignored (%s)", IGNORE_KUBELET_RESTART)
            return
        if created and not self.serving and self.stop_on_register_failure:
            # HAMi restarts its plugins on kubelet.sock's creation, a failed start's too.
            logger.info("kubelet.sock created, restarting (a failed start's retry replaced)")
            self._tasks.spawn(self.restart())
            return
        super()._on_event(event)


def parse_faults(text: str) -> frozenset[str]:
    """`--faults`: comma-separated lasting fault names; any other name is an error."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = names - LASTING
    if unknown:
        raise ValueError(
            f"unknown fault(s) {', '.join(sorted(unknown))} (lasting faults: {', '.join(sorted(LASTING))})"
        )
    return names


def apply_control(plugin: StandInPlugin, control: str, held: frozenset[str] = frozenset()) -> None:
    """Reads the fault files in `control`, and the faults `held` on, into the plugin's switches (a missing
    folder means no file), then says which lasting fault files it applied in `control`/APPLIED."""
    try:
        files = set(os.listdir(control))
    except OSError:
        files = set()
    names = files | held
    plugin.ignore_kubelet_restart = IGNORE_KUBELET_RESTART in names
    plugin.register_enabled = NOREGISTER not in names
    plugin.order_held = MAP_ORDER_HELD in names
    if FAIL_REGISTER in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(control, FAIL_REGISTER))
        plugin.fail_next_register = True
        logger.info("the next Register will be refused (%s)", FAIL_REGISTER)
    if XID in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(control, XID))
        if not plugin.xid:
            logger.info(
                "XID event on the first GPU: its devices Unhealthy until the plugin restarts (%s)", XID
            )
        plugin.xid = True
    plugin.set_gpu_dead(DEAD_GPU in names or plugin.xid)
    applied = ",".join(sorted(files & LASTING))
    if APPLIED not in files or applied != plugin.applied:
        with contextlib.suppress(OSError):
            fd, tmp = tempfile.mkstemp(prefix=APPLIED, dir=control)  # two pods' PID 1 on one node
            with os.fdopen(fd, "w") as f:
                f.write(applied)
            os.replace(tmp, os.path.join(control, APPLIED))
            plugin.applied = applied
    if DROP in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(control, DROP))
        logger.info("ending every ListAndWatch stream (%s)", DROP)
        while plugin.streams_open:
            plugin.end_stream()


def gpu_view(devices: dict[str, str]) -> list[hamiwriter.Gpu]:
    """The plugin's own view of its GPUs, as HAMi's annotation carries it: one entry per GPU of HAMi's
    split IDs (`<GPU-UUID>-<n>`), healthy while all its split devices are."""
    healthy: dict[str, bool] = {}
    for device, health in devices.items():
        uuid = device.rsplit("-", 1)[0]
        healthy[uuid] = healthy.get(uuid, True) and health == "Healthy"
    return [hamiwriter.Gpu(u, h) for u, h in healthy.items()]


def take_one_shot(control: str, name: str) -> bool:
    """Whether the one-shot fault file `name` is in `control`, removing it: True once per file."""
    try:
        os.unlink(os.path.join(control, name))
    except OSError:
        return False
    logger.info("%s: this PATCH fails", name)
    return True


async def write_annotations(plugin: StandInPlugin, args: argparse.Namespace) -> None:
    """HAMi's node annotation, written as HAMi's plugin writes it (the module's docstring), until
    cancelled; nothing outside a Pod."""
    api, node = hamiwriter.InCluster.from_environ(), hamiwriter.node_name()
    if api is None or not node:
        logger.info("HAMi's node annotation: not written (no KUBERNETES_SERVICE_HOST or no NODE_NAME)")
        return
    registrar = hamiwriter.Registrar(
        api,
        node,
        lambda: gpu_view(plugin.devices),
        interval=args.annotation_interval,
        error_interval=args.annotation_error_interval,
        fail_patch=lambda: take_one_shot(args.control, ANNOTATION_PATCH_FAILS),
        order=lambda n: hamiwriter.held_order(n) if plugin.order_held else hamiwriter.go_map_order(n),
        vendor=hamiwriter.Vendor.for_resource(args.resource),  # its vendor's key, format and stamp
    )
    started = 0
    try:
        while True:
            if plugin.registrations > started:  # a Register accepted: a loop with an empty cache
                started = plugin.registrations
                await registrar.restart()
            await asyncio.sleep(CONTROL_INTERVAL)
    finally:
        await registrar.stop()


async def serve(args: argparse.Namespace) -> None:
    devices = hami_device_ids((f"GPU-{args.uuid_prefix}{n:04d}" for n in range(args.gpus)), args.split)
    plugin = StandInPlugin(args.device_plugin_dir, args.resource, args.socket, devices)
    plugin.first_gpu = tuple(devices[: args.split])
    plugin.stop_on_register_failure = True
    plugin.retry_interval = args.retry_interval
    plugin.listen_delay = args.listen_delay
    held = parse_faults(args.faults)
    if held:
        logger.info("faults held on: %s", ", ".join(sorted(held)))
    apply_control(plugin, args.control, held)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with plugin:
        logger.info("serving %s on %s: %d devices", args.resource, plugin.socket_path, len(devices))
        annotations = asyncio.create_task(write_annotations(plugin, args))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CONTROL_INTERVAL)
            apply_control(plugin, args.control, held)
        annotations.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.standin", description=__doc__)
    parser.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    parser.add_argument("--resource", default="nvidia.com/gpu")
    parser.add_argument("--socket", default="nvidia-gpu.sock")
    parser.add_argument("--gpus", type=int, default=2, help="physical GPUs (each advertised --split times)")
    parser.add_argument("--split", type=int, default=HAMI_SPLIT_COUNT)
    parser.add_argument(
        "--uuid-prefix",
        default=UUID_PREFIX,
        help="GPU UUIDs: GPU-<prefix><4 digits>, the NVIDIA driver's shape (HAMi's split IDs map to them)",
    )
    parser.add_argument("--control", default="/run/hami-standin", help="folder of fault files")
    parser.add_argument(
        "--listen-delay",
        type=float,
        default=0.002,
        help="seconds between binding the socket file and listening on it (Go's net.Listen binds first)",
    )
    parser.add_argument(
        "--retry-interval", type=float, default=30.0, help="seconds before a failed start is tried again"
    )
    parser.add_argument(
        "--faults",
        default=os.environ.get("HAMI_STANDIN_FAULTS", ""),
        help="lasting faults held on, comma-separated (default: $HAMI_STANDIN_FAULTS)",
    )
    parser.add_argument(
        "--annotation-interval",
        type=float,
        default=hamiwriter.INTERVAL,
        help="seconds between rounds of HAMi's node annotation loop after a success (HAMi's 30)",
    )
    parser.add_argument(
        "--annotation-error-interval",
        type=float,
        default=hamiwriter.ERROR_INTERVAL,
        help="seconds before the next round after an error (HAMi's 5)",
    )
    args = parser.parse_args(argv)
    try:
        parse_faults(args.faults)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
