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

Other vendors' plugins (`Vendor`, from the vendor's profile: hami_guard/profiles) write their own register
key in the format HAMi decodes for them (JSON, or Hygon DCU's legacy CSV text of `EncodeNodeDevices`:
`id,count,devmem,devcore,type,numa,health,index,mode:` per device, Project-HAMi/dcu-vgpu-device-plugin),
and Ascend's and DCU's stamp their handshake key in the same patch every round, with no cache:
`Reported_<2006.01.02 15:04:05>` (Project-HAMi/ascend-device-plugin internal/server/register.go) and
`Reported <time.Now()>` (DCU's register.go). `Vendor.skewed()` writes the other format, as a plugin built
for another HAMi release would.

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


@dataclass
class Gpu:
    uuid: str
    healthy: bool = True


Order = Callable[[int], Sequence[int]]
_RANDOM = random.Random()


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


def marshal(
    gpus: Sequence[Gpu], order: Sequence[int] | None = None, split: int = 10, memory: int = 81920
) -> str:
    """HAMi's MarshalNodeDevices of these GPUs, listed in `order` (positions in `gpus`; default: as given),
    each with its own index (its position in `gpus`, NVML's index): Go's encoding, `omitempty` fields left
    out."""
    out: list[dict[str, Any]] = []
    for i in range(len(gpus)) if order is None else order:
        g = gpus[i]
        d: dict[str, Any] = {"id": g.uuid}
        if i:
            d["index"] = i
        d |= {"count": split, "devmem": memory, "devcore": 100, "type": "NVIDIA-A100-SXM4-80GB"}
        d["mode"] = "hami-core"
        if g.healthy:
            d["health"] = True
        out.append(d)
    return json.dumps(out, separators=(",", ":"))


def encode_csv(
    gpus: Sequence[Gpu], order: Sequence[int] | None = None, split: int = 4, memory: int = 16384
) -> str:
    """HAMi's legacy EncodeNodeDevices text of these GPUs (9 fields each, ended by `:`), as DCU's plugin
    writes it, listed in `order`."""
    return "".join(
        f"{gpus[i].uuid},{split},{memory},100,DCU-Z100,0,{str(gpus[i].healthy).lower()},{i},hami:"
        for i in (range(len(gpus)) if order is None else order)
    )


@dataclass(frozen=True)
class Vendor:
    """One vendor's plugin as HAMi's annotations see it: its register and handshake keys, the format it
    writes, and whether it stamps the handshake (and how) in each round's patch."""

    register: str = REGISTER
    format: str = "device-info-json"
    handshake: str = HANDSHAKE
    stamp: str = ""  # "" none (NVIDIA's since HAMi v2.8); else the stamp's prefix: "Reported_" or "Reported "
    cached: bool = True  # patches only a changed encoding, cache written first (NVIDIA's); else every round

    @classmethod
    def of(cls, vendor: str, resource: str) -> Vendor:
        """The vendor's plugin for `resource`, from its profile."""
        p = profiles.named(vendor)
        if p is None:
            raise ValueError(f"no vendor profile {vendor!r}")
        stamp = {"Ascend": "Reported_", "Hygon DCU": "Reported "}.get(p.vendor, "")
        return cls(
            p.register_key(resource),
            p.hami.register_format,
            p.handshake_key(resource),
            stamp,
            p.hami.stuck_cache,
        )

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
        return encode_csv(gpus, order) if self.format == "device-info-csv" else marshal(gpus, order)

    def stamped(self) -> str:
        now = time.time()
        if self.stamp == "Reported_":
            return self.stamp + time.strftime("%Y.%m.%d %H:%M:%S", time.localtime(now + 1))
        # Go's time.Now().String(): to the nanosecond, a new value every round
        clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        return f"{self.stamp}{clock}.{time.time_ns() % 10**9:09d}"


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
