"""The host's GPUs as their driver and sysfs list them, and the bounded read of the host's files.

`--expect-devices auto` (sidecar.deviceplugin.hamiconfig) and the recovery of unhealthy devices read
the host here. What to read is the vendor profile's (hami_guard/profiles, [devices]): the driver's folder
of GPUs, one folder per GPU holding an `information` file (`GPU UUID`, `Bus Location`, `Device Minor`,
`GPU Excluded`), a GPU's device node by its minor, and the PCI vendor ID of the GPUs bound to vfio-pci
(handed to virtual machines), which have no device node: the device glob never counts them, and they
are named from /sys/bus/pci/drivers/vfio-pci.

Every reader here is total: any input gives an answer, never an exception.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass

from hami_guard import profiles

VFIO_DIR = "/sys/bus/pci/drivers/vfio-pci"
MAX_INFO_BYTES = 64 << 10
MAX_GPUS = 4096


@dataclass(frozen=True)
class Gpu:
    """One GPU its driver knows (<the profile's driver_gpus>/<bus>/information)."""

    bus: str
    uuid: str = ""
    minor: int | None = None
    excluded: bool = False

    def node(self, folder: str, pattern: str = profiles.DEFAULT.devices.node) -> str:
        """The GPU's device node in `folder` (`pattern` by its minor), or "no device node" when the driver
        names no minor or the profile no node."""
        if self.minor is None or not pattern:
            return "no device node"
        return os.path.join(folder, pattern.replace(profiles.MINOR, str(self.minor)))


def parse_gpu_information(text: str, bus: str) -> Gpu:
    """The driver's `information` file of the GPU at `bus` (`Key:   value` lines). Total."""
    info: dict[str, str] = {}
    for line in text.splitlines()[:200]:
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip().lower(), value.strip())
    minor_text = info.get("device minor", "")
    minor = int(minor_text) if minor_text.isascii() and minor_text.isdigit() and len(minor_text) < 8 else None
    uuid = info.get("gpu uuid", "")
    uuid = uuid if re.fullmatch(r"[A-Za-z0-9-]{1,80}", uuid) else ""
    location = info.get("bus location", "") or bus
    return Gpu(location[:64], uuid, minor, info.get("gpu excluded", "").lower().startswith("yes"))


class NotAFile(OSError):
    """The path names something that is not a regular file (a FIFO, a socket, a device, a folder)."""


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_bounded(path: str, limit: int, *, follow: bool = False) -> bytes:
    """At most `limit + 1` bytes of the regular file at `path`, without ever blocking on what it is.

    O_NONBLOCK: a FIFO at the path (nothing writing) would otherwise hold the reader thread forever,
    and with it every later read and the sidecar's exit. The opened descriptor is fstat'ed, so what
    is read is what was judged. `follow` for HAMi's config, a ConfigMap file: a symlink into `..data/`;
    the sysfs and procfs attributes are read with O_NOFOLLOW. Raises OSError (NotAFile with a reason).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotAFile(errno.ELOOP, "a symbolic link, not followed") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(errno.EINVAL, f"{file_kind(mode)}, not a regular file")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_gpus(gpus_dir: str) -> tuple[list[Gpu], str]:
    """The driver's GPUs, or [] and why not. Never raises."""
    try:
        names = sorted(os.listdir(gpus_dir))[:MAX_GPUS]
    except OSError as e:
        return [], f"{gpus_dir} cannot be read ({e.strerror or type(e).__name__})"
    gpus = []
    for name in names:
        try:
            raw = read_bounded(os.path.join(gpus_dir, name, "information"), MAX_INFO_BYTES)
        except OSError:
            continue
        gpus.append(parse_gpu_information(raw[:MAX_INFO_BYTES].decode("utf-8", errors="replace"), name))
    return gpus, ""


def vfio_gpus(vfio_dir: str, pci_vendor: str = profiles.DEFAULT.devices.pci_vendor) -> list[str]:
    """PCI addresses of the display devices of `pci_vendor` (the profile's) bound to vfio-pci; none for a
    vendor whose ID is not known (""). Never raises."""
    out: list[str] = []
    if not pci_vendor:
        return out
    try:
        names = sorted(os.listdir(vfio_dir))[:MAX_GPUS]
    except OSError:
        return []
    for name in names:
        if not re.fullmatch(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]", name):
            continue
        try:
            vendor = read_bounded(os.path.join(vfio_dir, name, "vendor"), 64).decode("ascii", "replace")
            cls = read_bounded(os.path.join(vfio_dir, name, "class"), 64).decode("ascii", "replace")
        except OSError:
            continue
        if vendor.strip().lower() == pci_vendor and cls.strip().lower().startswith("0x03"):
            out.append(name)
    return out
