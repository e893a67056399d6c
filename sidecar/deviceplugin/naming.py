"""What a device plugin's names say: the resource a socket serves, and the physical device behind an ID.

The forms known are the vendor profiles' (hami_guard/profiles: a resource's socket, the device IDs
that name a share of one device); a plugin of another kind keeps its names as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from hami_guard import profiles
from hami_guard.flags import PluginSpec


def physical_devices(ids: Iterable[str]) -> set[str]:
    """Devices as a user counts them: the IDs the default profile folds (HAMi's split IDs, time-slicing
    replicas) once per device.

    Only the profile's forms are folded: other vendors' IDs may end in `-<n>` for distinct devices.
    """
    return {physical_device(device) for device in ids}


def physical_device(device: str) -> str:
    """The physical device of one ID: the device a share's ID names (the default profile's folds)."""
    return profiles.DEFAULT.physical_device(device)


def hami_resource(socket: str) -> str | None:
    """The resource HAMi registers when it serves `socket` (its profile's socket for a resource name)."""
    found = profiles.for_socket(socket)
    return found[1] if found else None


def matching_plugins(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> tuple[PluginSpec, ...]:
    """The plugins setting with `plugin` replaced by the one serving `found` (a socket in the folder)."""
    vendor = profiles.for_resource(plugin.resource)
    resource = vendor.resource_for(found) if vendor else None
    new = PluginSpec(resource or plugin.resource, found)
    return tuple(new if p == plugin else p for p in plugins)


def socket_found_instead(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> str:
    """What to say of a plugin whose socket is missing while `found` is served in the folder."""
    specs = matching_plugins(plugins, plugin, found)
    new = next(p for p in specs if p.socket == found)
    flags = " ".join(f"--plugin {p.resource}={p.socket}" for p in specs)
    env = ",".join(f"{p.resource}={p.socket}" for p in specs)
    vendor = profiles.for_resource(plugin.resource) or profiles.DEFAULT  # whose naming renamed it
    hami = (
        f" (HAMi serves {vendor.shown(vendor.resources.socket)} for resourceName "
        f"{vendor.shown(vendor.resources.pattern)}: {new.resource})"
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
