"""Each vendor's device IDs as its HAMi device plugin makes them: the test rig's knowledge, for the
stand-in (testing/standin.py), keyed by the vendor's profile (hami_guard/profiles/<name>.toml).

A plugin names each physical device one way in HAMi's register annotation and lists shares of it to the
kubelet; the vendor's profile (`[devices] id`, `folds`) folds every share back to its device
(`VendorProfile.physical_device`), which tests/test_standin.py checks for every profile. Written from
each plugin's code, never copied from it:

- NVIDIA (Project-HAMi/HAMi, pkg/device-plugin/nvidiadevice/nvinternal/rm/devices.go GetPluginDevices):
  NVML's UUID `GPU-<8-4-4-4-12 hex>`, listed as `<UUID>-<n>`, n below deviceSplitCount (10 in
  charts/hami/values.yaml); the annotation carries the UUID.
- Ascend (Project-HAMi/ascend-device-plugin v1.4.0): the NPU's VDie ID from DCMI
  (internal/manager/manager.go UpdateDevice: `GetDieID(logicID, dcmi.VDIE)`; mind-cluster's
  ascend-common devmanager `DcGetDieID` writes its five 32-bit words as 8 hex digits each, upper case,
  joined by `-`), listed as `<UUID>-<i>`, i below VDeviceCount (internal/server/server.go apiDevices;
  VDeviceCount = memoryAllocatable over the smallest template, 65536 / 16384 = 4 for HAMi's chart's
  Ascend910B3, internal/manager/manager.go); the annotation carries the UUID, and for an `Ascend910*`
  commonWord `custominfo.NetworkID`, 1 from the fifth NPU on but 0 for all of Ascend910C
  (internal/server/register.go registerHAMi, getDeviceNetworkID).
- Hygon DCU (Project-HAMi/dcu-vgpu-device-plugin): `DCU-<serial number>` (internal/pkg/dcu/register.go
  apiDevices: rocm-smi's serial number through dcu-dcgm), listed as `<ID>-fake-<i>`, i below 4
  (internal/pkg/dcu/server.go generateFakeDevs, the fixed `Count: 4` of apiDevices).
- AMD (Project-HAMi/amd-device-plugin): the GPU's PCI address as sysfs names it, lower case
  (internal/pkg/amdgpu/amdgpu.go GetAMDGPUs: /sys/module/amdgpu/drivers/pci:amdgpu/0000:19:00.0),
  listed as `<address>#<i>`, i below defaultSplitCount 10 (internal/pkg/plugin/plugin.go ListAndWatch);
  the annotation carries AMD SMI's UUID instead (plugin.go getAPIDevices, `amdsmi_get_gpu_device_uuid`,
  which amd_smi_uuid.cc prints from the ASIC serial and the PCI device ID:
  `<serial byte 7><fcn ff><device ID>-0000-1000-80<serial byte 6>-<serial bytes 4-5><serial bytes 0-3>`,
  lower-case hex) and `custominfo.pciBDF`: the two do not compare.
- Biren (Project-HAMi/biren-device-plugin, runc runtime): `card_<N>`, N the driver's node ID
  (pkg/brgpu/runc.go cardIDFormat), listed once per GPU (pkg/brgpu/plugin.go ListAndWatch) and carried
  as is by the annotation (pkg/brgpu/register.go RegisterHAMiWithRawDevice, `Count: 1`).

The serial numbers and addresses themselves are made up (`E2E` in them where the form allows), in each
vendor's form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from testing.plugin import HAMI_SPLIT_COUNT, hami_device_ids

# NVIDIA: GPU-<prefix><nnnn>, NVML's UUID shape (8-4-4-4-12 hex) with the last 4 digits the GPU's number.
UUID_PREFIX = "e2e00000-0000-0000-0000-00000000"
ASCEND_SPLIT = 4  # VDeviceCount for HAMi's chart's Ascend910B3: memoryAllocatable 65536 / 16384
DCU_SPLIT = 4  # apiDevices' fixed Count
AMD_SPLIT = 10  # defaultSplitCount
AMD_DEVICE_ID = 0x74A1  # a PCI device ID of an AMD Instinct GPU, in AMD SMI's UUID
AMD_SERIAL = 0xE2E0_0000_0000_0000  # the ASIC serial of GPU 0; GPU n's is this plus n


@dataclass(frozen=True)
class Card:
    """One physical device as its vendor's plugin knows it."""

    device: str  # the device the kubelet's IDs fold to (VendorProfile.physical_device)
    annotated: str  # its ID in HAMi's register annotation (`device`, but for AMD's)
    shares: tuple[str, ...]  # its kubelet device IDs, in the order the plugin lists them
    custom: tuple[tuple[str, Any], ...] = ()  # its `custominfo` in HAMi's register annotation


@dataclass(frozen=True)
class IdForm:
    """A vendor's device IDs: how many shares of a device its plugin lists by default, the most it can,
    and the cards it has for `gpus` devices split `split` ways for `resource`."""

    split: int
    most: int | None  # None: any split
    make: Callable[[int, int, str, str], list[Card]]  # (gpus, split, resource, NVIDIA's UUID prefix)
    prefixed: bool = False  # its IDs take NVIDIA's UUID prefix

    def cards(self, gpus: int, split: int, resource: str, uuid_prefix: str = UUID_PREFIX) -> list[Card]:
        if gpus < 0:
            raise ValueError("a negative number of devices")
        if split < 1 or (self.most is not None and split > self.most):
            most = "any number of" if self.most is None else f"1 to {self.most}"
            raise ValueError(f"the plugin lists each device {most} time(s), not {split}")
        return self.make(gpus, split, resource, uuid_prefix)


def _nvidia(gpus: int, split: int, _resource: str, prefix: str) -> list[Card]:
    out = []
    for n in range(gpus):
        uuid = f"GPU-{prefix}{n:04d}"
        out.append(Card(uuid, uuid, tuple(hami_device_ids([uuid], split))))
    return out


def ascend_uuid(n: int) -> str:
    """NPU n's VDie ID as DcGetDieID writes it: five words of 8 upper-case hex digits joined by `-`."""
    return "-".join(f"{w:08X}" for w in (0xE2E00000, 0, 0, 0, n))


def _ascend(gpus: int, split: int, resource: str, _prefix: str) -> list[Card]:
    common_word = resource.rsplit("/", 1)[-1]
    out = []
    for n in range(gpus):
        uuid = ascend_uuid(n)
        custom: tuple[tuple[str, Any], ...] = ()
        if common_word.startswith("Ascend910"):
            custom = (("NetworkID", 0 if common_word == "Ascend910C" or n <= 3 else 1),)
        out.append(Card(uuid, uuid, tuple(f"{uuid}-{i}" for i in range(split)), custom))
    return out


def _dcu(gpus: int, split: int, _resource: str, _prefix: str) -> list[Card]:
    out = []
    for n in range(gpus):
        ident = f"DCU-E2E{n:07d}"
        out.append(Card(ident, ident, tuple(f"{ident}-fake-{i}" for i in range(split))))
    return out


def amd_smi_uuid(serial: int, device_id: int = AMD_DEVICE_ID) -> str:
    """AMD SMI's UUID of a GPU (amdsmi_uuid_gen): its ASIC serial's bytes and its PCI device ID in the
    fields of a version-1 UUID, the function byte 0xff."""
    b7, b6, b45, b03 = serial >> 56 & 0xFF, serial >> 48 & 0xFF, serial >> 32 & 0xFFFF, serial & 0xFFFFFFFF
    return f"{b7:02x}ff{device_id:04x}-0000-1000-80{b6:02x}-{b45:04x}{b03:08x}"


def amd_address(n: int) -> str:
    """GPU n's PCI address as sysfs names it (domain:bus:device.function, lower case)."""
    return f"0000:{(0x0C + 0x10 * n) & 0xFF:02x}:00.0"


def _amd(gpus: int, split: int, _resource: str, _prefix: str) -> list[Card]:
    out = []
    for n in range(gpus):
        bdf = amd_address(n)
        shares = tuple(f"{bdf}#{i}" for i in range(split))
        out.append(Card(bdf, amd_smi_uuid(AMD_SERIAL + n), shares, (("pciBDF", bdf),)))
    return out


def _biren(gpus: int, _split: int, _resource: str, _prefix: str) -> list[Card]:
    return [Card(f"card_{n}", f"card_{n}", (f"card_{n}",)) for n in range(gpus)]


FORMS: dict[str, IdForm] = {
    "nvidia": IdForm(HAMI_SPLIT_COUNT, None, _nvidia, prefixed=True),
    "ascend": IdForm(ASCEND_SPLIT, None, _ascend),
    "dcu": IdForm(DCU_SPLIT, None, _dcu),
    "amd": IdForm(AMD_SPLIT, None, _amd),
    "biren": IdForm(1, 1, _biren),
}


def form(profile: str) -> IdForm:
    """The ID form of the vendor whose profile is `profile` (KeyError for a profile it does not know)."""
    return FORMS[profile]
