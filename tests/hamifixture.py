"""HAMi-shaped writers and readers of a Node's annotations, for tests against a real API server
(tests/apiserver.py).

Written from HAMi's behaviour as docs/kubelet.md#hami-registration states it (Project-HAMi/HAMi, read
at v2.10.0), never from its code; the facts each part mirrors:

- `HamiRegistrar`: the device plugin's `WatchAndRegister` loop
  (pkg/device-plugin/nvidiadevice/nvinternal/plugin/register.go), testing/hamiwriter.py's `Registrar` (the
  node end-to-end's stand-in for HAMi's plugin runs the same loop) as a user of the test's API server:
  each round lists the GPUs in Go's map order (a new one each round, unless the test holds it), encodes
  them as `MarshalNodeDevices` does, compares the encoding as a string with its cache, and writes the
  cache before the merge PATCH of `hami.io/node-nvidia-register`; a failed PATCH is retried after the
  error interval, and skipped as "unchanged" by a round in the cached order. HAMi waits 30 s after a
  success and 5 s after an error; the tests scale both down. `restart()` is a plugin restart: a new
  process, an empty cache.
- `HamiScheduler`: the scheduler's `register()` for one node and NVIDIA (pkg/scheduler/scheduler.go, run
  every 15 s: the test calls `tick`), with NVIDIA's `CheckHealth` (pkg/device/nvidia/device.go) and the
  shared handshake check (pkg/device/devices.go), on the test's clock. Each tick:
  1. the register annotation is decoded (`GetNodeDevices`: missing, not JSON, or an empty list is an
     error);
  2. the health check: the Node's allocatable `nvidia.com/gpu` at 0 after a count it had seen is
     unhealthy at once; at 0 before any, the handshake decides; a count that changed, or an annotation
     that changed as a string, asks for the devices to be read again. The handshake: `Requesting_<local
     time 2006-01-02 15:04:05>` is kept, healthy, while under 60 s old or while the allocatable is above
     0, unhealthy after; anything else is replaced by `Requesting_<now>` (healthy, read again);
  3. unhealthy and in its cache: `Device is unhealthy, cleaning up node`, the node's devices dropped from
     its cache, the handshake removed (v2.10; `Deleted_<time>` before);
  4. the annotation unreadable: **the cache keeps its last copy** (v2.10 after the health check; before
     v2.9 and in v2.9 before it, the health check then skipped);
  5. asked to read again: its copy of the node's devices is the annotation's.
  `offers()` is what NVIDIA's `Fit` offers a Pod on the node: the healthy devices of its copy (an
  unhealthy one is skipped, `CardNotHealth`), or None, which Pods see as `node unregistered`.
  With `release="before-v2.9"` it is the shared check alone of the releases before v2.9 (NVIDIA's up to
  v2.7, other vendors' up to v2.8): a `Deleted` handshake is kept as it is, and the node's devices stay
  out of the cache while it stays.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from testing.hamiwriter import (
    HANDSHAKE,
    MERGE,
    REGISTER,
    STAMP,
    Gpu,
    Order,
    Registrar,
    Vendor,
    go_map_order,
    held_order,
    marshal,
    same_devices,
)
from tests.apiserver import ApiServer

__all__ = [
    "HANDSHAKE",
    "MERGE",
    "REGISTER",
    "STAMP",
    "Gpu",
    "HamiRegistrar",
    "HamiScheduler",
    "Vendor",
    "go_map_order",
    "held_order",
    "marshal",
    "same_devices",
]


@dataclass(frozen=True)
class AsUser:
    """A test's API server, asked as one of its users (testing/hamiwriter.py's NodeApi)."""

    api: ApiServer
    user: str

    async def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any:
        return await self.api.request(method, path, body, user=self.user, content_type=content_type)


class HamiRegistrar(Registrar):
    """The device plugin's WatchAndRegister loop, as the user `user` of the API server; `gpus` is read
    each round (a test changes a GPU's health in it)."""

    def __init__(
        self,
        api: ApiServer,
        node: str,
        gpus: list[Gpu],
        *,
        user: str = "hami-plugin",
        interval: float = 30.0,
        error_interval: float = 5.0,
        order: Order = go_map_order,
        vendor: Vendor | None = None,
    ) -> None:
        super().__init__(
            AsUser(api, user),
            node,
            lambda: gpus,
            interval=interval,
            error_interval=error_interval,
            order=order,
            vendor=vendor,
        )


@dataclass
class HamiScheduler:
    """The scheduler's view of one node, one tick at a time, on the test's clock."""

    api: ApiServer
    node: str
    resource: str = "nvidia.com/gpu"
    release: Literal["v2.10", "before-v2.9"] = "v2.10"
    now: Callable[[], float] = time.time
    copy: list[dict[str, Any]] | None = None  # the node's devices in its cache; None: not cached
    reported_count: int = 0  # NVIDIA's ReportedGPUNum
    reported_annotation: str = ""  # NVIDIA's ReportedRegisterAnnos
    log: list[str] = field(default_factory=list)

    @property
    def sees(self) -> bool:
        """The node's devices are in its cache."""
        return self.copy is not None

    def offers(self) -> frozenset[str] | None:
        """The GPUs NVIDIA's Fit may place a Pod on: the healthy ones of its copy; None: `node
        unregistered`."""
        if self.copy is None:
            return None
        return frozenset(d["id"] for d in self.copy if d.get("health") is True)

    async def tick(self) -> None:
        n = await self.api.request("GET", f"/api/v1/nodes/{self.node}")
        annotations = n["metadata"].get("annotations") or {}
        allocatable = (n.get("status") or {}).get("allocatable") or {}
        count = int(allocatable.get(self.resource, "0") or 0)
        devices = _decode(annotations.get(REGISTER))
        if devices is None and self.release != "v2.10":
            return  # before v2.10 an unreadable annotation skips the health check: the copy stays
        healthy, update = await self._check_health(annotations, count)
        if not healthy:
            if self.copy is not None:
                self.log.append(f"Device is unhealthy, cleaning up node nodeName={self.node}")
                self.copy, self.reported_count, self.reported_annotation = None, 0, ""
                stamp = time.strftime(STAMP, time.localtime(self.now()))
                await self._annotate(None if self.release == "v2.10" else f"Deleted_{stamp}")
            return
        if devices is None or not update:
            return  # the last copy stays
        self.copy = devices
        self.log.append(f"Node device added nodeName={self.node} devices={len(devices)}")

    async def _check_health(self, annotations: dict[str, str], count: int) -> tuple[bool, bool]:
        handshake = await self._handshake(annotations, count)
        if self.release != "v2.10":
            return handshake
        register = annotations.get(REGISTER, "")
        if count == 0:
            if self.reported_count == 0:
                return handshake
            self.reported_count, self.reported_annotation = 0, register
            return False, handshake[1]
        if self.reported_count != count:
            self.reported_count, self.reported_annotation = count, register
            return True, True
        if self.reported_annotation != register:
            self.reported_annotation = register
            return handshake[0], True
        return handshake

    async def _handshake(self, annotations: dict[str, str], count: int) -> tuple[bool, bool]:
        handshake = annotations.get(HANDSHAKE, "")
        if "Requesting" in handshake:
            _, _, stamp = handshake.partition("_")
            try:
                then = time.mktime(time.strptime(stamp, STAMP))
            except ValueError:
                return True, False
            return (self.now() < then + 60 or count > 0), False
        if "Deleted" in handshake and self.release == "before-v2.9":
            return True, False  # kept as it is: "healthy, no update", and the devices never come back
        await self._annotate(f"Requesting_{time.strftime(STAMP, time.localtime(self.now()))}")
        return True, True

    async def _annotate(self, value: str | None) -> None:
        body = {"metadata": {"annotations": {HANDSHAKE: value}}}
        await self.api.request("PATCH", f"/api/v1/nodes/{self.node}", body, content_type=MERGE)


def _decode(value: str | None) -> list[dict[str, Any]] | None:
    """NVIDIA's GetNodeDevices: the devices, or None for its errors (missing, not a JSON list, empty)."""
    try:
        devices = json.loads(value) if value is not None else None
    except ValueError:
        return None
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
        return None
    return devices
