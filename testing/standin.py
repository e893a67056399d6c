"""`python -m testing.standin`: FakeDevicePlugin as a pod's `device-plugin` container.

The node end-to-end tests (tests/node) run it in place of a vendor's HAMi device plugin, which needs the
vendor's hardware. `--vendor NAME` (a profile of hami_guard/profiles; default: the profile that owns
`--resource`, else the default profile, NVIDIA's) picks the plugin it plays: it serves the resource the
vendor's profile registers by default (`--resource`) on the vendor's socket for it in the kubelet's real
device-plugins folder (`--socket`: `nvidia-gpu.sock`, `Ascend910B3.sock`, device-plugin-manager's
`hygon.com_dcunum`, `amd.com_gpu`, `birentech.com_gpu`), with the vendor's device IDs, each of `--gpus`
devices listed `--split` times as its plugin lists shares of it (testing/vendorids.py: NVIDIA's
`<GPU-UUID>-<n>`, Ascend's `<DCMI UUID>-<i>`, DCU's `DCU-<serial>-fake-<i>`, AMD's `<PCI address>#<i>`,
Biren's `card_<N>`, once each). It serves and registers again when `kubelet.sock` is created, as HAMi's
plugins do. Like HAMi's NVIDIA plugin, a refused `Register` stops the plugin (its socket goes) and the whole
start is tried again 30 s later ("Failed to start one or more plugins. Retrying in 30s..." in HAMi's
cmd/device-plugin/nvidia/main.go), and a device once reported Unhealthy on an XID event stays so for the
life of the process (the FIXME in HAMi's nvinternal/plugin/server.go); the other vendors' plugins do the
same here (Ascend's exits instead, device-plugin-manager tries three times 3 s apart: not mirrored).
Faults are files in `--control` (a hostPath the tests write), read twice a second (the lasting ones
applied are then written to `.applied` in the folder), so they outlive a container restart the way a
plugin's bug does:

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
  Go map always does (without it, a new order each round, as Go's map iteration gives HAMi's NVIDIA
  plugin: a round in another order patches a stale annotation again; the other vendors' plugins list
  theirs in one order anyway).

In a Pod (KUBERNETES_SERVICE_HOST and NODE_NAME set), it also writes HAMi's node annotations as the
vendor's plugin does (testing/hamiwriter.py, `Vendor.of`), with the ServiceAccount's token: the register
annotation (`hami.io/node-nvidia-register`, `hami.io/node-register-<commonWord>`, ...) in the format HAMi
decodes for the vendor (JSON, DCU's legacy CSV), and the plugin's `Reported` stamp of the handshake in
the same patch where the plugin writes one (Ascend's, DCU's, Biren's; NVIDIA's and AMD's leave the
handshake to the scheduler's `Requesting_`). After each Register the kubelet accepts (Biren's: each time
the kubelet opens ListAndWatch), a `WatchAndRegister` loop starts with an empty cache: for NVIDIA's, the
GPUs in Go's map order, a new one each round, compared as a string with the cache, the cache written
before the PATCH; for the others, every round patched. `--annotation-interval`,
`--annotation-error-interval`: the plugin's waits after a success and an error (30 s and 5 s; Biren's
heartbeat, 300 s, for both). HAMi's restart on a new `kubelet.sock` builds new plugin objects with a loop
of their own; the stand-in's new loop replaces the old one (HAMi leaves the old one running on its old
plugin objects: not mirrored), so one loop writes, and one failed PATCH sticks (until a round in another
order) as it does in a plugin that never saw a kubelet restart.

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
from collections.abc import Mapping, Sequence

from hami_guard import profiles
from sidecar.watcher import FsEvent
from testing import hamiwriter, vendorids
from testing.plugin import FakeDevicePlugin
from testing.vendorids import Card

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
UUID_PREFIX = vendorids.UUID_PREFIX  # NVIDIA's GPU-<prefix><nnnn>: NVML's UUID shape, 8-4-4-4-12 hex
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


def gpu_view(devices: Mapping[str, str], cards: Sequence[Card]) -> list[hamiwriter.Gpu]:
    """The plugin's own view of its devices, as HAMi's annotation carries them: one entry per card that has
    a share among `devices`, by its annotation ID, healthy while all its shares are."""
    out = []
    for card in cards:
        health = [devices[share] for share in card.shares if share in devices]
        if health:
            out.append(hamiwriter.Gpu(card.annotated, all(h == "Healthy" for h in health), card.custom))
    return out


def take_one_shot(control: str, name: str) -> bool:
    """Whether the one-shot fault file `name` is in `control`, removing it: True once per file."""
    try:
        os.unlink(os.path.join(control, name))
    except OSError:
        return False
    logger.info("%s: this PATCH fails", name)
    return True


def registrar(
    plugin: StandInPlugin, args: argparse.Namespace, cards: Sequence[Card], api: hamiwriter.NodeApi, node: str
) -> hamiwriter.Registrar:
    """The vendor's annotation loop for this plugin's devices, against `api`."""
    vendor = hamiwriter.Vendor.of(args.vendor, args.resource)  # its keys, format, stamp and timing

    def order(n: int) -> Sequence[int]:
        held = plugin.order_held or not vendor.map_order
        return hamiwriter.held_order(n) if held else hamiwriter.go_map_order(n)

    return hamiwriter.Registrar(
        api,
        node,
        lambda: gpu_view(plugin.devices, cards),
        interval=args.annotation_interval,
        error_interval=args.annotation_error_interval,
        fail_patch=lambda: take_one_shot(args.control, ANNOTATION_PATCH_FAILS),
        order=order,
        vendor=vendor,
    )


def loop_starts(plugin: StandInPlugin, vendor: hamiwriter.Vendor) -> int:
    """How many times the plugin's annotation loop has (re)started: at each Register the kubelet accepted,
    or, for a plugin that patches when the kubelet opens ListAndWatch, at each stream opened."""
    return plugin.calls["ListAndWatch"] if vendor.on_list_and_watch else plugin.registrations


async def write_annotations(
    plugin: StandInPlugin,
    args: argparse.Namespace,
    cards: Sequence[Card],
    api: hamiwriter.NodeApi | None = None,
    node: str = "",
) -> None:
    """HAMi's node annotations, written as the vendor's plugin writes them (the module's docstring), until
    cancelled, to `api` and `node` (default: the Pod's API server and NODE_NAME); nothing outside a Pod."""
    api = api or hamiwriter.InCluster.from_environ()
    node = node or hamiwriter.node_name()
    if api is None or not node:
        logger.info("HAMi's node annotation: not written (no KUBERNETES_SERVICE_HOST or no NODE_NAME)")
        return
    writer = registrar(plugin, args, cards, api, node)
    started = 0
    try:
        while True:
            if loop_starts(plugin, writer.vendor) > started:  # a loop with an empty cache
                started = loop_starts(plugin, writer.vendor)
                await writer.restart()
            await asyncio.sleep(CONTROL_INTERVAL)
    finally:
        await writer.stop()


async def serve(args: argparse.Namespace) -> None:
    cards = vendorids.form(args.vendor).cards(args.gpus, args.split, args.resource, args.uuid_prefix)
    devices = [share for card in cards for share in card.shares]
    plugin = StandInPlugin(args.device_plugin_dir, args.resource, args.socket, devices)
    plugin.first_gpu = cards[0].shares if cards else ()
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
        logger.info(
            "serving %s on %s as %s's plugin: %d devices",
            args.resource,
            plugin.socket_path,
            args.vendor,
            len(devices),
        )
        annotations = asyncio.create_task(write_annotations(plugin, args, cards))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CONTROL_INTERVAL)
            apply_control(plugin, args.control, held)
        annotations.cancel()


def resolve(args: argparse.Namespace) -> str | None:
    """Fills the vendor's defaults into `args` (vendor, resource, socket, split, UUID prefix, annotation
    intervals); what is wrong with the flags, or None."""
    chosen = profiles.named(args.vendor) if args.vendor else None
    owner = profiles.for_resource(args.resource) if args.resource else None
    profile = chosen or owner or profiles.DEFAULT
    if chosen is not None and owner is not None and owner is not chosen:
        pattern = owner.resources.pattern
        return f"--resource {args.resource} is {owner.name}'s ({pattern}), not {chosen.name}'s"
    form = vendorids.FORMS.get(profile.name)
    if form is None:
        return f"the stand-in knows no device IDs for the profile {profile.name}"
    if args.uuid_prefix is not None and not form.prefixed:
        return f"--uuid-prefix names NVIDIA GPUs' UUIDs; {profile.name}'s devices have none"
    args.vendor = profile.name
    args.resource = args.resource or profile.resources.default
    args.socket = args.socket or profile.socket_for(args.resource)
    args.split = form.split if args.split is None else args.split
    args.uuid_prefix = UUID_PREFIX if args.uuid_prefix is None else args.uuid_prefix
    try:
        form.cards(args.gpus, args.split, args.resource, args.uuid_prefix)
    except ValueError as e:
        return f"--gpus {args.gpus} --split {args.split}: {e}"
    vendor = hamiwriter.Vendor.of(profile.name, args.resource)
    if args.annotation_interval is None:
        args.annotation_interval = vendor.interval
    if args.annotation_error_interval is None:
        args.annotation_error_interval = vendor.error_interval
    return None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testing.standin", description=__doc__)
    vendors = [p.name for p in profiles.PROFILES]
    parser.add_argument(
        "--vendor",
        choices=vendors,
        help="the vendor's plugin to play, by its profile (default: the one that owns --resource, else "
        f"{profiles.DEFAULT.name})",
    )
    parser.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    parser.add_argument("--resource", help="the resource to register (default: the vendor's default)")
    parser.add_argument("--socket", help="the socket's name (default: the vendor's for --resource)")
    parser.add_argument("--gpus", type=int, default=2, help="physical devices (each listed --split times)")
    parser.add_argument(
        "--split",
        type=int,
        help="kubelet devices per physical device (default: the vendor's plugin's: NVIDIA's and AMD's 10, "
        "Ascend's and DCU's 4, Biren's 1)",
    )
    parser.add_argument(
        "--uuid-prefix",
        help=f"NVIDIA GPU UUIDs: GPU-<prefix><4 digits>, NVML's shape (default {UUID_PREFIX})",
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
        help="seconds between rounds of HAMi's node annotation loop after a success (the plugin's: 30, "
        "Biren's heartbeat 300)",
    )
    parser.add_argument(
        "--annotation-error-interval",
        type=float,
        help="seconds before the next round after an error (the plugin's: 5, Biren's 300)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    try:
        parse_faults(args.faults)
    except ValueError as e:
        parser.error(str(e))
    wrong = resolve(args)
    if wrong:
        parser.error(wrong)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
