"""What HAMi registers on this node: its node configuration's device filter, and the host's GPUs.

`--expect-devices auto` counts the host's device nodes (`--device-glob`, the vendor profile's glob by
default). HAMi leaves out the GPUs its node configuration filters, so auto subtracts them, for a vendor
whose plugin reads that configuration (the profile's [chart] node_config; "" for none: nothing is
subtracted). The facts mirrored here are HAMi's (Project-HAMi/HAMi v2.10; where upstream: the profile's
`sources`, node-configuration):

- the file is JSON, `/config/config.json` in the plugin's container (the ConfigMap
  `<release>-device-plugin`, key `config.json`, or the chart's `externalConfigName`);
- `{"nodeconfig": [{"name": NODE, "filterdevices": {"uuid": [...], "index": [...]}, ...}]}`; an entry
  applies when its `name` equals the plugin's `NODE_NAME`; of the entries that apply, the last with a
  non-empty filter sets it; `operatingmode` and `migstrategy` say whether MIG devices are registered;
- the file is decoded by Go's encoding/json: keys match case-insensitively, a later duplicate key wins,
  unknown keys are ignored, and any type error (an `index` that is not a non-negative whole number, a
  `name` that is not a string...) makes HAMi log the error and apply no filter at all;
- a GPU is filtered when its UUID is listed, or its NVML index (decimal) is; a MIG device's index is
  `<gpu>:<mig>`, which no `index` entry matches, so only its UUID filters it.

The host's GPUs and their UUIDs come from their driver (sidecar.deviceplugin.hostdevices, where the
profile says); NVML's index is a GPU's rank in PCI bus order, excluded GPUs left out. GPUs bound to
vfio-pci have no device node: the glob never counts them, and they are named.

Every parser here is total: any input gives an answer, never an exception.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hami_guard import profiles
from hami_guard.profiles import VendorProfile
from sidecar.deviceplugin.hostdevices import VFIO_DIR, read_bounded, read_gpus, vfio_gpus

CONFIG_PATH = "/config/config.json"  # where HAMi's chart mounts the node configuration
NODE_NAME_ENV = "NODE_NAME"  # HAMi's own pod takes its node's name from this variable
MAX_CONFIG_BYTES = 1 << 20
SHOWN = 8  # devices named in one reason
_U64 = 2**64 - 1
_I64 = 2**63


class _TypeError(Exception):
    """A value Go's encoding/json would not decode into HAMi's struct."""


class _Object(list[tuple[str, Any]]):
    """A JSON object, its pairs in order (duplicates kept: Go lets the later one win)."""


@dataclass(frozen=True)
class NodeConfig:
    """This node's part of HAMi's node configuration, as HAMi reads it."""

    node: str
    entries: int = 0  # nodeconfig entries for this node
    uuids: tuple[str, ...] = ()
    indices: tuple[int, ...] = ()
    mode: str = ""  # operatingmode of the last entry that sets one
    migstrategy: str = ""
    error: str = ""  # why HAMi would apply no filter from this file ("" when it reads it)

    @property
    def filters(self) -> bool:
        """The entries name GPUs to leave out (by UUID or index)."""
        return bool(self.uuids or self.indices)

    @property
    def mig(self) -> bool:
        """HAMi runs the GPUs in MIG mode: what it registers is not one device per GPU."""
        return self.mode == "mig" or self.migstrategy not in ("", "none")


def _fold(key: str) -> str:
    """encoding/json matches keys to fields case-insensitively (U+017F folds to s, U+212A to k)."""
    return key.lower().replace("\u017f", "s")


def _fields(value: Any, names: Mapping[str, Callable[[Any], Any]], where: str) -> dict[str, Any]:
    """An object's known fields, decoded by `names` (folded name -> decoder); a later duplicate wins."""
    if value is None:
        return {}
    if not isinstance(value, _Object):
        raise _TypeError(f"{where}: expected an object")
    out: dict[str, Any] = {}
    for key, item in value:
        name = _fold(key)
        if name in names:
            out[name] = names[name](item)
    return out


def _string(where: str) -> Callable[[Any], str]:
    def decode(value: Any) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise _TypeError(f"{where}: expected a string")
        return value

    return decode


def _boolean(where: str) -> Callable[[Any], bool]:
    def decode(value: Any) -> bool:
        if value is not None and not isinstance(value, bool):
            raise _TypeError(f"{where}: expected true or false")
        return bool(value)

    return decode


def _whole(where: str, low: int, high: int) -> Callable[[Any], int]:
    """A JSON number Go decodes into an integer field: digits only (no fraction, no exponent)."""

    def decode(value: Any) -> int:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _TypeError(f"{where}: expected a whole number from {low} to {high}")
        return value

    return decode


def _real(where: str) -> Callable[[Any], float]:
    def decode(value: Any) -> float:
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _TypeError(f"{where}: expected a number")
        return float(value)

    return decode


def _list(where: str, item: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    def decode(value: Any) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list) or isinstance(value, _Object):
            raise _TypeError(f"{where}: expected a list")
        return [item(v) for v in value]

    return decode


def _number(text: str) -> int | float:
    """A JSON number as Go sees its text: an integer literal stays one, anything else is a float."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python accepts NaN and Infinity; Go does not


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    return _Object(pairs)


def parse_node_config(data: bytes, node: str) -> NodeConfig:
    """The filter and MIG settings HAMi's plugin on `node` takes from `data` (config.json). Total."""
    try:
        return _parse(data, node)
    except _TypeError as e:
        return NodeConfig(node, error=f"HAMi cannot decode it ({e}), so it filters nothing")
    except (ValueError, RecursionError, OverflowError, MemoryError) as e:
        # Invalid JSON, or too deep: HAMi's decoder refuses it and its plugin filters nothing.
        why = f"{type(e).__name__}: {str(e)[:120]}"
        return NodeConfig(node, error=f"not JSON HAMi reads ({why}), so it filters nothing")


def _parse(data: bytes, node: str) -> NodeConfig:
    text = data.decode("utf-8", errors="replace")  # Go replaces invalid UTF-8 as well
    doc = json.loads(
        text,
        object_pairs_hook=_pairs,
        parse_int=_number,
        parse_float=_number,
        parse_constant=_no_constant,
    )
    filters = {
        "uuid": _list("filterdevices.uuid", _string("filterdevices.uuid[]")),
        "index": _list("filterdevices.index", _whole("filterdevices.index[]", 0, _U64)),
    }
    entry = {
        "name": _string("nodeconfig[].name"),
        "operatingmode": _string("nodeconfig[].operatingmode"),
        "migstrategy": _string("nodeconfig[].migstrategy"),
        "filterdevices": lambda v: _fields(v, filters, "nodeconfig[].filterdevices"),
        "enablegetpreferredallocation": _boolean("nodeconfig[].enablegetpreferredallocation"),
        # HAMi's per-node defaults (NodeDefaultConfig): a wrong type here also fails the whole file.
        "devicesplitcount": _whole("nodeconfig[].devicesplitcount", 0, _U64),
        "devicememoryscaling": _real("nodeconfig[].devicememoryscaling"),
        "devicecorescaling": _real("nodeconfig[].devicecorescaling"),
        "preconfigureddevicememory": _whole("nodeconfig[].preconfigureddevicememory", -_I64, _I64 - 1),
        "libcudaloglevel": _string("nodeconfig[].libcudaloglevel"),
        "enablenumatopology": _boolean("nodeconfig[].enablenumatopology"),
    }

    def one(value: Any) -> dict[str, Any]:
        return _fields(value, entry, "nodeconfig[]")

    top = _fields(doc, {"nodeconfig": _list("nodeconfig", one)}, "the document")
    uuids: list[str] = []
    indices: list[int] = []
    mode = mig = ""
    mine = 0
    for e in top.get("nodeconfig", []):
        if e.get("name", "") != node:
            continue
        mine += 1
        f = e.get("filterdevices")
        if f and (f.get("uuid") or f.get("index")):
            uuids, indices = f.get("uuid", []), f.get("index", [])
        mode = e.get("operatingmode") or mode
        mig = e.get("migstrategy") or mig
    return NodeConfig(node, mine, tuple(uuids), tuple(indices), mode, mig)


@dataclass(frozen=True)
class Filtered:
    """A GPU HAMi's node configuration leaves out, and the entry that does."""

    device: str  # "index 1, <UUID>, <its device node>"
    why: str  # which filter entry names it


@dataclass(frozen=True)
class Expectation:
    """How many healthy devices HAMi registers here, at least, and how that was found."""

    want: int  # the minimum the kubelet should list
    host: int  # --device-glob matches
    expected: tuple[str, ...] = ()  # the devices counted
    filtered: tuple[Filtered, ...] = ()
    notes: tuple[str, ...] = ()  # what could not be told, MIG, vfio, the config's state
    config: str = ""  # the config file read ("" when none)

    def summary(self) -> str:
        """One line for the check's reason."""
        parts = [f"{self.host} device node(s) on the host"]
        if self.filtered:
            names = "; ".join(f"{f.device} ({f.why})" for f in self.filtered[:SHOWN])
            if len(self.filtered) > SHOWN:
                names += f"; and {len(self.filtered) - SHOWN} more"
            parts.append(f"{len(self.filtered)} filtered by HAMi's node configuration: {names}")
        parts += self.notes
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """For /status."""
        return {
            "want": self.want,
            "host_device_nodes": self.host,
            "expected": list(self.expected),
            "filtered": [{"device": f.device, "why": f.why} for f in self.filtered],
            "notes": list(self.notes),
            "hami_config": self.config or None,
        }


@dataclass(frozen=True)
class Sources:
    """Where the node's facts are read (the defaults are the real paths; tests point elsewhere)."""

    device_glob: str
    config_path: str = CONFIG_PATH  # "": none (a vendor whose plugin reads no node configuration)
    node_name: str = ""
    gpus_dir: str = profiles.DEFAULT.devices.driver_gpus
    vfio_dir: str = VFIO_DIR
    profile: VendorProfile = profiles.DEFAULT  # the GPUs' vendor: their device nodes, PCI vendor ID


@dataclass
class _Read:
    notes: list[str] = field(default_factory=list)


def expectation(src: Sources) -> Expectation:
    """The minimum HAMi registers: the host's device nodes, less those its node configuration filters."""
    try:
        return _expectation(src)
    except Exception as e:  # a hostile node never costs the round: the plain count stands
        host = _glob_count(src.device_glob)
        return Expectation(host, host, notes=(f"HAMi's filter not applied: {type(e).__name__}: {e}",))


def _glob_count(pattern: str) -> int:
    try:
        return len(glob.glob(pattern))
    except Exception:
        return 0


def _expectation(src: Sources) -> Expectation:
    nodes = sorted(glob.glob(src.device_glob))
    folder = os.path.dirname(src.device_glob) or "/dev"
    notes: list[str] = []
    vfio = vfio_gpus(src.vfio_dir, src.profile.devices.pci_vendor) if src.profile.devices.pci_vendor else []
    if vfio:
        notes.append(
            f"{len(vfio)} {src.profile.vendor} GPU(s) bound to vfio-pci (handed to virtual machines) have no "
            f"device node and are not counted: {', '.join(vfio)}"
        )
    if not src.config_path:  # the vendor's plugin reads no node configuration of HAMi's: nothing filtered
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes))
    try:
        raw = read_bounded(src.config_path, MAX_CONFIG_BYTES, follow=True)
    except FileNotFoundError:
        notes.append(f"no HAMi node configuration at {src.config_path}: nothing filtered")
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes))
    except OSError as e:
        notes.append(f"{src.config_path} cannot be read ({e.strerror}): HAMi's filter not subtracted")
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes))
    if len(raw) > MAX_CONFIG_BYTES:
        notes.append(f"{src.config_path} is over {MAX_CONFIG_BYTES} bytes: not read, nothing subtracted")
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes), src.config_path)
    if not src.node_name:
        notes.append(
            f"the node's name is unknown (set {NODE_NAME_ENV} as HAMi's pod does, or --node-name): "
            f"{src.config_path} not applied"
        )
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes), src.config_path)
    cfg = parse_node_config(raw, src.node_name)
    if cfg.error:
        notes.append(f"{src.config_path}: {cfg.error}")
    elif not cfg.entries:
        notes.append(f"{src.config_path} has no nodeconfig entry named {src.node_name}: nothing filtered")
    if cfg.mig:
        # MIG devices are registered instead of whole GPUs, as many as the GPUs are cut into.
        notes.append(
            f"HAMi registers MIG devices here (operatingmode {cfg.mode or '-'}, migstrategy "
            f"{cfg.migstrategy or '-'}): auto cannot count them from device nodes, so it wants at least one"
        )
        return Expectation(1 if nodes else 0, len(nodes), tuple(nodes), (), tuple(notes), src.config_path)
    if not cfg.filters:
        return Expectation(len(nodes), len(nodes), tuple(nodes), (), tuple(notes), src.config_path)
    return _subtract(src, cfg, nodes, folder, notes)


def _subtract(src: Sources, cfg: NodeConfig, nodes: list[str], folder: str, notes: list[str]) -> Expectation:
    gpus, unread = read_gpus(src.gpus_dir)
    where = f"filterdevices of nodeconfig {cfg.node} in {src.config_path}"
    uuids, indices = set(cfg.uuids), set(cfg.indices)
    if not gpus:
        # UUIDs cannot be matched to device nodes: each listed UUID and each index below the count is
        # taken as one filtered GPU, at most all of them (an expectation too low fails nothing wrongly).
        n = min(len(nodes), len(uuids) + len([i for i in indices if i < len(nodes)]))
        notes.append(
            f"{unread or 'the driver lists no GPU'}: {n} GPU(s) taken as filtered from {where} without "
            "matching UUIDs"
        )
        guessed = tuple(Filtered(f"uuid {u[:80]}", where) for u in sorted(uuids)) + tuple(
            Filtered(f"index {i}", where) for i in sorted(indices) if i < len(nodes)
        )
        return Expectation(len(nodes) - n, len(nodes), (), guessed[:n], tuple(notes), src.config_path)
    listed = set(nodes)
    node = src.profile.devices.node  # a GPU's device node by its minor
    # NVML's index: rank in PCI bus order of the GPUs the driver does not exclude.
    ranked = sorted((g for g in gpus if not g.excluded), key=lambda g: g.bus.lower())
    expected: list[str] = []
    filtered: list[Filtered] = []
    for index, gpu in enumerate(ranked):
        path = gpu.node(folder, node)
        name = f"index {index}, {gpu.uuid or 'no UUID'}, {path}"
        if gpu.uuid and gpu.uuid in uuids:
            filtered.append(Filtered(name, f"uuid listed in {where}"))
        elif index in indices:
            filtered.append(Filtered(name, f"index listed in {where}"))
        elif path in listed:
            expected.append(name)
    for gpu in gpus:
        if gpu.excluded and gpu.node(folder, node) in listed:  # NVML does not list it, so HAMi cannot
            filtered.append(
                Filtered(f"{gpu.uuid or 'no UUID'}, {gpu.node(folder, node)}", "the driver excludes it")
            )
    # Device nodes no GPU of the driver's list explains are counted as before.
    known = {g.node(folder, node) for g in gpus}
    expected += [n for n in nodes if n not in known]
    gone = [f for f in filtered if f.device.rsplit(", ", 1)[-1] in listed]
    want = max(0, len(nodes) - len(gone))
    return Expectation(want, len(nodes), tuple(expected), tuple(filtered), tuple(notes), src.config_path)
