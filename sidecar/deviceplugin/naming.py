"""What a device plugin's names say: the resource a socket serves, and the physical device behind an ID.

The forms known are the vendor profiles' (hami_guard/profiles: a resource's socket, the device IDs
that name a share of one device), and kubevirt's device-plugin-manager's, which several vendors' plugins
serve through: `<domain>_<name>` (no `.sock`) for the resource `<domain>/<name>`. A plugin of another
kind keeps its names as they are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hami_guard import profiles
from hami_guard.flags import PluginSpec
from hami_guard.profiles import VendorProfile

# device-plugin-manager's socket, `<resource namespace>_<plugin name>` (pkg/dpm/plugin.go,
# kubevirt/device-plugin-manager): the namespace a domain with a dot, so kubelet_internal_checkpoint
# and the like are not read as one.
_DPM = re.compile(
    r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+)_([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)$"
)
DPM_FORM = "<domain>_<name>"


def _profile(resource: str | None, vendor: VendorProfile | None) -> VendorProfile:
    """`vendor`, else the profile that owns `resource`, else the default profile."""
    found = profiles.for_resource(resource) if resource else None
    return vendor or found or profiles.DEFAULT


def physical_devices(
    ids: Iterable[str], resource: str | None = None, *, vendor: VendorProfile | None = None
) -> set[str]:
    """Devices as a user counts them: the IDs the profile folds (HAMi's split IDs, time-slicing replicas,
    a vendor's shares) once per device. The profile is `vendor`, else the one that owns `resource`,
    else the default one.

    Only the profile's forms are folded: another vendor's IDs may end in `-<n>` for distinct devices.
    """
    profile = _profile(resource, vendor)
    return {profile.physical_device(device) for device in ids}


def physical_device(device: str, resource: str | None = None, *, vendor: VendorProfile | None = None) -> str:
    """The physical device of one ID: the device a share's ID names (the folds of the profile, chosen as in
    physical_devices)."""
    return _profile(resource, vendor).physical_device(device)


def dpm_resource(socket: str) -> str | None:
    """The resource device-plugin-manager registers when it serves `socket` (`amd.com_gpu`: amd.com/gpu)."""
    m = _DPM.match(socket)
    return f"{m.group(1)}/{m.group(5)}" if m else None


def hami_resource(socket: str) -> str | None:
    """The resource a HAMi plugin registers when it serves `socket`: its profile's socket for a resource
    name, else device-plugin-manager's form."""
    found = profiles.for_socket(socket)
    return found[1] if found else dpm_resource(socket)


def matching_plugins(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> tuple[PluginSpec, ...]:
    """The plugins setting with `plugin` replaced by the one serving `found` (a socket in the folder)."""
    vendor = profiles.for_resource(plugin.resource)
    # The plugin's vendor's naming, else device-plugin-manager's (a HAMi socket of another vendor's form
    # says nothing of a resource no profile owns).
    resource = vendor.resource_for(found) if vendor else dpm_resource(found)
    new = PluginSpec(resource or plugin.resource, found)
    return tuple(new if p == plugin else p for p in plugins)


def socket_found_instead(plugins: Iterable[PluginSpec], plugin: PluginSpec, found: str) -> str:
    """What to say of a plugin whose socket is missing while `found` is served in the folder."""
    specs = matching_plugins(plugins, plugin, found)
    new = next(p for p in specs if p.socket == found)
    flags = " ".join(f"--plugin {p.resource}={p.socket}" for p in specs)
    env = ",".join(f"{p.resource}={p.socket}" for p in specs)
    by = profiles.for_resource(plugin.resource)
    if new.resource == plugin.resource:
        hami = ""
    elif by:  # whose naming renamed it
        hami = (
            f" (HAMi serves {by.shown(by.resources.socket)} for resourceName "
            f"{by.shown(by.resources.pattern)}: {new.resource})"
        )
    else:
        hami = f" (device-plugin-manager serves {DPM_FORM} for <domain>/<name>: {new.resource})"
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
