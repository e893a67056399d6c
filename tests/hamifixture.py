"""HAMi-shaped writers of a Node's annotations, for tests against a real API server (tests/apiserver.py).

Written from HAMi's behaviour as docs/kubelet.md#hami-registration states it (Project-HAMi/HAMi, read
at v2.10), never from its code; the facts each part mirrors:

- `HamiRegistrar`: the device plugin's `WatchAndRegister` loop
  (pkg/device-plugin/nvidiadevice/nvinternal/plugin/register.go), testing/hamiwriter.py's `Registrar` (the
  node end-to-end's stand-in for HAMi's plugin runs the same loop) as a user of the test's API server.
  Each round GETs the Node (an error: logged, retried after the error interval, the cache untouched),
  encodes the devices as `MarshalNodeDevices` does (pkg/device/devices.go: a JSON array of DeviceInfo
  with `omitempty`), and when the encoding equals its cache logs `Device info unchanged, skipping
  annotation update` and patches nothing; otherwise it stores the encoding in its cache **before** the
  merge PATCH of `hami.io/node-nvidia-register`, and a failed PATCH logs `patch node error` and retries
  after the error interval: with the cache already holding the new content, every later round skips.
  HAMi waits 30 s after a success and 5 s after an error; the tests scale both down. `restart()` is a
  plugin restart: a new process, an empty cache.
- `HamiScheduler`: the scheduler's `CheckHealth` of the handshake (pkg/device/devices.go, and
  pkg/scheduler/scheduler.go's 15 s ticker). A handshake holding `Requesting` is kept while its stamp
  (`Requesting_<local time 2006-01-02 15:04:05>`) is under 60 s old, or while the Node's allocatable of
  the resource is above 0; otherwise the node is unhealthy: `Device is unhealthy, cleaning up node`, its
  devices removed (`node unregistered` for Pods), and the handshake removed (v2.10) or set to
  `Deleted_<time>` (before v2.10). Any other handshake is replaced by `Requesting_<now>`. With
  `release="before-v2.9"` it is the handshake check of the releases before v2.9 (NVIDIA's up to v2.7,
  other vendors' up to v2.8): a `Deleted` handshake is kept as it is, and the node's devices stay out of
  the scheduler's cache while it stays. Its clock is the test's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from testing.hamiwriter import HANDSHAKE, MERGE, REGISTER, STAMP, Gpu, Registrar, marshal
from tests.apiserver import ApiServer

__all__ = ["HANDSHAKE", "MERGE", "REGISTER", "STAMP", "Gpu", "HamiRegistrar", "HamiScheduler", "marshal"]


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
    ) -> None:
        super().__init__(
            AsUser(api, user), node, lambda: gpus, interval=interval, error_interval=error_interval
        )


@dataclass
class HamiScheduler:
    """The scheduler's handshake with one node, one tick at a time, on the test's clock."""

    api: ApiServer
    node: str
    resource: str = "nvidia.com/gpu"
    release: Literal["v2.10", "before-v2.9"] = "v2.10"
    now: Callable[[], float] = time.time
    sees: bool = False  # the node's devices are in its cache
    log: list[str] = field(default_factory=list)

    async def tick(self) -> None:
        n = await self.api.request("GET", f"/api/v1/nodes/{self.node}")
        annotations = n["metadata"].get("annotations") or {}
        handshake = annotations.get(HANDSHAKE, "")
        healthy = True
        if "Requesting" in handshake:
            _, _, stamp = handshake.partition("_")
            try:
                then = time.mktime(time.strptime(stamp, STAMP))
            except ValueError:
                then = None
            if then is not None and self.now() >= then + 60:
                allocatable = (n.get("status") or {}).get("allocatable") or {}
                healthy = int(allocatable.get(self.resource, "0") or 0) > 0
        elif "Deleted" in handshake and self.release == "before-v2.9":
            self.sees = False  # kept as it is: "healthy, no update", and the devices never come back
            return
        else:
            await self._annotate(f"Requesting_{time.strftime(STAMP, time.localtime(self.now()))}")
        if not healthy:
            self.log.append(f"Device is unhealthy, cleaning up node nodeName={self.node}")
            self.sees = False
            stamp = time.strftime(STAMP, time.localtime(self.now()))
            await self._annotate(None if self.release == "v2.10" else f"Deleted_{stamp}")
            return
        try:
            devices = json.loads(annotations.get(REGISTER, "null"))
        except ValueError:
            devices = None
        self.sees = bool(devices)

    async def _annotate(self, value: str | None) -> None:
        body = {"metadata": {"annotations": {HANDSHAKE: value}}}
        await self.api.request("PATCH", f"/api/v1/nodes/{self.node}", body, content_type=MERGE)
