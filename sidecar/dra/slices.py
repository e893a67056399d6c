"""The node's ResourceSlices per DRA driver, read from the API server: optional evidence.

Only when configured (`--dra-resourceslices`): the sidecar works without API access and never
calls the API otherwise. One LIST per reading, of the node's slices (`spec.nodeName`), grouped by
`spec.driver`, with the pod's ServiceAccount token. The kubelet's DRA manager deletes a driver's
slices on the node 30 s after no plugin of it is usable, and all of the node's at its start
(docs/kubelet.md#dra); the driver's helper publishes them. So slices present say the kubelet has
not given the driver up in the last 30 s; none say it has, or that the driver publishes nothing.
Either way the reading only adds to the verdicts' reasons: it never changes one. A 401, a 403, a
timeout or an answer that does not parse is "no evidence", never a failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sidecar.kube.access import ApiAccess
from sidecar.kube.client import get, off_loop

__all__ = ["ApiAccess", "Slices", "parse_slices", "read_slices"]

PATH = "/apis/resource.k8s.io/v1/resourceslices"
MAX_BODY = 8 * 1024 * 1024  # a node's slices; more is not read
MAX_VALUES = MAX_BODY // 32  # their JSON values (commas and colons counted); more is not parsed


@dataclass(frozen=True)
class Slices:
    """The node's ResourceSlices by driver (name -> devices in its slices), or why there is no reading."""

    by_driver: dict[str, tuple[int, int]] | None  # driver -> (slices, devices)
    why: str = ""

    def of(self, driver: str) -> tuple[int, int] | None:
        """`driver`'s (slices, devices), (0, 0) when it has none; None when there is no reading."""
        if self.by_driver is None:
            return None
        return self.by_driver.get(driver, (0, 0))


def parse_slices(body: bytes, node: str) -> Slices:
    """A ResourceSliceList's slices of `node`, by driver; total: any input gives a reading or a why."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        return Slices(None, f"the answer is not JSON: {type(e).__name__}")
    items = doc.get("items") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        return Slices(None, "the answer is not a ResourceSliceList")
    out: dict[str, tuple[int, int]] = {}
    for item in items:
        spec = _dict(_dict(item).get("spec"))
        driver, on = spec.get("driver"), spec.get("nodeName")
        if (
            not isinstance(driver, str)
            or on != node
            or _dict(_dict(item).get("metadata")).get("deletionTimestamp")
        ):
            continue
        devices = spec.get("devices")
        n, d = out.get(driver, (0, 0))
        out[driver] = (n + 1, d + (len(devices) if isinstance(devices, list) else 0))
    return Slices(out)


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


async def read_slices(access: ApiAccess, node: str, timeout: float) -> Slices:
    """LIST the node's ResourceSlices; a reading, or why there is none (never an exception)."""
    path = f"{PATH}?fieldSelector={quote(f'spec.nodeName={node}', safe='=')}"
    answer = await get(access, path, timeout, MAX_BODY, MAX_VALUES)
    if answer.status is None:
        return Slices(None, f"{answer.why} (no evidence)")
    if answer.status != 200:
        return Slices(None, f"the API server answered {answer.status} (no evidence)")
    if answer.why:  # past a bound, or an encoding not asked for
        return Slices(None, f"the node's ResourceSlices: {answer.why}")
    return await off_loop(parse_slices, answer.body, node)  # not on the loop that answers /healthz
