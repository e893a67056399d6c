"""HAMi's device plugin writing its Node annotation, for the test rig: the node end-to-end's stand-in
(testing/standin.py) runs it against the node's API server, tests/hamifixture.py against a test's.

Written from HAMi's behaviour as docs/kubelet.md#hami-registration states it (Project-HAMi/HAMi, read at
v2.10.0), never from its code. `Registrar` is the plugin's `WatchAndRegister` loop
(pkg/device-plugin/nvidiadevice/nvinternal/plugin/register.go), and mirrors these facts:

- each round GETs the Node (an error: logged, retried after the error interval, the cache untouched);
- it lists its GPUs in the order of a Go map (`getAPIDevices` ranges over `rm.Devices` with no sort):
  a new order each round, drawn as Go's runtime draws it (`go_map_order`: a random start slot of the
  map's group of 8; `sidecar.hami.facts.same_order_odds` gives how often two rounds agree), each GPU
  with its own `index`;
- it encodes them as `MarshalNodeDevices` does (pkg/device/devices.go: a JSON array of DeviceInfo with
  `omitempty`, in that order) and compares the encoding **as a string** with its cache: equal, it logs
  `Device info unchanged, skipping annotation update` and patches nothing; otherwise it stores the
  encoding in its cache **before** the merge PATCH of `hami.io/node-nvidia-register` (as v2.10.0 does),
  and a failed PATCH logs `patch node error` and retries after the error interval;
- so after a failed PATCH a round that lists the GPUs in the cached order skips it, and one that lists
  them in another order patches again: on one GPU never, on two about one round in five;
- HAMi waits 30 s after a success and 5 s after an error. A new `Registrar` (a plugin restart: a new
  process, or HAMi's new plugin objects after a kubelet restart) starts with an empty cache.

Other vendors' plugins (`Vendor.of`: the keys and format from the vendor's profile, hami_guard/profiles;
the rest from `PLUGINS`, written from each plugin's code) differ in these facts:

- the register key and format HAMi decodes for them: JSON, or Hygon DCU's legacy CSV text of
  `EncodeNodeDevices`, `id,count,devmem,devcore,type,numa,health,index,mode:` per device
  (Project-HAMi/dcu-vgpu-device-plugin internal/pkg/util/util.go);
- what each device's entry holds (`DeviceInfo`): Ascend's count is its vNPU count, devmem and devcore its
  chip's, type its commonWord and custominfo its NetworkID; DCU's count 4 and mode `hami`; AMD's
  devicevendor `amd` and custominfo its PCI address; Biren's count 1 and an empty `devicepairscore`;
  DCU's, AMD's and Biren's write every device healthy;
- the handshake stamp in the same patch: Ascend's `Reported_<2006.01.02 15:04:05>` one second ahead
  (Project-HAMi/ascend-device-plugin internal/server/register.go), DCU's `Reported <time.Now()>`
  (Go's Time.String(), its register.go), Biren's `Reported_` with the layout `2026.01.02 15:04:05` as
  its pkg/brgpu/register.go writes it (Go reads `2` and `02` there as the day: `go_format`); NVIDIA's
  (since v2.8.0) and AMD's none: the scheduler's `Requesting_` alone;
- no cache: every round patches (all but NVIDIA's), and the devices in one order (a slice, or AMD's
  sorted addresses: only NVIDIA's ranges over a map);
- when: every 30 s, 5 s after an error; Biren's when the kubelet opens ListAndWatch and at each
  heartbeat (300 s in its manifest), a failed patch waiting for the next; Ascend's patch also sets
  `hami-vnpu-core` (`false`: hamiVnpuCore off).

`Vendor.skewed()` writes the other format, as a plugin built for another HAMi release would.

`held_order` keeps one order for every round, as a one-GPU node's map always does: a test's way to keep a
stale annotation stale on two GPUs.

`InCluster` is the Pod's way to the API server (the ServiceAccount's token and CA, KUBERNETES_SERVICE_*),
on urllib: no client library, the standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from hami_guard import profiles
from sidecar.hami.facts import MAP_GROUP
from sidecar.kube.access import DEFAULT_CA_FILE, DEFAULT_TOKEN_FILE, in_cluster

logger = logging.getLogger(__name__)

REGISTER = "hami.io/node-nvidia-register"
HANDSHAKE = "hami.io/node-handshake"
MERGE = "application/merge-patch+json"
STAMP = "%Y-%m-%d %H:%M:%S"  # the handshake's time, Go's 2006-01-02 15:04:05
INTERVAL = 30.0  # HAMi's wait after a round that succeeded
ERROR_INTERVAL = 5.0  # and after one that failed
MAX_ANSWER = 1 << 20
HAMI_SPLIT = 10  # deviceSplitCount (charts/hami/values.yaml)


@dataclass
class Gpu:
    uuid: str  # the device's ID in the annotation
    healthy: bool = True
    custom: tuple[tuple[str, Any], ...] = ()  # its `custominfo` (Ascend's NetworkID, AMD's pciBDF)


Order = Callable[[int], Sequence[int]]
_RANDOM = random.Random()
_STARTED = time.monotonic()  # Go's monotonic clock reading counts from the process's start


def go_map_order(n: int, rng: random.Random = _RANDOM) -> list[int]:
    """The order in which one round lists n GPUs kept in a Go map in the order they were added: Go
    starts each range at a random slot of the map's group of 8 (go1.26 `internal/runtime/maps`,
    `Iter.Init`: `entryOffset = rand()`), and with n <= 8 GPUs in slots 0..n-1 the order is the rotation
    from the first filled slot at or after it. Above 8 the map has several groups: one of 8 rotations,
    which agrees with the 1-in-8 measured with go1.26 (not the order itself)."""
    offset = rng.randrange(MAP_GROUP)
    start = (offset if offset < n else 0) if n <= MAP_GROUP else offset % n
    return [(start + i) % n for i in range(n)]


def held_order(n: int) -> list[int]:
    """One order for every round: a one-GPU node's, or a test's that keeps a stale annotation stale."""
    return list(range(n))


@dataclass(frozen=True)
class DeviceInfo:
    """What a vendor's plugin writes of each device besides its ID, index and custominfo: HAMi's
    DeviceInfo fields (pkg/device/devices.go, and each plugin's copy of the struct), which Go encodes in
    this order and leaves out at 0 or "" (`omitempty`)."""

    count: int = HAMI_SPLIT
    devmem: int = 81920
    devcore: int = 100
    type: str = "NVIDIA-A100-SXM4-80GB"
    numa: int = 0
    mode: str = "hami-core"
    devicevendor: str = ""
    reports_health: bool = True  # False: every device written healthy, whatever the plugin sees
    # Biren's copy of DeviceInfo holds a DevicePairScore struct, which `omitempty` never leaves out: `{}`.
    pair_score: bool = False


NVIDIA_INFO = DeviceInfo()


def device_info_json(gpus: Sequence[Gpu], order: Sequence[int] | None, info: DeviceInfo) -> str:
    """A JSON array of DeviceInfo as Go's json.Marshal writes it: these GPUs listed in `order` (positions
    in `gpus`; default: as given), each with its own index (its position in `gpus`)."""
    out: list[dict[str, Any]] = []
    for i in range(len(gpus)) if order is None else order:
        g = gpus[i]
        d: dict[str, Any] = {"id": g.uuid, "index": i, "count": info.count, "devmem": info.devmem}
        d |= {"devcore": info.devcore, "type": info.type, "numa": info.numa, "mode": info.mode}
        d["health"] = g.healthy or not info.reports_health
        d["devicevendor"] = info.devicevendor
        d["custominfo"] = dict(sorted(g.custom))  # Go writes a map's keys sorted
        d = {k: v for k, v in d.items() if v}
        if info.pair_score:
            d["devicepairscore"] = {}
        out.append(d)
    return json.dumps(out, separators=(",", ":"))


def marshal(
    gpus: Sequence[Gpu], order: Sequence[int] | None = None, split: int = HAMI_SPLIT, memory: int = 81920
) -> str:
    """HAMi's MarshalNodeDevices of these GPUs as its NVIDIA plugin fills them, listed in `order`
    (positions in `gpus`; default: as given), each with its own index (its position in `gpus`, NVML's
    index): Go's encoding, `omitempty` fields left out."""
    return device_info_json(gpus, order, replace(NVIDIA_INFO, count=split, devmem=memory))


DCU_INFO = DeviceInfo(4, 16384, 100, "DCU-Z100", mode="hami", reports_health=False)


def device_info_csv(gpus: Sequence[Gpu], order: Sequence[int] | None, info: DeviceInfo) -> str:
    """HAMi's legacy EncodeNodeDevices text of these GPUs (9 fields each, ended by `:`), listed in
    `order`."""
    return "".join(
        f"{gpus[i].uuid},{info.count},{info.devmem},{info.devcore},{info.type},{info.numa},"
        f"{str(gpus[i].healthy or not info.reports_health).lower()},{i},{info.mode}:"
        for i in (range(len(gpus)) if order is None else order)
    )


def encode_csv(
    gpus: Sequence[Gpu], order: Sequence[int] | None = None, split: int = 4, memory: int = 16384
) -> str:
    """HAMi's legacy EncodeNodeDevices text of these GPUs (9 fields each, ended by `:`), with the
    health each has, listed in `order`."""
    return device_info_csv(gpus, order, replace(DCU_INFO, count=split, devmem=memory, reports_health=True))


def go_format(layout: str, t: time.struct_time) -> str:
    """`t` as Go's Time.Format writes it with `layout`, for the numeric tokens (2006, 01, 02, 15, 04, 05,
    2, 1, 03, 06; time/format.go nextStdChunk); everything else is copied. A layout that is not Go's
    reference ("2026.01.02 15:04:05", Biren's) reads as Go reads it: `2` the day, `02` the day, `6` text."""
    out, i = [], 0
    zero = (t.tm_mon, t.tm_mday, t.tm_hour % 12 or 12, t.tm_min, t.tm_sec, t.tm_year % 100)
    while i < len(layout):
        rest = layout[i:]
        if rest.startswith("2006"):
            out.append(f"{t.tm_year:04d}")
            i += 4
        elif rest[0] == "0" and rest[1:2] in tuple("123456"):
            out.append(f"{zero[int(rest[1]) - 1]:02d}")
            i += 2
        elif rest.startswith("15"):
            out.append(f"{t.tm_hour:02d}")
            i += 2
        elif rest[0] in "12":
            out.append(str(t.tm_mon if rest[0] == "1" else t.tm_mday))
            i += 1
        else:
            out.append(rest[0])
            i += 1
    return "".join(out)


def go_time_string(now: float) -> str:
    """Go's time.Now().String(): `2006-01-02 15:04:05.999999999 -0700 MST m=+<seconds>`, the fraction's
    trailing zeros cut, the monotonic reading since the process started."""
    t = time.localtime(now)
    fraction = f"{round(now % 1 * 1e9) % 10**9:09d}".rstrip("0")
    clock = go_format("2006-01-02 15:04:05", t) + (f".{fraction}" if fraction else "")
    return f"{clock} {time.strftime('%z %Z', t)} m=+{time.monotonic() - _STARTED:.9f}"


@dataclass(frozen=True)
class Vendor:
    """One vendor's plugin as HAMi's annotations see it: its register and handshake keys, the format it
    writes and what it writes of each device, whether it stamps the handshake (and how) in each patch,
    and when it patches."""

    register: str = REGISTER
    format: str = "device-info-json"
    handshake: str = HANDSHAKE
    stamp: str = ""  # "" none (NVIDIA's since HAMi v2.8); else the stamp's prefix: "Reported_" or "Reported "
    layout: str = ""  # the stamp's time, as Go formats it with this layout ("": Go's Time.String())
    offset: float = 0.0  # seconds added to the stamp's time (Ascend's --report_time_offset)
    cached: bool = True  # patches only a changed encoding, cache written first (NVIDIA's); else every round
    info: DeviceInfo = NVIDIA_INFO
    map_order: bool = True  # lists its GPUs in a Go map's order, a new one each round (else in one order)
    interval: float = INTERVAL  # seconds between rounds after a success
    error_interval: float = ERROR_INTERVAL  # and after an error
    # Patches when the kubelet opens ListAndWatch (and at its heartbeat, `interval`), not after Register.
    on_list_and_watch: bool = False
    extra: tuple[tuple[str, str], ...] = ()  # other annotations in the same patch

    @classmethod
    def of(cls, vendor: str, resource: str) -> Vendor:
        """The vendor's plugin for `resource`: its keys and format from its profile, the rest from
        `PLUGINS` (a profile without an entry there: NVIDIA's plugin's behaviour with its keys)."""
        p = profiles.named(vendor)
        if p is None:
            raise ValueError(f"no vendor profile {vendor!r}")
        keys = cls(p.register_key(resource), p.hami.register_format, p.handshake_key(resource))
        plugin = PLUGINS.get(p.name)
        return replace(keys, cached=p.hami.stuck_cache, **plugin(resource)) if plugin else keys

    @classmethod
    def for_resource(cls, resource: str) -> Vendor:
        """The plugin of the vendor whose profile owns `resource` (NVIDIA's HAMi plugin otherwise)."""
        p = profiles.for_resource(resource)
        return cls.of(p.name, resource) if p is not None else cls()

    def skewed(self) -> Vendor:
        """The same plugin writing the other format (built for another HAMi release)."""
        other = "device-info-csv" if self.format == "device-info-json" else "device-info-json"
        return replace(self, format=other)

    def encode(self, gpus: Sequence[Gpu], order: Sequence[int]) -> str:
        if self.format == "device-info-csv":
            return device_info_csv(gpus, order, self.info)
        return device_info_json(gpus, order, self.info)

    def stamped(self, now: float | None = None) -> str:
        """The handshake's value the plugin writes now."""
        now = time.time() if now is None else now
        if not self.layout:
            return self.stamp + go_time_string(now)
        return self.stamp + go_format(self.layout, time.localtime(now + self.offset))


def _ascend(resource: str) -> dict[str, Any]:
    """Project-HAMi/ascend-device-plugin v1.4.0, internal/server/register.go registerHAMi and
    watchAndRegister; the device's facts are HAMi's chart's Ascend910B3 (memoryAllocatable, aiCore)."""
    common_word = resource.rsplit("/", 1)[-1]
    info = DeviceInfo(4, 65536, 20, common_word, mode="")
    return dict(
        stamp="Reported_",
        layout="2006.01.02 15:04:05",
        offset=1.0,  # --report_time_offset's default
        info=info,
        map_order=False,  # its devices are a slice, in DCMI's order
        extra=(("hami-vnpu-core", "false"),),  # VNPUNodeSelectorAnnotation, hamiVnpuCore off
    )


def _dcu(_resource: str) -> dict[str, Any]:
    """Project-HAMi/dcu-vgpu-device-plugin, internal/pkg/dcu/register.go: every device written healthy,
    count 4, devcore 100, type `DCU-<name>`, mode `hami` (internal/pkg/util/util.go)."""
    return dict(stamp="Reported ", info=DCU_INFO, map_order=False)


def _amd(_resource: str) -> dict[str, Any]:
    """Project-HAMi/amd-device-plugin, internal/pkg/plugin/plugin.go getAPIDevices: count 10, devmem the
    VRAM in MiB, devcore the CU count, type AMD SMI's market name, every device healthy, devicevendor
    `amd`; the GPUs sorted by PCI address; no handshake."""
    info = DeviceInfo(10, 196608, 304, "AMD Instinct MI300X", mode="", devicevendor="amd")
    return dict(info=replace(info, reports_health=False), map_order=False)


def _biren(_resource: str) -> dict[str, Any]:
    """Project-HAMi/biren-device-plugin, pkg/brgpu/register.go RegisterHAMiWithRawDevice (runc): count 1,
    type the GPU's name, devmem its memory in MiB, every device healthy, the stamp's layout
    "2026.01.02 15:04:05" as written there; patched when the kubelet opens ListAndWatch and at each
    heartbeat (--pulse, 300 s in deploy/biren-device-plugin.yaml), a failed patch's error dropped
    (pkg/brgpu/plugin.go)."""
    info = DeviceInfo(1, 65024, 0, "BR106", mode="", reports_health=False, pair_score=True)
    return dict(
        stamp="Reported_",
        layout="2026.01.02 15:04:05",
        info=info,
        map_order=False,
        interval=300.0,
        error_interval=300.0,
        on_list_and_watch=True,
    )


# The plugin's facts besides its keys and format, by profile name; NVIDIA's are Vendor's defaults
# (HAMi's in-tree plugin, pkg/device-plugin/nvidiadevice/nvinternal/plugin/register.go).
PLUGINS: dict[str, Callable[[str], dict[str, Any]]] = {
    "nvidia": lambda _resource: {},
    "ascend": _ascend,
    "dcu": _dcu,
    "amd": _amd,
    "biren": _biren,
}


def same_devices(a: str | None, b: str | None) -> bool:
    """Whether two register annotations list the same devices, in whatever order (HAMi's own order
    changes from round to round); False when either is absent or not a JSON list."""
    try:
        la, lb = json.loads(a or "null"), json.loads(b or "null")
    except ValueError:
        return False
    if not isinstance(la, list) or not isinstance(lb, list):
        return False
    return sorted(json.dumps(x, sort_keys=True) for x in la) == sorted(
        json.dumps(x, sort_keys=True) for x in lb
    )


class NodeApi(Protocol):
    """What the loop asks of the API server: JSON in and out; an error status raises RuntimeError."""

    async def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any: ...


class ApiError(RuntimeError):
    """The API server answered an error, or could not be asked."""


@dataclass(frozen=True)
class InCluster:
    """The API server as a Pod reaches it: its ServiceAccount's token (re-read on every request) and CA."""

    server: str
    token_file: str = DEFAULT_TOKEN_FILE
    ca_file: str = DEFAULT_CA_FILE
    timeout: float = 10.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> InCluster | None:
        """The Pod's API server (KUBERNETES_SERVICE_HOST/PORT); None outside a Pod."""
        server = in_cluster(environ)
        return cls(server) if server else None

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """One request, blocking; the answer's JSON. Raises ApiError."""
        try:
            with open(self.token_file, encoding="utf-8") as f:
                token = f.read().strip()
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ApiError(f"{method} {path}: {e}") from None
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=ctx) as r:
                return json.loads(r.read(MAX_ANSWER))
        except urllib.error.HTTPError as e:
            text = e.read(300).decode(errors="replace")
            raise ApiError(f"{method} {path}: {e.code} {text}") from None
        except (OSError, ValueError) as e:
            raise ApiError(f"{method} {path}: {e}") from None

    async def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any:
        return await asyncio.to_thread(self.call, method, path, body, content_type)


class Registrar:
    """The device plugin's WatchAndRegister loop for one Node. `gpus` gives the plugin's own view of its
    GPUs each round (in the order they were added to its map); `order`, the order a round lists them in;
    `fail_patch`, asked before each PATCH, True: this PATCH is sent with a stale resourceVersion, which the
    API server refuses (409 Conflict), a failed PATCH as any other."""

    def __init__(
        self,
        api: NodeApi,
        node: str,
        gpus: Callable[[], Sequence[Gpu]],
        *,
        interval: float = INTERVAL,
        error_interval: float = ERROR_INTERVAL,
        fail_patch: Callable[[], bool] = lambda: False,
        order: Order = go_map_order,
        vendor: Vendor | None = None,
    ) -> None:
        self.vendor = vendor or Vendor()
        self.api = api
        self.node = node
        self.gpus = gpus
        self.interval = interval
        self.error_interval = error_interval
        self.fail_patch = fail_patch
        self.order = order
        self.cache = ""
        self.log: list[str] = []
        self.patches = 0  # PATCHes the API server took
        self.error = ""  # the last round's error
        self._task: asyncio.Task[None] | None = None

    def say(self, line: str) -> None:
        self.log.append(line)
        logger.info("%s", line)

    async def register_once(self) -> bool:
        """One round of RegisterInAnnotation; False after an error."""
        path = f"/api/v1/nodes/{self.node}"
        try:
            await self.api.request("GET", path)
        except (RuntimeError, OSError) as e:
            self.error = str(e)
            self.say(f"get node error {e}")
            return False
        gpus, v = self.gpus(), self.vendor
        encoded = v.encode(gpus, self.order(len(gpus)))
        if v.cached and encoded == self.cache:  # a string: the same devices in another order differ
            self.say("Device info unchanged, skipping annotation update")
            return True
        self.cache = encoded  # HAMi's order: the cache first, then the patch
        self.say(f"Updating node annotations with {len(gpus)} device(s)")
        annotations = {v.register: encoded}
        if v.stamp:
            annotations[v.handshake] = v.stamped()
        annotations |= dict(v.extra)
        meta: dict[str, Any] = {"annotations": annotations}
        if self.fail_patch():
            meta["resourceVersion"] = "1"  # a precondition the Node no longer meets
        try:
            await self.api.request("PATCH", path, {"metadata": meta}, content_type=MERGE)
        except (RuntimeError, OSError) as e:
            self.error = str(e)
            self.say(f"patch node error {e}")
            return False
        self.patches += 1
        return True

    async def run(self) -> None:
        """The loop, until cancelled."""
        self.say("Starting WatchAndRegister")
        while True:
            ok = await self.register_once()
            if not ok:
                self.say(
                    f"Failed to register annotation: {self.error}. Retrying in {self.error_interval:g}s..."
                )
            await asyncio.sleep(self.interval if ok else self.error_interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def restart(self) -> None:
        """A plugin restart: a new process, whose cache is empty."""
        await self.stop()
        self.cache = ""
        self.start()


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name as HAMi's pod is told it (NODE_NAME, from spec.nodeName)."""
    return (os.environ if environ is None else environ).get("NODE_NAME", "")
