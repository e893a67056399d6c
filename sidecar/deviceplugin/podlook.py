"""Between rounds where the kubelet's connections cannot be read: pod-resources' devices alone.

A plugin pod with neither the host's network nor its pids (Ascend's chart) cannot see the kubelet's
connections to its plugin: the accepted end of a Unix connection is made in the network namespace of
the socket that connects (Linux, net/unix/af_unix.c, `unix_stream_connect`), the kubelet's, so the
pod's namespace holds the plugin's listener alone, and nothing of the connections it accepted. The
kubelet's own live view shows a drop at once: pod-resources `GetAllocatableResources` stops listing a
resource's devices when the kubelet ends the plugin's stream. So there, between rounds, that call is
made every connection interval; a device of a held resource that the round listed and that is no longer
listed brings the round forward (docs/design.md#between-rounds). It never makes a verdict: the round
judges from pod-resources and the checkpoint as ever, and a look that cannot tell waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping

from sidecar.deviceplugin.probes import Reading, pod_resources_devices

logger = logging.getLogger(__name__)

Listed = Mapping[str, frozenset[str]]  # a held resource's device IDs, as the round's pod-resources listed


def listed(held: Collection[str], reading: Reading[dict[str, frozenset[str]]] | None) -> Listed | None:
    """What to look for: the held resources' devices the round read (None: nothing to see fall)."""
    if reading is None or reading.value is None:
        return None
    found = {r: reading.value.get(r, frozenset()) for r in held}
    return found if any(found.values()) else None


def fell(before: Listed, now: Reading[dict[str, frozenset[str]]]) -> bool:
    """Does pod-resources no longer list a device it listed for a held resource? False where it cannot
    be read (the next round reads it again)."""
    if now.value is None:
        return False
    return any(not ids <= now.value.get(r, frozenset()) for r, ids in before.items())


class PodResourcesLook:
    """pod-resources read every `every` seconds between rounds, while `watch` was given something to
    look for; `then()` once a device it listed is gone (the look then ends until the next round sets
    one). Runs on the event loop: one unary call, its own channel, as each round's."""

    def __init__(self, path: str, timeout: float, every: float, then: Callable[[], object]) -> None:
        self.path, self.timeout, self.every, self.then = path, timeout, every, then
        self.looks = 0  # calls made
        self._for: Listed | None = None
        self._set = asyncio.Event()

    def watch(self, devices: Listed | None) -> None:
        """Look for `devices` from now on (None: no look). Set after each round."""
        self._for = devices
        if devices is None:
            self._set.clear()
        else:
            self._set.set()

    async def run(self) -> None:
        while True:
            await self._set.wait()
            await asyncio.sleep(self.every)
            before = self._for
            if before is None:
                continue
            try:
                now = await pod_resources_devices(self.path, self.timeout)
            except Exception:  # a look that fails is no answer (the next round reads it), never the end
                logger.debug("pod-resources look failed", exc_info=True)
                now = Reading.failed("pod-resources look failed")
            self.looks += 1
            if before is self._for and fell(before, now):  # not a look a newer round replaced
                self.watch(None)
                self.then()
