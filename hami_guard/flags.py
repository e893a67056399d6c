"""The argument vocabulary of hami-initcheck, hami-sidecar and hami-doctor: value types and flag groups.

Standard library only, because initcheck imports it at every plugin start and never
imports `sidecar`. A value type raises `argparse.ArgumentTypeError` with what it
expected; argparse puts the flag's name in front of it, and `hami_guard.envflags` the
variable's. Every numeric type has a range. A flag group is a parent parser built
afresh on each call, with the defaults its caller passes: the defaults live with each
program's settings, never here (docs/design.md#flags).
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, NoReturn

from hami_guard.node.sockets import DEFAULT_SOCKET

DAY = 86400.0
# The shortest probe timeout or polling period worth asking for: below a few
# milliseconds a probe cannot finish and a poll loop only burns a core.
MIN_PERIOD = 0.005
MAX_ID = 2**32 - 2  # uid_t and gid_t: (uid_t)-1 means "unchanged" to the kernel
MAX_DEVICES = 65536


class PluginSpec(NamedTuple):
    """One device plugin: the resource it registers and its socket's name in the device-plugins folder."""

    resource: str
    socket: str


def one_line(text: str) -> str:
    """Control characters (a newline in an argument or a file name) shown escaped: one line stays one."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class UsageError(Exception):
    """A usage error, from a Parser whose `raise_errors` is set: its one-line text, `prog: error: ...`."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, `prog: error: ...`, exit 2.

    The arguments argparse echoes (`unrecognized arguments: ...`) are escaped: an argument holding a
    newline cannot put a line of its own on stderr. With `raise_errors`, a usage error raises
    UsageError instead of exiting (hami-sidecar serves its configuration error rather than exit).
    """

    raise_errors = False

    def error(self, message: str) -> NoReturn:
        text = f"{self.prog}: error: {one_line(message)}"
        if self.raise_errors:
            raise UsageError(text)
        self.exit(2, f"{text} (see {self.prog} --help)\n")


# -- value types -------------------------------------------------------------------------------
def _digits(text: str) -> int | None:
    """A whole number written in ASCII digits, or None. Past 20 digits it is out of every range here
    (and past 4300, int() itself refuses: a ValueError this must not let out)."""
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        return None
    return int(text)


def _finite(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return number


def _in_range(number: float, low: float, high: float, what: str, value: str) -> None:
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"expected {what} from {low:g} to {high:g}, got {value!r}")


def seconds(low: float, high: float) -> Callable[[str], float]:
    """Seconds, fractional allowed (`0.5`), from `low` to `high` inclusive; never nan, inf or negative."""
    if not 0 <= low <= high:
        raise ValueError(f"a range of seconds needs 0 <= low <= high, got {low}, {high}")

    def parse(value: str) -> float:
        number = _finite(value, "seconds")
        _in_range(number, low, high, "seconds", value)
        return number

    parse.__name__ = "seconds"
    return parse


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY}


def duration(low: float, high: float) -> Callable[[str], float]:
    """A duration in seconds, with an optional unit (`90`, `90s`, `30m`, `2h`, `7d`), within [low, high]."""

    def parse(value: str) -> float:
        text = value.strip()
        unit = text[-1:] if text[-1:] in ("s", "m", "h", "d") else ""
        number = _finite(text[: len(text) - len(unit)], "a duration like 90s, 30m, 2h") * _UNITS[unit]
        if number < 0:
            raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m, 2h, got {value!r}")
        _in_range(number, low, high, "a duration in seconds", value)
        return number

    parse.__name__ = "duration"
    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    """A whole number from `low` to `high` inclusive (decimal digits only)."""

    def parse(value: str) -> int:
        number = _digits(value.strip())
        if number is None:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}")
        _in_range(number, low, high, "a whole number", value)
        return number

    parse.__name__ = "integer"
    return parse


def number(low: float, high: float) -> Callable[[str], float]:
    """A finite number (fractional allowed) from `low` to `high` inclusive."""

    def parse(value: str) -> float:
        result = _finite(value, "a number")
        _in_range(result, low, high, "a number", value)
        return result

    parse.__name__ = "number"
    return parse


def numeric_id(value: str) -> int:
    """A uid or gid: digits only (names would need the node's passwd, which the container lacks)."""
    result = _digits(value)
    if result is None:
        raise argparse.ArgumentTypeError(f"expected a numeric id, got {value!r}")
    if result > MAX_ID:
        raise argparse.ArgumentTypeError(f"expected a numeric id from 0 to {MAX_ID}, got {value!r}")
    return result


def octal(value: str) -> int:
    """A file mode in octal, `0755` or `755`, up to 7777."""
    try:
        mode = int(value, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {value!r}") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"mode out of range: {value!r}")
    return mode


# The kubelet's own files in the device-plugins folder (its socket, its device manager's checkpoint): never
# a plugin's socket. A plugin named so would be judged on the kubelet's file, and its socket's removal
# taken for the kubelet's (or the reverse).
KUBELET_FILES = (DEFAULT_SOCKET, "kubelet_internal_checkpoint")


def plugin_spec(value: str, example: PluginSpec | None = None) -> PluginSpec:
    """`RESOURCE=SOCKET`: an extended resource name (with a domain) and a file name in the folder (not
    `.` or `..`, nor one of the kubelet's own files). `example`, the caller's default, is shown in the
    error."""
    resource, sep, sock = value.strip().partition("=")
    if not sep or "/" not in resource or not sock or "/" in sock or "\0" in sock:
        shown = f" ({example.resource}={example.socket})" if example else ""
        raise argparse.ArgumentTypeError(f"expected RESOURCE=SOCKET{shown}, got {value!r}")
    if sock in (".", ".."):
        raise argparse.ArgumentTypeError(f"SOCKET {sock!r} names a folder, not a socket file, in {value!r}")
    if sock in KUBELET_FILES:
        raise argparse.ArgumentTypeError(
            f"SOCKET {sock!r} is the kubelet's own file in the folder, not a plugin's socket, in {value!r}"
        )
    return PluginSpec(resource, sock)


class Expect(enum.Enum):
    """What the devices check asks of the kubelet's healthy devices (`--expect-devices`)."""

    ANY = "any"  # absent: at least one
    OFF = "off"  # 0: no devices check
    AUTO = "auto"  # auto: the host's --device-glob matches, less the GPUs HAMi's configuration filters
    AT_LEAST = "at-least"  # N: at least N


@dataclass(frozen=True)
class DeviceExpectation:
    """`--expect-devices` read: what is expected, and N for `Expect.AT_LEAST` (0 for the others)."""

    kind: Expect = Expect.ANY
    count: int = 0

    def __post_init__(self) -> None:
        """A count for AT_LEAST only, within MAX_DEVICES."""
        if (self.kind is Expect.AT_LEAST) != (self.count > 0) or not 0 <= self.count <= MAX_DEVICES:
            raise ValueError(f"{self.kind.name} with a count of {self.count}")

    @classmethod
    def at_least(cls, count: int) -> DeviceExpectation:
        """`--expect-devices N`: at least N healthy devices; 0 is no devices check."""
        return cls(Expect.AT_LEAST, count) if count else cls(Expect.OFF)


ANY_DEVICES = DeviceExpectation(Expect.ANY)  # no --expect-devices
AUTO_DEVICES = DeviceExpectation(Expect.AUTO)  # --expect-devices auto


def expect_devices(value: str) -> DeviceExpectation:
    """`auto` (AUTO_DEVICES: the host's --device-glob matches HAMi registers) or a count from 0 (no devices
    check) to MAX_DEVICES."""
    if value.strip() == "auto":
        return AUTO_DEVICES
    count = _digits(value.strip())
    if count is None or not 0 <= count <= MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to {MAX_DEVICES} or auto, got {value!r}")
    return DeviceExpectation.at_least(count)


def listen_address(value: str) -> tuple[str, int]:
    """`ADDR:PORT` (`0.0.0.0:9395`, `[::]:9395`); an empty address listens on every IPv4 address."""
    host, sep, port = value.rpartition(":")
    number = _digits(port)
    if not sep or number is None or not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT (0.0.0.0:9395), got {value!r}")
    return host.strip("[]") or "0.0.0.0", number


# -- flag groups (parent parsers) -------------------------------------------------------------------
def _group() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def socket_flags(*, device_plugin_dir: str, kubelet_socket: str) -> argparse.ArgumentParser:
    """Where the kubelet's registration socket is: every program takes these two."""
    p = _group()
    p.add_argument("--device-plugin-dir", default=device_plugin_dir, help=f"default {device_plugin_dir}")
    p.add_argument(
        "--kubelet-socket",
        default=kubelet_socket,
        help=f"name in the folder, or a path (default {kubelet_socket})",
    )
    return p


def identity_flags() -> argparse.ArgumentParser:
    """Who the plugin runs as, and what `kubelet.sock` is expected to be (hami-initcheck, hami-doctor).

    No defaults: an absent identity is this process's, an absent expectation is not checked.
    """
    p = _group()
    p.add_argument("--plugin-uid", type=numeric_id, help="uid the plugin runs as (default: this process's)")
    p.add_argument("--plugin-gid", type=numeric_id, help="gid the plugin runs as (default: this process's)")
    p.add_argument("--expect-owner", type=numeric_id, help="fail unless the socket is owned by this uid")
    p.add_argument("--expect-group", type=numeric_id, help="fail unless the socket's group is this gid")
    p.add_argument("--expect-mode", type=octal, help="fail unless the socket's mode is this (octal)")
    return p


def kubelet_version(text: str) -> str:
    """A kubelet release, `v1.34.4`, `1.34` or `v1.30.2+k3s1`, as given; "" for none."""
    if text == "":
        return text
    m = re.fullmatch(r"v?1\.(\d{1,3})(?:\.\d{1,5})?(?:[-+][0-9A-Za-z.+-]{0,64})?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{one_line(text)!s}: not a Kubernetes release (v1.34.4 or 1.34)")
    return text


def kubelet_process_flag(*, kubelet_process_name: str) -> argparse.ArgumentParser:
    """The kubelet's process name, to read where it listens (needs hostPID)."""
    p = _group()
    p.add_argument(
        "--kubelet-process-name",
        default=kubelet_process_name,
        help=f"process name of the kubelet (default {kubelet_process_name}, which also finds it inside "
        "k3s-server, k3s-agent, k3s and microk8s's kubelite)",
    )
    return p


def vendor_flags(*, vendors: Sequence[str], default: str, host_dev: str) -> argparse.ArgumentParser:
    """Whose devices these are, and where the host's /dev is (hami-sidecar, hami-doctor).

    `--vendor` has no default in the parser: absent, the caller takes the vendor of the `--plugin`
    resources, else `default` (the name shown). Its value is one of `vendors`, the profiles' names.
    """
    p = _group()
    p.add_argument(
        "--vendor",
        choices=tuple(vendors),
        help=f"the devices' vendor profile, {', '.join(vendors)}: the defaults of --plugin, --device-glob "
        f"and HAMi's annotations follow it (default: the vendor of the --plugin resources, else {default})",
    )
    p.add_argument(
        "--host-dev",
        default=host_dev,
        help=f"where the host's /dev is in this container: --device-glob's default is the vendor's under it "
        f"(default {host_dev})",
    )
    return p


def plugin_flags(
    *,
    plugins: Sequence[PluginSpec],
    pod_resources_socket: str,
    probe_timeout: float,
    device_glob: str,
) -> argparse.ArgumentParser:
    """The plugins to probe and how (hami-sidecar, hami-doctor).

    `--plugin` has no default in the parser (an appended list would be added to, not
    replaced): a caller takes `args.plugin or plugins`. `--expect-devices` absent is
    `Expect.ANY`: at least one healthy device (0 is no devices check). `--device-glob` has none
    either (the vendor's follows `--vendor` and `--host-dev`): `device_glob` is the one shown.
    """
    shown = ",".join(f"{p.resource}={p.socket}" for p in plugins)
    p = _group()
    p.add_argument(
        "--plugin",
        action="append",
        type=partial(plugin_spec, example=plugins[0]) if plugins else plugin_spec,
        help=f"RESOURCE=SOCKET, repeatable (default {shown}); the variable takes a comma-separated list",
    )
    p.add_argument(
        "--pod-resources-socket",
        default=pod_resources_socket,
        help=f"the kubelet's pod-resources socket, used only if present (default {pod_resources_socket})",
    )
    p.add_argument(
        "--probe-timeout",
        type=seconds(MIN_PERIOD, DAY),
        default=probe_timeout,
        help=f"seconds one gRPC probe may take (default {probe_timeout:g})",
    )
    p.add_argument(
        "--expect-devices",
        type=expect_devices,
        default=ANY_DEVICES,
        help="the fewest healthy devices the kubelet must list to be ready: N (0: no devices check), or "
        "auto: --device-glob on the host less the GPUs HAMi's node configuration filters "
        "(absent: at least one)",
    )
    p.add_argument(
        "--device-glob",
        help=f"the host's device nodes (default {device_glob}: the vendor profile's, under --host-dev)",
    )
    return p


class DeviceFolder:
    """The paths of the folder's sockets, for settings that name the folder and kubelet.sock."""

    device_plugin_dir: str
    kubelet_socket: str

    @property
    def kubelet_path(self) -> str:
        return os.path.join(self.device_plugin_dir, self.kubelet_socket)

    def plugin_path(self, plugin: PluginSpec) -> str:
        return os.path.join(self.device_plugin_dir, plugin.socket)
