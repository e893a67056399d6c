"""What a device plugin's names say: the resource a socket serves, and the physical device behind an ID.

HAMi's socket and device-ID forms are the ones known here; a plugin of another kind keeps its names as
they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hami_guard.flags import PluginSpec

# HAMi's socket for resource `nvidia.com/<name>` is `nvidia-<name>.sock` (getPluginSocketPath,
# pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go in Project-HAMi/HAMi).
_HAMI_SOCKET = re.compile(r"^nvidia-([A-Za-z0-9][A-Za-z0-9._-]{0,62})\.sock$")
# HAMi advertises each GPU as `<GPU-UUID>-<n>`; NVIDIA's time-slicing as `<id>::<n>`.
_HAMI_SPLIT = re.compile(r"^(GPU-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})-\d+$")
_REPLICA = re.compile(r"^(.+)::\d+$")


def physical_devices(ids: Iterable[str]) -> set[str]:
    """Devices as a user counts them: HAMi's split IDs and time-slicing replicas once per GPU.

    Only those two forms are folded: other vendors' IDs may end in `-<n>` for distinct devices.
    """
    return {physical_device(device) for device in ids}


def physical_device(device: str) -> str:
    """The physical device of one ID: a HAMi split ID's GPU, a time-slicing replica's device."""
    m = _HAMI_SPLIT.match(device) or _REPLICA.match(device)
    return m.group(1) if m else device


def hami_resource(socket: str) -> str | None:
    """The resource HAMi registers when it serves `socket` (`nvidia-vgpu.sock`: nvidia.com/vgpu)."""
    m = _HAMI_SOCKET.match(socket)
    return f"nvidia.com/{m.group(1)}" if m else None


def matching_plugins(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> tuple[PluginSpec, ...]:
    """The plugins setting with `plugin` replaced by the one serving `found` (a socket in the folder)."""
    resource = hami_resource(found) if plugin.resource.startswith("nvidia.com/") else None
    new = PluginSpec(resource or plugin.resource, found)
    return tuple(new if p == plugin else p for p in plugins)


def socket_found_instead(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> str:
    """What to say of a plugin whose socket is missing while `found` is served in the folder."""
    specs = matching_plugins(plugins, plugin, found)
    new = next(p for p in specs if p.socket == found)
    flags = " ".join(f"--plugin {p.resource}={p.socket}" for p in specs)
    env = ",".join(f"{p.resource}={p.socket}" for p in specs)
    hami = (
        f" (HAMi serves nvidia-<name>.sock for resourceName nvidia.com/<name>: {new.resource})"
        if new.resource != plugin.resource
        else ""
    )
    return (
        f"a device plugin serves {found} in the folder instead{hami}: the settings that match it are "
        f"{flags}, or HAMI_GUARD_PLUGIN={env}"
    )


def pick_found(plugin: PluginSpec, others: Iterable[str]) -> str | None:
    """Of the other sockets served in the folder, the one most likely this plugin's under another name."""
    names = sorted(others)
    domain = plugin.resource.partition("/")[0]
    same = [n for n in names if (hami_resource(n) or "").startswith(domain + "/")]
    return (same or names)[0] if names else None
