"""hami-doctor's settings: the sidecar's and initcheck's flags (the shared vocabulary), and its own.

Defaults the doctor shares with the sidecar come from `sidecar.config.Settings`, so the two
cannot drift; the rest are here, each once.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

from hami_guard import flags, profiles
from hami_guard.envflags import parse_with_env
from hami_guard.flags import PluginSpec
from hami_guard.node.sockets import DEFAULT_KUBELET_PROCESS
from hami_guard.profiles import DEFAULT as DEFAULT_PROFILE
from hami_guard.profiles import VendorProfile
from sidecar.config import DEFAULTS as SIDECAR
from sidecar.config import (
    dra_api,
    dra_drivers,
    dra_flags,
    hami_flags,
    hami_keys,
    hami_settings,
    vendor_flags,
    vendor_settings,
)
from sidecar.deviceplugin.hamiconfig import NODE_NAME_ENV
from sidecar.dra.spec import ApiAccess, DraSpec
from sidecar.kube.access import KubeconfigError, from_kubeconfig

Output = Literal["text", "json"]


@dataclass(frozen=True)
class DoctorSettings(flags.DeviceFolder):
    """hami-doctor's settings, parsed from its flags and their environment variables."""

    device_plugin_dir: str = SIDECAR.device_plugin_dir
    kubelet_socket: str = SIDECAR.kubelet_socket
    vendor: str = SIDECAR.vendor  # the devices' vendor profile: the defaults that are a vendor's follow it
    plugins: tuple[PluginSpec, ...] = SIDECAR.plugins
    # --plugin-candidates (two or more; `plugins` empty then): the resources this node's plugin may serve,
    # of which the doctor first decides which (doctor/candidates.py), then judges those as `plugins`.
    plugin_candidates: tuple[PluginSpec, ...] = ()
    pod_resources_socket: str = SIDECAR.pod_resources_socket
    probe_timeout: float = SIDECAR.probe_timeout
    expect_devices: flags.DeviceExpectation = SIDECAR.expect_devices  # ANY: no devices check; AUTO: the glob
    device_glob: str = SIDECAR.device_glob
    plugin_uid: int | None = None  # None: this process's
    plugin_gid: int | None = None
    expect_owner: int | None = None  # None: not checked
    expect_group: int | None = None
    expect_mode: int | None = None
    kubelet_log: str = "auto"  # a file; journal (the kubelet's units); auto (journal, and RKE2's file)
    plugin_log: str = "auto"  # a file, or auto (the newest /var/log/pods/*device-plugin* log)
    since: float = 3600.0
    kubelet_process_name: str = DEFAULT_KUBELET_PROCESS
    plugin_process_name: str = DEFAULT_PROFILE.doctor.process
    sample_interval: float = 2.0
    rss_growth_mib: float = 20.0
    output: Output = "text"
    fix: bool = False
    npd: bool = False
    dra_drivers: tuple[DraSpec, ...] = ()  # DRA drivers to diagnose (doctor/dra/)
    # --dra-resourceslices: the API server to read the node's ResourceSlices from, and the node's name
    # ($NODE_NAME, else the host's name); None: the API is never called.
    dra_api: ApiAccess | None = None
    dra_node: str = ""
    # HAMi's own registration (doctor/hami.py): the API server (--kubeconfig, else the Pod's), the
    # resources' register annotations, the handshake's, and the node's name; None: not read.
    hami_api: ApiAccess | None = None
    hami_keys: tuple[tuple[str, str], ...] = SIDECAR.hami_keys()
    hami_handshake: str = SIDECAR.hami_handshake_annotation
    node_name: str = ""
    # hami-sidecar's /status, for what it did for GPUs HAMi marked unhealthy; "": not asked. Its port is
    # the sidecar's default for the vendor.
    sidecar_status: str = f"http://127.0.0.1:{SIDECAR.port}/status"

    @property
    def profile(self) -> VendorProfile:
        """The vendor profile the settings name (`vendor`): its log patterns, its driver, its texts."""
        return profiles.named(self.vendor) or DEFAULT_PROFILE

    def judging(self, plugins: Sequence[PluginSpec]) -> DoctorSettings:
        """These settings once the candidates `plugins` are decided on: as if --plugin had named them
        (HAMi's annotations of those resources only)."""
        if not set(plugins) <= set(self.plugin_candidates):
            raise ValueError(f"{', '.join(p.resource for p in plugins)}: not among the candidates")
        mine = {p.resource for p in plugins}
        keys = tuple((r, k) for r, k in self.hami_keys if r in mine)
        return replace(
            self,
            plugins=tuple(plugins),
            plugin_candidates=(),
            hami_keys=keys,
            hami_api=self.hami_api if keys else None,
            node_name=self.node_name if keys else "",
        )


DEFAULTS = DoctorSettings()
MAX_SINCE = 3650 * flags.DAY


def build_parser() -> argparse.ArgumentParser:
    """hami-doctor's flags: the sidecar's and initcheck's shared ones, then its own."""
    d = DEFAULTS
    p = flags.Parser(
        prog="hami-doctor",
        description="Diagnose why this node shows no GPU resource, and print the fix. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin; a flag wins.",
        epilog="exit codes: 0 healthy, 1 a problem was found, 2 usage error (with --npd: 2 unknown)",
        parents=[
            flags.socket_flags(device_plugin_dir=d.device_plugin_dir, kubelet_socket=d.kubelet_socket),
            vendor_flags(),
            flags.plugin_flags(
                plugins=d.plugins,
                pod_resources_socket=d.pod_resources_socket,
                probe_timeout=d.probe_timeout,
                device_glob=d.device_glob,
            ),
            flags.identity_flags(),
            flags.kubelet_process_flag(kubelet_process_name=d.kubelet_process_name),
        ],
    )
    p.add_argument(
        "--plugin-candidates",
        action="append",
        type=partial(flags.plugin_spec, example=SIDECAR.plugins[0]),
        help="RESOURCE=SOCKET, repeatable (the variable: a comma-separated list), instead of --plugin: the "
        "resources this node's plugin may serve, one of them (one DaemonSet over nodes of several kinds of "
        "device). The doctor judges the one whose socket file (not a link) a listener accepts connections "
        "on; several such: each; none: the one the kubelet's records name, else one problem row saying so",
    )
    p.add_argument(
        "--kubelet-log",
        default=d.kubelet_log,
        help="a file; journal (units kubelet, k3s, k3s-agent, snap.microk8s.daemon-kubelite); or auto "
        "(default: the journal, and RKE2's kubelet.log when present)",
    )
    p.add_argument(
        "--plugin-log", default=d.plugin_log, help="a file, or auto (/var/log/pods/*device-plugin*)"
    )
    p.add_argument(
        "--since",
        type=flags.duration(0.0, MAX_SINCE),
        default=d.since,
        help="log window: 90s, 30m, 2h, 7d (default 1h)",
    )
    p.add_argument(
        "--plugin-process-name",
        help=f"the plugin's process name (default: the vendor's, {d.plugin_process_name} for {d.vendor})",
    )
    p.add_argument(
        "--sample-interval",
        type=flags.seconds(0.0, 3600.0),
        default=d.sample_interval,
        help=f"seconds between two samples of the plugin process (default {d.sample_interval:g})",
    )
    p.add_argument(
        "--rss-growth-mib",
        type=flags.number(0.1, 1024.0 * 1024.0),
        default=d.rss_growth_mib,
        help=f"RSS growth between the samples that is a problem (default {d.rss_growth_mib:g})",
    )
    p.add_argument("--output", choices=("text", "json"), default=d.output)
    p.add_argument("--fix", action="store_true", help="apply the safe repairs the report lists")
    p.add_argument("--npd", action="store_true", help="one line and node-problem-detector's exit codes")
    dra_flags(p, None)
    hami_flags(p, timing=False)
    p.add_argument(
        "--kubeconfig",
        default="",
        help="read this node's Node (HAMi's registration) and, with --dra-resourceslices, its ResourceSlices "
        "with this kubeconfig's current context instead of the Pod's ServiceAccount; on a node, the "
        "kubelet's own (/etc/kubernetes/kubelet.conf) may read them",
    )
    p.add_argument("--kube-context", default="", help="the kubeconfig's context (default its current one)")
    p.add_argument(
        "--sidecar-status",
        help="hami-sidecar's /status (http://), read for what it did for GPUs HAMi marked unhealthy "
        f"(default {d.sidecar_status}, on the vendor's sidecar port: the sidecar in this pod's network "
        'namespace; "": not read)',
    )
    return p


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> DoctorSettings:
    """The settings from `argv` and the HAMI_GUARD_* variables of `environ` (the process's when None)."""
    parser = build_parser()
    args = parse_with_env(parser, argv, environ)
    dra = dra_drivers(parser, args)
    vendor = vendor_settings(parser, args, bool(dra))
    plugins = vendor.plugins
    hami = hami_settings(parser, args, environ, plugins, vendor.profile, candidates=vendor.candidates)
    # --kubeconfig serves every route of the API the doctor takes (HAMi's registration, the ResourceSlices).
    kube = None
    if args.kubeconfig and (hami.registration or args.dra_resourceslices):
        try:
            kube = from_kubeconfig(args.kubeconfig, args.kube_context)
        except KubeconfigError as e:
            parser.error(f"--kubeconfig: {e}")
    api = kube if kube is not None and args.dra_resourceslices else dra_api(parser, args, environ)
    hami_api = kube if kube is not None and hami.registration else hami.api
    # With candidates, every candidate's keys: those of the judged ones are kept (`judging`).
    keys = hami_keys(plugins or vendor.candidates, hami.annotations, vendor.profile if vendor.given else None)
    status = args.sidecar_status
    if status is None:
        status = f"http://127.0.0.1:{vendor.profile.free_port()}/status"
    node = (os.environ if environ is None else environ).get(NODE_NAME_ENV, "") or socket.gethostname()
    return DoctorSettings(
        device_plugin_dir=args.device_plugin_dir,
        kubelet_socket=args.kubelet_socket,
        vendor=vendor.profile.name,
        plugins=plugins,
        plugin_candidates=vendor.candidates,
        pod_resources_socket=args.pod_resources_socket,
        probe_timeout=args.probe_timeout,
        expect_devices=args.expect_devices,
        device_glob=vendor.device_glob,
        plugin_uid=args.plugin_uid,
        plugin_gid=args.plugin_gid,
        expect_owner=args.expect_owner,
        expect_group=args.expect_group,
        expect_mode=args.expect_mode,
        kubelet_log=args.kubelet_log,
        plugin_log=args.plugin_log,
        since=args.since,
        kubelet_process_name=args.kubelet_process_name,
        plugin_process_name=args.plugin_process_name or vendor.profile.doctor.process,
        sample_interval=args.sample_interval,
        rss_growth_mib=args.rss_growth_mib,
        output=args.output,
        fix=args.fix,
        npd=args.npd,
        dra_drivers=dra,
        dra_api=api,
        dra_node=node if api else "",
        hami_api=hami_api if keys else None,
        hami_keys=keys,
        hami_handshake=hami.handshake,
        node_name=node if hami_api and keys else "",
        sidecar_status=status,
    )
