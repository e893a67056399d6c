"""Settings from flags and their HAMI_GUARD_* twins, checked before any I/O."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from initcheck.checks import DEFAULT_DIR, DEFAULT_SOCKET
from initcheck.envflags import parse_with_env

if TYPE_CHECKING:
    from sidecar.watcher import WatchMode

# HAMi's real names (KUBELET-FACTS.md section 5).
DEFAULT_PLUGIN = "nvidia.com/gpu=nvidia-gpu.sock"
DEFAULT_POD_RESOURCES = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_DEVICE_GLOB = "/dev/nvidia[0-9]*"


@dataclass(frozen=True)
class PluginSpec:
    resource: str
    socket: str  # file name in the device-plugins folder


@dataclass(frozen=True)
class Settings:
    device_plugin_dir: str = DEFAULT_DIR
    kubelet_socket: str = DEFAULT_SOCKET
    plugins: tuple[PluginSpec, ...] = (PluginSpec("nvidia.com/gpu", "nvidia-gpu.sock"),)
    pod_resources_socket: str = DEFAULT_POD_RESOURCES
    host: str = "0.0.0.0"
    port: int = 9395
    probe_interval: float = 10.0
    probe_timeout: float = 2.0
    registration_grace: float = 60.0
    expect_devices: int | None = None  # None: no devices check; -1: auto (count host device nodes)
    device_glob: str = DEFAULT_DEVICE_GLOB
    plugin_label: str = "hami"
    log_format: str = "text"
    log_level: str = "INFO"
    watch_mode: WatchMode = "auto"
    polling_interval: float = 1.0
    # How long a vanished plugin socket waits for kubelet.sock's events before the verdict.
    vanish_settle: float = 0.005

    @property
    def kubelet_path(self) -> str:
        return os.path.join(self.device_plugin_dir, self.kubelet_socket)

    def plugin_path(self, plugin: PluginSpec) -> str:
        return os.path.join(self.device_plugin_dir, plugin.socket)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 < seconds <= 86400:
        raise argparse.ArgumentTypeError(f"expected 0 < seconds <= 86400, got {value!r}")
    return seconds


def _plugin(value: str) -> PluginSpec:
    resource, sep, sock = value.partition("=")
    if not sep or "/" not in resource or not sock or "/" in sock:
        raise argparse.ArgumentTypeError(
            f"expected RESOURCE=SOCKET (nvidia.com/gpu=nvidia-gpu.sock), got {value!r}"
        )
    return PluginSpec(resource, sock)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT (0.0.0.0:9395), got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _expect(value: str) -> int:
    if value == "auto":
        return -1
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hami-sidecar",
        description="Registration health of device plugins for the livenessProbe, operators and Prometheus. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin; a flag wins.",
    )
    p.add_argument("--device-plugin-dir", default=DEFAULT_DIR)
    p.add_argument("--kubelet-socket", default=DEFAULT_SOCKET, help="name in the folder")
    p.add_argument(
        "--plugin",
        action="append",
        type=_plugin,
        help=f"RESOURCE=SOCKET, repeatable (default {DEFAULT_PLUGIN}); "
        "the variable takes a comma-separated list",
    )
    p.add_argument("--pod-resources-socket", default=DEFAULT_POD_RESOURCES, help="used only if present")
    p.add_argument(
        "--listen", type=_listen, default=("0.0.0.0", 9395), help="ADDR:PORT (default 0.0.0.0:9395)"
    )
    p.add_argument("--probe-interval", type=_seconds, default=10.0)
    p.add_argument("--probe-timeout", type=_seconds, default=2.0)
    p.add_argument("--registration-grace", type=_seconds, default=60.0)
    p.add_argument("--expect-devices", type=_expect, help="N, or auto: count --device-glob on the host")
    p.add_argument("--device-glob", default=DEFAULT_DEVICE_GLOB)
    p.add_argument("--plugin-label", default="hami", help="the `plugin` label of the metrics")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument(
        "--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO", type=str.upper
    )
    p.add_argument("--watch-mode", choices=("auto", "inotify", "polling"), default="auto")
    p.add_argument("--polling-interval", type=_seconds, default=1.0, help="period of the polling fallback")
    return p


def parse_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    parser = build_parser()
    args = parse_with_env(parser, argv, environ)
    if args.probe_timeout >= args.probe_interval:
        timeout, interval = args.probe_timeout, args.probe_interval
        parser.error(f"--probe-timeout ({timeout:g}s) must be below --probe-interval ({interval:g}s)")
    plugins = tuple(args.plugin or [_plugin(DEFAULT_PLUGIN)])
    resources = [p.resource for p in plugins]
    if len(set(resources)) != len(resources):
        parser.error(f"--plugin: a resource is named twice: {', '.join(resources)}")
    return Settings(
        device_plugin_dir=args.device_plugin_dir,
        kubelet_socket=args.kubelet_socket,
        plugins=plugins,
        pod_resources_socket=args.pod_resources_socket,
        host=args.listen[0],
        port=args.listen[1],
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_timeout,
        registration_grace=args.registration_grace,
        expect_devices=args.expect_devices,
        device_glob=args.device_glob,
        plugin_label=args.plugin_label,
        log_format=args.log_format,
        log_level=args.log_level,
        watch_mode=args.watch_mode,
        polling_interval=args.polling_interval,
    )
