"""HAMi's Node annotations and the Node's few fields the verdicts read, parsed: pure and total.

What HAMi writes (Project-HAMi/HAMi, docs/kubelet.md#hami-registration):

- The device plugin's register annotation (its key the vendor profile's: hami_guard/profiles, [hami]
  register): the JSON array of HAMi's `DeviceInfo` (pkg/device/devices.go,
  `MarshalNodeDevices`): `id` (the GPU's UUID), `index`, `count` (the split count), `devmem`,
  `devcore`, `type`, `numa`, `mode`, `health`, `migProfiles`, every field `omitempty`: a GPU at index
  0 has no `index`, an unhealthy one no `health`. The scheduler decodes it with Go's `json.Unmarshal`
  (`UnMarshalNodeDevices`): a value of the wrong JSON type fails the whole decode, and the scheduler then
  reads no device from it (it keeps the copy it read before, if any; a node it never read is
  "unregistered"). So does this parser; unknown fields pass, as in Go. The GPUs come in the order of a
  Go map, which changes from round to round: compare them as a set.
- The scheduler's handshake (the profile's [hami] handshake): `Requesting_<time>` (the
  scheduler's local time, `2006-01-02 15:04:05`), or, before HAMi v2.10, `Deleted_<time>` written when
  it cleaned the node up (`2006.01.02 15:04:05` up to v2.4).

Every function here takes any text and returns a value or a reason: `fuzz/fuzz_hami.py` holds them to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from hami_guard import profiles

MAX_NODE = 4 * 1024 * 1024  # a Node object read from the API server; more is not read
MAX_VALUE = 1024 * 1024  # an annotation's value (the API server caps all of a Node's at 256 KiB)
MAX_GPUS = 4096
_STAMP_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y.%m.%d %H:%M:%S")  # Go's time.DateTime; HAMi up to v2.4
_INT32 = (-(2**31), 2**31 - 1)
_INTEGERS = {  # DeviceInfo's integer fields and their Go types' ranges
    "index": (0, 2**64 - 1),
    "count": _INT32,
    "devmem": _INT32,
    "devcore": _INT32,
    "numa": (-(2**63), 2**63 - 1),
}


@dataclass(frozen=True)
class Gpu:
    """One entry of HAMi's register annotation."""

    id: str
    index: int = 0
    count: int = 0  # the split count
    health: bool = False  # `omitempty`: absent is false, unhealthy
    mode: str = ""
    type: str = ""


@dataclass(frozen=True)
class Register:
    """The register annotation: its GPUs, or (None) why HAMi's scheduler cannot read them; `skew` the
    format it is written in when that is the other one, which HAMi's decoder for the vendor does not read."""

    gpus: tuple[Gpu, ...] | None
    why: str = ""
    skew: str = ""

    @property
    def healthy(self) -> frozenset[str]:
        """The IDs HAMi marks healthy."""
        return frozenset(g.id for g in self.gpus or () if g.health)

    @property
    def ids(self) -> frozenset[str]:
        """Every GPU ID it lists."""
        return frozenset(g.id for g in self.gpus or ())


HandshakeState = Literal["absent", "requesting", "deleted", "other"]


@dataclass(frozen=True)
class Handshake:
    """The scheduler's handshake annotation: its state, its value, and its stamp when it parses (naive:
    the scheduler's local time, whose zone the node cannot know)."""

    state: HandshakeState
    value: str = ""
    stamp: datetime | None = None


@dataclass(frozen=True)
class NodeView:
    """The fields of a Node the verdicts read."""

    name: str
    annotations: dict[str, str] = field(default_factory=dict)  # only the keys asked for
    allocatable: dict[str, int | None] = field(default_factory=dict)  # None: not an integer count
    boot_id: str = ""  # status.nodeInfo.bootID, as the kubelet reports it
    kubelet_version: str = ""  # status.nodeInfo.kubeletVersion, as the kubelet reports it


JSON, CSV = "device-info-json", "device-info-csv"  # the profiles' register_format values
_FORMAT_NAMES = {JSON: "JSON (UnMarshalNodeDevices)", CSV: "legacy CSV (DecodeNodeDevices)"}


def parse_register(value: str, fmt: str = JSON) -> Register:
    """HAMi's register annotation, decoded as HAMi's scheduler decodes it for the vendor: `fmt` JSON
    (`UnMarshalNodeDevices`) or the legacy CSV (`DecodeNodeDevices`). A value HAMi cannot decode that is
    in the other format is a format skew (`skew`)."""
    own, other = (parse_csv, parse_json) if fmt == CSV else (parse_json, parse_csv)
    got = own(value)
    if got.gpus is not None:
        return got
    if other(value).gpus is not None:
        wrote, reads = (JSON, CSV) if fmt == CSV else (CSV, JSON)
        return Register(
            None,
            f"written in {_FORMAT_NAMES[wrote]}, while HAMi's scheduler decodes this vendor's annotation as "
            f"{_FORMAT_NAMES[reads]}: it cannot decode it",
            wrote,
        )
    return got


def parse_csv(value: str) -> Register:
    """HAMi's legacy register text, decoded as `DecodeNodeDevices` (pkg/device/devices.go) does: devices
    split on `:` (required; empty segments skipped), each `id,count,devmem,devcore,type,numa,health`
    with `,index,mode` after it or not; health through Go's ParseBool, index >= 0; the first bad device
    fails the whole decode."""
    if len(value) > MAX_VALUE:
        return Register(None, f"the value exceeds {MAX_VALUE} bytes")
    if ":" not in value:
        return Register(None, "no device separator ':': HAMi's scheduler cannot decode it")
    gpus: list[Gpu] = []
    for i, segment in enumerate(s for s in value.split(":") if s):
        if len(gpus) >= MAX_GPUS:
            return Register(None, f"over {MAX_GPUS} entries")
        gpu = _csv_gpu(segment.split(","))
        if isinstance(gpu, str):
            return Register(None, f"device {i}: {gpu}: HAMi's scheduler cannot decode it")
        gpus.append(gpu)
    return Register(tuple(gpus))


_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True}
_BOOLS |= {"0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}


def _go_int(text: str, low: int, high: int) -> int | None:
    """Go's strconv.Atoi/ParseInt(text, 10, ...): an optional sign and ASCII digits, within range."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isascii() or not digits.isdigit() or len(digits) > 20:
        return None
    n = int(text)
    return n if low <= n <= high else None


def _csv_gpu(fields: list[str]) -> Gpu | str:
    if len(fields) not in (7, 9):
        return f"unexpected field count {len(fields)}"
    ident, count, devmem, devcore, kind, numa, health = fields[:7]
    for name, text in (("count", count), ("devmem", devmem), ("devcore", devcore)):
        if _go_int(text, *_INT32) is None:
            return f"invalid {name} field"
    if _go_int(numa, -(2**63), 2**63 - 1) is None:
        return "invalid numa field"
    if health not in _BOOLS:
        return "invalid health field"
    index, mode = 0, "hami-core"
    if len(fields) == 9:
        got = _go_int(fields[7], -(2**63), 2**63 - 1)
        if got is None or got < 0:
            return "invalid index field"
        index, mode = got, fields[8]
    return Gpu(ident, index, int(count), _BOOLS[health], mode, kind)


def parse_json(value: str) -> Register:
    """HAMi's register annotation as `UnMarshalNodeDevices` decodes it: a JSON array of DeviceInfo."""
    if len(value) > MAX_VALUE:
        return Register(None, f"over hami-guard's own {MAX_VALUE >> 20} MiB bound: not decoded")
    try:
        doc = json.loads(value, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        return Register(None, f"not JSON ({type(e).__name__}): HAMi's scheduler cannot decode it")
    if doc is None:
        return Register(())  # Go decodes null into an empty list
    if not isinstance(doc, list):
        return Register(None, f"a JSON {type(doc).__name__}, not HAMi's device list")
    if len(doc) > MAX_GPUS:
        return Register(None, f"over {MAX_GPUS} entries")
    gpus = []
    for i, item in enumerate(doc):
        if item is None:
            continue  # a nil *DeviceInfo in Go
        gpu = _gpu(item)
        if isinstance(gpu, str):
            return Register(None, f"entry {i}: {gpu}: HAMi's scheduler cannot decode it")
        gpus.append(gpu)
    return Register(tuple(gpus))


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN and Infinity; Go's does not


def _gpu(item: Any) -> Gpu | str:
    if not isinstance(item, dict):
        return f"a JSON {type(item).__name__}, not an object"
    strings, ints = {"id": "", "mode": "", "type": ""}, {"index": 0, "count": 0}
    for key in strings:
        v = item.get(key)
        if v is not None and not isinstance(v, str):
            return f"{key} is not a string"
        strings[key] = v or ""
    # Go decodes only integer literals into integers, within the field's type.
    for key, (low, high) in _INTEGERS.items():
        v = item.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            return f"{key} is not an integer HAMi's DeviceInfo takes"
        if key in ints:
            ints[key] = v
    health = item.get("health")
    if health is not None and not isinstance(health, bool):
        return "health is not a boolean"
    return Gpu(strings["id"], ints["index"], ints["count"], bool(health), strings["mode"], strings["type"])


def parse_handshake(value: str | None) -> Handshake:
    """The scheduler's handshake annotation (None: absent)."""
    if value is None:
        return Handshake("absent")
    value = value[:256]
    for prefix, state in (("Requesting", "requesting"), ("Deleted", "deleted")):
        # HAMi tests `strings.Contains(handshake, "Requesting")`, then cuts at the first "_".
        if prefix in value:
            _, _, stamp = value.partition("_")
            return Handshake(state, value, _stamp(stamp))  # type: ignore[arg-type]
    return Handshake("other", value)


def _stamp(text: str) -> datetime | None:
    for fmt in _STAMP_FORMATS:
        try:
            return datetime.strptime(text, fmt)
        except ValueError:
            continue
    return None


MAX_KUBELET_VERSION = 128  # a version string longer than this is no version


def parse_node(body: bytes, keys: Iterable[str]) -> NodeView | str:
    """A Node object's name, the annotations `keys`, allocatable counts and boot ID; or why not."""
    if len(body) > MAX_NODE:
        return f"the Node object exceeds {MAX_NODE} bytes"
    try:
        doc = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        return f"the answer is not JSON: {type(e).__name__}"
    if not isinstance(doc, dict) or doc.get("kind", "Node") != "Node":
        return "the answer is not a Node"
    meta, status = _dict(doc.get("metadata")), _dict(doc.get("status"))
    annotations = _dict(meta.get("annotations"))
    picked = {k: v for k in keys if isinstance(v := annotations.get(k), str)}
    allocatable = {k: _count(v) for k, v in _dict(status.get("allocatable")).items() if isinstance(k, str)}
    info = _dict(status.get("nodeInfo"))
    boot, kubelet = info.get("bootID"), info.get("kubeletVersion")
    name = meta.get("name")
    return NodeView(
        name if isinstance(name, str) else "",
        picked,
        allocatable,
        boot if isinstance(boot, str) else "",
        kubelet if isinstance(kubelet, str) and len(kubelet) <= MAX_KUBELET_VERSION else "",
    )


def _count(v: Any) -> int | None:
    """An extended resource's quantity: a plain integer ("4"); anything else is not a device count."""
    if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) < 19:
        return int(v)
    return None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def gpu_of(device: str, resource: str = "") -> str | None:
    """The device a kubelet device ID stands for, by the profile of `resource` (the default profile's
    without one): the device's ID itself (the form HAMi's annotation carries: NVML's UUID for NVIDIA), a
    share folded by the profile (`physical_device`: Ascend's `<UUID>-<i>`, DCU's `<ID>-fake-<i>`), or
    HAMi's split ID `<ID>-<n>` folded to it; None for any other ID (MIG devices, other vendors')."""
    vendor = (profiles.for_resource(resource) if resource else None) or profiles.DEFAULT
    folded = vendor.physical_device(device) if resource else device
    if folded != device and vendor.is_device(folded):
        return folded
    if vendor.is_device(device):
        return device
    head, sep, tail = device.rpartition("-")
    if sep and tail.isascii() and tail.isdigit() and vendor.is_device(head):
        return head
    return None
