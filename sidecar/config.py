"""Settings from flags and their HAMI_GUARD_* twins, checked before any I/O.

`Settings` holds every default; the parser takes its defaults from it, and the flags
from the shared vocabulary (`hami_guard.flags`), so hami-doctor reads the same flags the
same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from hami_guard import flags, profiles
from hami_guard.envflags import env_name, parse_with_env
from hami_guard.flags import ANY_DEVICES, AUTO_DEVICES, DeviceExpectation, Expect, PluginSpec
from hami_guard.node.sockets import DEFAULT_DIR, DEFAULT_KUBELET_PROCESS, DEFAULT_SOCKET
from hami_guard.profiles import DEFAULT as PROFILE
from hami_guard.profiles import NAME, PROFILES, VendorProfile, for_resource
from sidecar.deviceplugin import hamiconfig
from sidecar.deviceplugin.hostdevices import VFIO_DIR
from sidecar.dra.spec import (
    DEFAULT_CA_FILE,
    DEFAULT_REGISTRY,
    DEFAULT_TOKEN_FILE,
    ApiAccess,
    DraSpec,
    dra_spec,
    in_cluster,
)
from sidecar.dra.spec import DEFAULT_GRACE as DEFAULT_DRA_GRACE
from sidecar.kube.access import in_cluster as api_in_cluster

if TYPE_CHECKING:
    from sidecar.watcher import WatchMode

__all__ = [
    "AUTO_DEVICES",
    "BadConfig",
    "DeviceExpectation",
    "Expect",
    "PluginSpec",
    "Settings",
    "build_parser",
    "parse_settings",
    "read_settings",
]

HOST_DEV = "/dev"  # where the host's /dev is: the device globs of the profiles are written under it


def vendor_plugin(profile: VendorProfile) -> PluginSpec:
    """The vendor's default resource and the socket its plugin serves for it."""
    return PluginSpec(profile.resources.default, profile.socket_for(profile.resources.default))


def vendor_glob(profile: VendorProfile, host_dev: str = HOST_DEV) -> str:
    """The vendor's device nodes under `host_dev` (the host's /dev as mounted); "" when it names none."""
    glob, prefix = profile.devices.glob, HOST_DEV + "/"
    if glob.startswith(prefix):
        return host_dev.rstrip("/") + "/" + glob[len(prefix) :]
    return glob


# HAMi's real names (docs/kubelet.md#hami): the default vendor profile's (docs/design.md#profiles).
DEFAULT_PLUGIN = vendor_plugin(PROFILE)
DEFAULT_POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_DEVICE_GLOB = vendor_glob(PROFILE)
# HAMi's annotations of the default resource (the profile's [hami]).
HAMI_REGISTER = PROFILE.register_key(PROFILE.resources.default)
HAMI_HANDSHAKE = PROFILE.handshake_key(PROFILE.resources.default)
# The register annotation's formats the `hami:` check reads (sidecar/hami/annotation.py), each as HAMi
# decodes the vendor's: JSON (UnMarshalNodeDevices) or the legacy CSV (DecodeNodeDevices, Hygon DCU's).
HAMI_READS = ("device-info-json", "device-info-csv")


@dataclass(frozen=True)
class Settings(flags.DeviceFolder):
    """Everything hami-sidecar is told, with every default (the parser takes its defaults from here)."""

    device_plugin_dir: str = DEFAULT_DIR
    kubelet_socket: str = DEFAULT_SOCKET
    # The devices' vendor profile (hami_guard/profiles): the defaults below that are a vendor's follow it.
    vendor: str = PROFILE.name
    vendor_given: bool = False  # --vendor (or its variable) named it: it owns the resources no profile owns
    host_dev: str = HOST_DEV  # where the host's /dev is in this container
    plugins: tuple[PluginSpec, ...] = (DEFAULT_PLUGIN,)
    # --plugin-candidates: the resources this node's plugin may serve, one of which it does (a vendor whose
    # each node serves its own hardware's, one DaemonSet over several kinds). While they are set `plugins`
    # is empty: the sidecar learns which one first (sidecar.deviceplugin.candidates), then judges it
    # (`resolved`).
    plugin_candidates: tuple[PluginSpec, ...] = ()
    pod_resources_socket: str = DEFAULT_POD_RESOURCES
    host: str = "0.0.0.0"
    port: int = PROFILE.free_port()  # 9395 unless the vendor's own containers listen there
    probe_interval: float = 10.0
    probe_timeout: float = 2.0
    registration_grace: float = 60.0
    # At least one healthy device; N; none (0: no devices check); auto: the host's less HAMi's filter.
    expect_devices: DeviceExpectation = ANY_DEVICES
    device_glob: str = DEFAULT_DEVICE_GLOB
    # HAMi's node configuration (its device-plugin ConfigMap's config.json) and this node's name in it.
    hami_config: str = PROFILE.chart.node_config  # "": the vendor's plugin reads none
    node_name: str = ""
    driver_gpus_dir: str = PROFILE.devices.driver_gpus  # the driver's GPUs, with their UUIDs
    vfio_dir: str = VFIO_DIR
    plugin_label: str = "hami"
    log_format: str = "text"
    log_level: str = "INFO"
    watch_mode: WatchMode = "auto"
    polling_interval: float = 1.0
    # How long a vanished plugin socket waits for kubelet.sock's events before the verdict.
    vanish_settle: float = 0.005
    # How long a plugin that removed its own socket has to serve a new one (HAMi does on every
    # kubelet.sock creation) before it counts as stopped.
    plugin_restart_window: float = 0.1
    # How long the kubelet's connection to a plugin must stay lost to be a drop: a kubelet on its way
    # out closes its plugin connections a few ms before its socket goes.
    drop_confirm: float = 0.2
    # The kubelet's process, besides kubelet, k3s and kubelite: its network namespace holds its
    # connections to the plugins (read from /proc/<pid>/net/unix under hostPID).
    kubelet_process_name: str = DEFAULT_KUBELET_PROCESS
    # The kubelet's release (`v1.34.4`, `1.34`), where its binary cannot be read; "": read it there.
    kubelet_version: str = ""
    # How long a later connection to a held plugin may go unrecorded (no device list in the checkpoint)
    # before it is a refused Register: the kubelet records an accepted one within milliseconds, seconds
    # on a loaded node. Readiness only: waiting costs nothing a restart could have saved.
    refusal_confirm: float = 10.0
    # HAMi serves a new socket at once when kubelet.sock is created (and, when that start fails, retries
    # 30 s later): a plugin that served none this long after a new kubelet answered missed the restart
    # and fails at once instead of at the end of the grace. 0: the plugin does not behave so.
    missed_restart_after: float = 5.0
    # Seconds between reads of the kubelet's connections between rounds (the socket table alone): a drop
    # is judged within about this long. 0: only at the rounds.
    connection_interval: float = 1.0
    # HAMi never marks a device healthy again: devices not listed healthy this long (while the host still
    # shows them and no pod holds one) get one plugin restart (sidecar.deviceplugin.recovery). 0: off.
    recover_unhealthy_after: float = 0.0
    # DRA drivers (sidecar.dra.verdicts): judged besides, or instead of, the device plugins.
    dra_drivers: tuple[DraSpec, ...] = ()
    dra_grace: float = DEFAULT_DRA_GRACE
    # The API server to read the node's ResourceSlices from (sidecar.dra.slices); None: never asked.
    dra_api: ApiAccess | None = None
    # HAMi's own registration (sidecar.hami): the `hami:<resource>` checks, read from this node's Node.
    hami_registration: bool = True
    hami_api: ApiAccess | None = None  # None: no API server known (not in a Pod): no check at all
    # (resource, register annotation key) besides the vendor profiles' keys for their resources.
    hami_annotations: tuple[tuple[str, str], ...] = ()
    # The first plugin's vendor's ("" for a vendor without one), unless --hami-handshake-annotation names it.
    hami_handshake_annotation: str = HAMI_HANDSHAKE
    hami_handshake_given: bool = False  # --hami-handshake-annotation (or its variable) was set
    hami_repair: float = 60.0  # HAMi's 30 s loop, its 5 s retry, two of our readings and a margin
    hami_interval: float = 10.0  # at most one GET of the Node this often
    # HAMi's release (the chart's appVersion, filled by the post-renderer; "" unknown), and the first
    # release whose plugin caches its annotation only after the patch ("" none known: up to v2.10.0 none).
    hami_version: str = ""
    hami_cache_fixed_in: str = ""

    @property
    def profile(self) -> VendorProfile:
        """The vendor profile the settings name (`vendor`)."""
        return profiles.named(self.vendor) or PROFILE

    def profile_for(self, resource: str) -> VendorProfile:
        """The profile of a resource: the one that owns it, else the settings' vendor's (a resource the
        chart renamed, `--vendor` naming whose it is)."""
        return for_resource(resource) or self.profile

    def hami_keys(self) -> tuple[tuple[str, str], ...]:
        """(resource, register annotation key) of each configured plugin whose HAMi key is known."""
        return hami_keys(self.plugins, self.hami_annotations, self.profile if self.vendor_given else None)

    def hami_handshake(self, resource: str) -> str:
        """HAMi's handshake annotation of `resource`: the one given, else its vendor's ("" for none)."""
        if self.hami_handshake_given:
            return self.hami_handshake_annotation
        return self.profile_for(resource).handshake_key(resource)

    def resolved(self, plugin: PluginSpec) -> Settings:
        """These settings once this node's plugin is known to serve `plugin`, one of the candidates: as
        if `--plugin` had named it (its HAMi annotations only, its vendor's handshake where none is given)."""
        if plugin not in self.plugin_candidates:
            raise ValueError(f"{plugin.resource}={plugin.socket} is not one of the candidates")
        return dataclasses.replace(
            self,
            plugins=(plugin,),
            plugin_candidates=(),
            hami_annotations=tuple(a for a in self.hami_annotations if a[0] == plugin.resource),
            hami_handshake_annotation=self.hami_handshake(plugin.resource),
        )


def hami_keys(
    plugins: Sequence[PluginSpec], given: Sequence[tuple[str, str]], vendor: VendorProfile | None = None
) -> tuple[tuple[str, str], ...]:
    """(resource, register annotation key) of each plugin whose key is given, or its vendor profile's key
    (the profile that owns the resource, else `vendor`'s) where the `hami:` check reads its format
    (HAMI_READS); other resources have no check."""
    keys = dict(given)
    known = {}
    for p in plugins:
        v = for_resource(p.resource) or vendor
        if v is not None and v.hami.register_format in HAMI_READS:
            known[p.resource] = v.register_key(p.resource)
    return tuple((p.resource, k) for p in plugins if (k := keys.get(p.resource) or known.get(p.resource)))


DEFAULTS = Settings()
PERIOD = flags.seconds(flags.MIN_PERIOD, flags.DAY)  # a probe interval, grace or polling period


def build_parser() -> argparse.ArgumentParser:
    """hami-sidecar's flags: the shared vocabulary's (`hami_guard.flags`) and its own."""
    d = DEFAULTS
    p = flags.Parser(
        prog="hami-sidecar",
        description="Registration health of device plugins for the livenessProbe, operators and Prometheus. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin; a flag wins.",
        parents=[
            flags.socket_flags(device_plugin_dir=d.device_plugin_dir, kubelet_socket=d.kubelet_socket),
            vendor_flags(),
            flags.plugin_flags(
                plugins=d.plugins,
                pod_resources_socket=d.pod_resources_socket,
                probe_timeout=d.probe_timeout,
                device_glob=d.device_glob,
            ),
            flags.kubelet_process_flag(kubelet_process_name=d.kubelet_process_name),
        ],
    )
    p.add_argument(
        "--plugin-candidates",
        action="append",
        type=partial(flags.plugin_spec, example=d.plugins[0]),
        help="RESOURCE=SOCKET, repeatable (the variable: a comma-separated list), instead of --plugin: the "
        "resources this node's plugin may serve, one of them (one DaemonSet over nodes of several kinds of "
        "device, each node's plugin serving its own kind's). The sidecar judges nothing until exactly one "
        "is served by a listener in this pod's network namespace, then judges that one; meanwhile /healthz "
        "200, /readyz 503 saying so. Not with hostNetwork, nor with --dra-driver",
    )
    p.add_argument(
        "--listen",
        type=flags.listen_address,
        help=f"ADDR:PORT (default {d.host}:{d.port}, or the next port the vendor's containers leave free)",
    )
    p.add_argument(
        "--probe-interval",
        type=PERIOD,
        default=d.probe_interval,
        help=f"seconds between probe rounds (default {d.probe_interval:g})",
    )
    p.add_argument(
        "--registration-grace",
        type=PERIOD,
        default=d.registration_grace,
        help=f"seconds a check may stay pending (default {d.registration_grace:g})",
    )
    p.add_argument(
        "--missed-restart-after",
        type=flags.seconds(0.0, flags.DAY),
        default=d.missed_restart_after,
        help="seconds after a kubelet restart within which a plugin must serve a new socket, as HAMi does "
        f"at once, or it missed the restart and fails liveness (default {d.missed_restart_after:g}; 0: a "
        "plugin that does not, the grace alone decides)",
    )
    p.add_argument(
        "--connection-interval",
        type=flags.seconds(0.0, flags.DAY),
        default=d.connection_interval,
        help="seconds between reads of the kubelet's connections to the plugins between probe rounds, so "
        f"that a drop is judged within about this long (default {d.connection_interval:g}; 0: at the "
        "probe rounds only)",
    )
    p.add_argument(
        "--recover-unhealthy-after",
        type=flags.duration(0.0, 30 * flags.DAY),
        default=d.recover_unhealthy_after,
        help="a duration (90s, 10m, 1h): devices HAMi marked unhealthy (it never marks them healthy again), "
        "not listed healthy this long while the host still shows them and no running pod holds one, get "
        "one plugin restart, which re-reads them (default 0: off)",
    )
    p.add_argument(
        "--kubelet-version",
        type=flags.kubelet_version,
        default=d.kubelet_version,
        help="the kubelet's release (v1.34.4 or 1.34) when its binary cannot be read (/proc/<pid>/exe): "
        "the rules that differ between releases follow it (default: read it; unknown: the newest rules)",
    )
    dra_flags(p, d.dra_grace)
    hami_flags(p)
    p.add_argument("--plugin-label", default=d.plugin_label, help="the `plugin` label of the metrics")
    p.add_argument("--log-format", choices=("text", "json"), default=d.log_format)
    p.add_argument(
        "--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default=d.log_level, type=str.upper
    )
    p.add_argument("--watch-mode", choices=("auto", "inotify", "polling"), default=d.watch_mode)
    p.add_argument(
        "--hami-config",
        help="HAMi's node configuration, read for --expect-devices auto: the device plugin's ConfigMap "
        f"(config.json) mounted as in HAMi's own container (default: the vendor's, {d.hami_config} for "
        f"{d.vendor}; none for a vendor whose plugin reads none)",
    )
    p.add_argument(
        "--node-name",
        default=d.node_name,
        help=f"this node's name in HAMi's node configuration (default: ${hamiconfig.NODE_NAME_ENV}, as "
        "HAMi's pod sets it from spec.nodeName)",
    )
    p.add_argument(
        "--polling-interval",
        type=PERIOD,
        default=d.polling_interval,
        help=f"period of the polling fallback (default {d.polling_interval:g})",
    )
    return p


def dra_flags(p: argparse.ArgumentParser, grace: float | None) -> None:
    """The DRA drivers' flags (the sidecar's and hami-doctor's); `grace` None: no --dra-grace."""
    p.add_argument(
        "--dra-driver",
        action="append",
        help="NAME[=SOCKET], repeatable: a DRA driver and its registration socket (a path, or a file "
        "in --dra-registry-dir; default NAME-reg.sock). Without --plugin, DRA drivers only",
    )
    p.add_argument(
        "--dra-service",
        action="append",
        help="NAME=PATH, repeatable: a DRA driver's service socket, when not the one its GetInfo names",
    )
    p.add_argument("--dra-registry-dir", default=DEFAULT_REGISTRY, help=f"default {DEFAULT_REGISTRY}")
    if grace is not None:
        p.add_argument(
            "--dra-grace",
            type=PERIOD,
            default=grace,
            help=f"seconds a DRA driver may stay unregistered (default {grace:g}: the kubelet retries "
            "a refused registration up to 2 min 2 s apart)",
        )
    p.add_argument(
        "--dra-resourceslices",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="read the node's ResourceSlices of each DRA driver from the API server (needs --node-name "
        "and a ServiceAccount allowed to list resourceslices): evidence in the reasons, never a "
        "verdict; off by default, and then the API is never called",
    )
    p.add_argument(
        "--kube-api-server",
        default="",
        help="the API server for --dra-resourceslices and HAMi's registration (default: the Pod's "
        "KUBERNETES_SERVICE_HOST/PORT)",
    )
    p.add_argument("--kube-token-file", default=DEFAULT_TOKEN_FILE, help=f"default {DEFAULT_TOKEN_FILE}")
    p.add_argument("--kube-ca-file", default=DEFAULT_CA_FILE, help=f"default {DEFAULT_CA_FILE}")


def hami_flags(p: argparse.ArgumentParser, *, timing: bool = True) -> None:
    """HAMi's own registration (sidecar.hami): on by default wherever an API server is known. `timing`
    False: not --hami-repair and --hami-interval (hami-doctor reads once)."""
    d = DEFAULTS
    p.add_argument(
        "--hami-registration",
        action=argparse.BooleanOptionalAction,
        default=d.hami_registration,
        help="judge HAMi's own registration: this node's Node annotations against the kubelet's devices "
        "(GET nodes/<node> with --kube-token-file, default on; --no-hami-registration, "
        "HAMI_GUARD_HAMI_REGISTRATION=false: off, and the API is never called for it)",
    )
    p.add_argument(
        "--hami-annotation",
        action="append",
        help="RESOURCE=KEY, repeatable: HAMi's register annotation of a resource (default "
        f"{_profile_keys()}; other vendors have keys of their own)",
    )
    p.add_argument(
        "--hami-handshake-annotation",
        help="HAMi's scheduler handshake annotation (default: the vendor's for each resource, "
        f"{d.hami_handshake_annotation} for {d.plugins[0].resource})",
    )
    p.add_argument(
        "--hami-version",
        default="",
        help="HAMi's release, e.g. v2.10.0 (the post-renderer fills it from the chart's appVersion; "
        "default unknown): with --hami-cache-fixed-in, whether a stale annotation is HAMi's own retry",
    )
    p.add_argument(
        "--hami-cache-fixed-in",
        default="",
        help="the first HAMi release whose plugin caches its annotation only after the patch succeeds "
        "(default none known: no release up to v2.10.0 does); from it on a stale annotation fails "
        "readiness only",
    )
    if not timing:
        return
    p.add_argument(
        "--hami-repair",
        type=PERIOD,
        default=d.hami_repair,
        help=f"seconds the annotation may differ from the kubelet's devices before it is HAMi's stuck patch "
        f"(default {d.hami_repair:g}: HAMi's loop rewrites a change within 30 s)",
    )
    p.add_argument(
        "--hami-interval",
        type=PERIOD,
        default=d.hami_interval,
        help=f"seconds between two GETs of the Node (default {d.hami_interval:g})",
    )


def vendor_flags() -> argparse.ArgumentParser:
    """--vendor and --host-dev, with the profiles' names (hami-sidecar, hami-doctor)."""
    return flags.vendor_flags(vendors=[p.name for p in PROFILES], default=PROFILE.name, host_dev=HOST_DEV)


@dataclass(frozen=True)
class Vendor:
    """What the vendor flags and --plugin give: the profile, the plugins, the device glob."""

    profile: VendorProfile
    given: bool  # --vendor named it (else it follows the resources, or is the default)
    plugins: tuple[PluginSpec, ...]
    device_glob: str
    candidates: tuple[PluginSpec, ...] = ()  # --plugin-candidates (two or more; then no plugins yet)


def vendor_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, dra: bool) -> Vendor:
    """The vendor (--vendor, else the profile of the --plugin resources, else the default's), the plugins
    (--plugin, else the vendor's default; none with DRA drivers alone) and the device glob (--device-glob,
    else the vendor's under --host-dev). A usage error where the vendor's defaults do not fit."""
    given = tuple(args.plugin or ())
    candidates = plugin_candidates(parser, args, given, dra)
    if args.vendor:
        profile = profiles.named(args.vendor) or PROFILE
    else:
        named = given or candidates
        profile = next((v for p in named if (v := for_resource(p.resource)) is not None), PROFILE)
    if not given and not candidates and not dra and profile.resources.per_node:
        r = profile.resources
        several = " (or the chart's, --plugin-candidates)" if hasattr(args, "plugin_candidates") else ""
        parser.error(
            f"--plugin: each node's {profile.vendor} plugin registers the resource of its own hardware "
            f"({profile.shown(r.pattern)} on {profile.shown(r.socket)}): name this node's{several}, e.g. "
            f"--plugin {r.default}={profile.socket_for(r.default)}"
        )
    if len(candidates) == 1:  # one candidate is the plugin
        given, candidates = candidates, ()
    plugins = given or (() if dra or candidates else (vendor_plugin(profile),))
    if not args.host_dev.startswith("/"):
        parser.error(f"--host-dev {args.host_dev!r}: an absolute path")
    glob = args.device_glob or vendor_glob(profile, args.host_dev)
    if args.expect_devices == AUTO_DEVICES and not glob:
        parser.error(
            f"--expect-devices auto: the {profile.vendor} profile names no device nodes to count; set "
            "--device-glob, or --expect-devices N"
        )
    return Vendor(profile, bool(args.vendor), plugins, glob, candidates)


def plugin_candidates(
    parser: argparse.ArgumentParser, args: argparse.Namespace, given: Sequence[PluginSpec], dra: bool
) -> tuple[PluginSpec, ...]:
    """--plugin-candidates, checked: never with --plugin or DRA drivers, each resource and each socket once,
    all of one vendor profile (or all of none)."""
    candidates = tuple(getattr(args, "plugin_candidates", None) or ())
    if not candidates:
        return ()
    if given:
        parser.error(
            "--plugin-candidates with --plugin: name this node's resource, or the candidates, not both"
        )
    if dra:
        parser.error(
            "--plugin-candidates with --dra-driver: the DRA drivers are judged from the start, the device "
            "plugin only once it is known; name the device plugin's resource with --plugin"
        )
    for what, values in (
        ("resource", [c.resource for c in candidates]),
        ("socket", [c.socket for c in candidates]),
    ):
        if len(set(values)) != len(values):
            parser.error(f"--plugin-candidates: a {what} is named twice: {', '.join(values)}")
    # The settings a vendor's defaults make (the port, the device glob, the expected devices, the doctor's
    # process and logs) are made once, for one profile, and kept once a candidate is chosen: candidates of
    # two profiles would judge one vendor's plugin by the other's.
    owners = {
        c.resource: (v.name if (v := for_resource(c.resource)) else "no vendor profile") for c in candidates
    }
    if len(set(owners.values())) > 1:
        shown = ", ".join(f"{r} ({o})" for r, o in owners.items())
        parser.error(f"--plugin-candidates: all of one vendor profile, or all of none; got {shown}")
    return candidates


def _profile_keys() -> str:
    """The vendor profiles' register annotations, for --hami-annotation's help."""
    keys = (f"{p.hami.register} for {p.resources.pattern.replace(NAME, '*')} resources" for p in PROFILES)
    return ", ".join(keys)


@dataclass(frozen=True)
class HamiSettings:
    """The hami_* fields of `Settings`, as the flags give them."""

    registration: bool
    api: ApiAccess | None
    annotations: tuple[tuple[str, str], ...]
    handshake: str
    handshake_given: bool
    repair: float
    interval: float
    version: str = ""
    cache_fixed_in: str = ""


def hami_settings(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    environ: Mapping[str, str] | None,
    plugins: Sequence[PluginSpec],
    vendor: VendorProfile = PROFILE,
    *,
    candidates: Sequence[PluginSpec] = (),
) -> HamiSettings:
    """The hami_* settings of the parsed flags (a usage error on a bad one); the handshake's default is
    the first plugin's vendor's (`vendor` where no profile owns it). `candidates`: --plugin-candidates,
    whose resources --hami-annotation may name too."""
    d = DEFAULTS
    pairs = []
    for value in args.hami_annotation or ():
        resource, _, key = value.strip().partition("=")
        if (
            not resource
            or not key
            or resource not in {p.resource for p in (*plugins, *candidates)}
            or any(c.isspace() for c in key)
        ):
            parser.error(f"--hami-annotation: expected RESOURCE=KEY of a --plugin resource, got {value!r}")
        pairs.append((resource, key))
    server = args.kube_api_server or api_in_cluster(os.environ if environ is None else environ)
    if server and not server.startswith("https://"):
        parser.error(f"--kube-api-server {server!r}: an https:// address (the token is sent to it)")
    api = (
        ApiAccess(server, args.kube_token_file, args.kube_ca_file)
        if server and args.hami_registration
        else None
    )
    given = args.hami_handshake_annotation is not None
    first = plugins[0].resource if plugins else vendor.resources.default
    handshake = (
        args.hami_handshake_annotation if given else (for_resource(first) or vendor).handshake_key(first)
    )
    return HamiSettings(
        args.hami_registration,
        api,
        tuple(pairs),
        handshake,
        given,
        getattr(args, "hami_repair", d.hami_repair),
        getattr(args, "hami_interval", d.hami_interval),
        (args.hami_version or "").strip()[:64],
        (args.hami_cache_fixed_in or "").strip()[:64],
    )


def dra_drivers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[DraSpec, ...]:
    """The --dra-driver and --dra-service flags' drivers (a usage error on a bad one)."""
    specs: dict[str, DraSpec] = {}
    for value in args.dra_driver or ():
        try:
            spec = dra_spec(value, args.dra_registry_dir)
        except ValueError as e:
            parser.error(f"--dra-driver: {e}")
        if spec.name in specs:
            parser.error(f"--dra-driver: {spec.name} is named twice")
        specs[spec.name] = spec
    for value in args.dra_service or ():
        name, _, path = value.strip().partition("=")
        if name not in specs or not path.startswith("/"):
            parser.error(f"--dra-service: expected NAME=/absolute/path of a --dra-driver, got {value!r}")
        specs[name] = DraSpec(name, specs[name].registration, path)
    return tuple(specs.values())


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Settings, or a one-line usage error on stderr and exit 2 (SystemExit)."""
    return _parse(argv, environ, raise_errors=False)


def _parse(argv: Sequence[str], environ: Mapping[str, str] | None, *, raise_errors: bool) -> Settings:
    parser = build_parser()
    assert isinstance(parser, flags.Parser)
    parser.raise_errors = raise_errors
    args = parse_with_env(parser, argv, environ)
    if args.probe_timeout >= args.probe_interval:
        timeout, interval = args.probe_timeout, args.probe_interval
        parser.error(f"--probe-timeout ({timeout:g}s) must be below --probe-interval ({interval:g}s)")
    dra = dra_drivers(parser, args)
    vendor = vendor_settings(parser, args, bool(dra))
    plugins = vendor.plugins
    resources = [p.resource for p in plugins]
    if len(set(resources)) != len(resources):
        parser.error(f"--plugin: a resource is named twice: {', '.join(resources)}")
    hami = hami_settings(parser, args, environ, plugins, vendor.profile, candidates=vendor.candidates)
    host, port = args.listen or (DEFAULTS.host, vendor.profile.free_port())
    return Settings(
        device_plugin_dir=args.device_plugin_dir,
        kubelet_socket=args.kubelet_socket,
        vendor=vendor.profile.name,
        vendor_given=vendor.given,
        host_dev=args.host_dev,
        plugins=plugins,
        plugin_candidates=vendor.candidates,
        pod_resources_socket=args.pod_resources_socket,
        host=host,
        port=port,
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_timeout,
        registration_grace=args.registration_grace,
        expect_devices=args.expect_devices,
        device_glob=vendor.device_glob,
        hami_config=vendor.profile.chart.node_config if args.hami_config is None else args.hami_config,
        driver_gpus_dir=vendor.profile.devices.driver_gpus,
        node_name=args.node_name
        or (os.environ if environ is None else environ).get(hamiconfig.NODE_NAME_ENV, ""),
        plugin_label=args.plugin_label,
        log_format=args.log_format,
        log_level=args.log_level,
        watch_mode=args.watch_mode,
        polling_interval=args.polling_interval,
        kubelet_process_name=args.kubelet_process_name,
        kubelet_version=args.kubelet_version,
        missed_restart_after=args.missed_restart_after,
        connection_interval=args.connection_interval,
        recover_unhealthy_after=args.recover_unhealthy_after,
        dra_drivers=dra,
        dra_grace=args.dra_grace,
        dra_api=dra_api(parser, args, environ),
        hami_registration=hami.registration,
        hami_api=hami.api,
        hami_annotations=hami.annotations,
        hami_handshake_annotation=hami.handshake,
        hami_handshake_given=hami.handshake_given,
        hami_repair=hami.repair,
        hami_interval=hami.interval,
        hami_version=hami.version,
        hami_cache_fixed_in=hami.cache_fixed_in,
    )


def dra_api(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str] | None
) -> ApiAccess | None:
    """--dra-resourceslices' API server (a usage error on a bad one); None when not asked for."""
    if not args.dra_resourceslices:
        return None
    server = args.kube_api_server or in_cluster(os.environ if environ is None else environ)
    if not server:
        parser.error("--dra-resourceslices: no --kube-api-server and no KUBERNETES_SERVICE_HOST/PORT")
    if not server.startswith("https://"):
        parser.error(f"--kube-api-server {server!r}: an https:// address (the token is sent to it)")
    return ApiAccess(server, args.kube_token_file, args.kube_ca_file)


@dataclass(frozen=True)
class BadConfig:
    """Flags or variables that do not make Settings: what hami-sidecar serves instead of judging.

    The sidecar must not exit on them (the plugin's livenessProbe points at its port: an exit that
    crash-loops would restart a healthy plugin); it serves the error where it can be seen.
    """

    error: str  # the usage error, one line: `hami-sidecar: error: ...`
    host: str
    port: int
    listen_note: str  # why host:port are the defaults; "" when --listen (or its variable) was read
    log_format: str
    log_level: str


def read_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings | BadConfig:
    """Settings, or what could be read of a bad configuration. `--help` prints and exits 0 as ever."""
    environ = os.environ if environ is None else environ
    if any(a in ("-h", "--help") for a in _before_separator(argv)):
        build_parser().parse_args(["--help"])
    try:
        return _parse(argv, environ, raise_errors=True)
    except flags.UsageError as e:
        return _salvage(str(e), argv, environ)


def _before_separator(argv: Sequence[str]) -> list[str]:
    return list(argv[: argv.index("--")] if "--" in argv else argv)


def _given(argv: Sequence[str], flag: str, environ: Mapping[str, str]) -> str | None:
    """The value a flag was given (its last `--flag VALUE` or `--flag=VALUE`), else its variable's."""
    value = None
    args = _before_separator(argv)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value if value is not None else (environ.get(env_name(flag)) or None)


def _salvage(error: str, argv: Sequence[str], environ: Mapping[str, str]) -> BadConfig:
    """Of a configuration with an error, what serving it needs: the address, the log's format and level."""
    d = DEFAULTS
    vendor = profiles.named(_given(argv, "--vendor", environ) or "") or PROFILE
    host, port, note = d.host, vendor.free_port(), ""
    listen = _given(argv, "--listen", environ)
    if listen is not None:
        try:
            host, port = flags.listen_address(listen)
        except (argparse.ArgumentTypeError, ValueError):
            shown = flags.one_line(repr(listen))
            note = f"--listen {shown} is not ADDR:PORT: serving on the default {host}:{port}"
    log_format = _given(argv, "--log-format", environ)
    log_level = (_given(argv, "--log-level", environ) or "").upper()
    return BadConfig(
        error=error,
        host=host,
        port=port,
        listen_note=note,
        log_format=log_format if log_format in ("text", "json") else d.log_format,
        log_level=log_level if log_level in ("DEBUG", "INFO", "WARNING", "ERROR") else d.log_level,
    )
