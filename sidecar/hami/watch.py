"""HAMi's registration round: this node's Node from the API server, the kubelet's healthy devices, then
`sidecar.hami.verdicts`' verdicts into the `hami:<resource>` checks.

One GET of the Node per reading (HAMi's chart grants its ServiceAccount get/list/update/patch on nodes,
not watch), at most every `every` seconds, its body bounded and parsed totally
(`sidecar.hami.annotation`). The kubelet's healthy devices come from pod-resources, as the device
plugins' round reads them; the plugin's own checks (`plugin:`, `registered:`) from the health state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

from sidecar.config import Settings
from sidecar.deviceplugin.probes import Reading, pod_resources_devices, socket_identity
from sidecar.hami.annotation import MAX_NODE, NodeView, parse_node
from sidecar.hami.facts import cache_fixed
from sidecar.hami.verdicts import (
    CODES,
    HAMI_LOOP,
    NOT_JUDGED,
    Code,
    HamiEvidence,
    HamiJudge,
    HamiKeys,
    HamiVerdict,
)
from sidecar.health import CheckKey, HealthState, Kind, Status
from sidecar.kube.access import ApiAccess
from sidecar.kube.client import Reader, get, off_loop

BOOT_ID = "/proc/sys/kernel/random/boot_id"

__all__ = ["CODES", "HamiKeys", "HamiWatch", "NodeReading", "from_settings", "plugin_checks", "read_node"]


class Publisher(Protocol):
    """What the sidecar publishes of the verdicts (`sidecar.server.metrics.MetricsPublisher`)."""

    def hami(self, resource: str, code: Code, gpus: int | None) -> None:
        """The verdict's reason code, and the healthy GPUs HAMi's annotation lists (None: no reading)."""

    def restart_requested(self, resource: str) -> None:
        """A liveness failure episode began."""


@dataclass(frozen=True)
class NodeReading:
    """One GET of the Node: it, or why not (`not_found`: the API server has no such Node)."""

    node: NodeView | None
    why: str = ""
    not_found: bool = False


async def read_node(
    access: ApiAccess | None, node: str, keys: list[str], timeout: float, reader: Reader | None = None
) -> NodeReading:
    """GET this node's Node (with `reader`'s open session, else one of its own); a reading, or why there
    is none (never an exception)."""
    if access is None:
        return NodeReading(None, "no API server (KUBERNETES_SERVICE_HOST/PORT unset, no --kube-api-server)")
    if not node:
        return NodeReading(None, "no node name (NODE_NAME, --node-name)", not_found=True)
    path = f"/api/v1/nodes/{quote(node, safe='')}"
    answer = await (reader.get(path, timeout, MAX_NODE) if reader else get(access, path, timeout, MAX_NODE))
    if answer.status == 404:
        return NodeReading(None, f"the API server has no Node {node!r}", not_found=True)
    if answer.denied:
        return NodeReading(
            None,
            f"the API server answered {answer.status}: the ServiceAccount may not get nodes "
            "(HAMi's chart grants get on nodes to its device plugin's)",
        )
    if answer.status != 200 or answer.why:
        return NodeReading(None, answer.why or f"the API server answered {answer.status}")
    found = await off_loop(parse_node, answer.body, keys)  # not on the loop that answers /healthz
    return NodeReading(None, found) if isinstance(found, str) else NodeReading(found)


def boot_id(path: str = BOOT_ID) -> str:
    """This machine's boot ID, as the kubelet reports it in the Node's status ("" unreadable)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(64).strip()
    except OSError:
        return ""


class HamiWatch:
    """Each reading: the Node, the kubelet's devices, and every configured resource's verdict."""

    def __init__(
        self,
        keys: tuple[HamiKeys, ...],
        plugin_paths: Mapping[str, str],
        access: ApiAccess | None,
        node: str,
        *,
        pod_resources_socket: str,
        timeout: float = 2.0,
        every: float = 10.0,
        repair: float = 2 * HAMI_LOOP,
        clock: Callable[[], float] = time.monotonic,
        boot: str | None = None,
    ) -> None:
        self.keys = keys
        self.plugin_paths = dict(plugin_paths)
        self.access = access
        self.node = node
        self.pod_resources_socket = pod_resources_socket
        self.timeout = timeout
        self.every = every
        self.clock = clock
        self.boot_id = boot_id() if boot is None else boot
        self.judge = HamiJudge(keys, node, repair, clock)
        self.reader = Reader(access) if access is not None else None
        self.read_at: float | None = None
        self.reading: NodeReading | None = None
        self.last: dict[str, tuple[HamiEvidence, HamiVerdict]] = {}
        self._into: tuple[HealthState, Publisher] | None = None

    def attach(self, state: HealthState, publish: Publisher) -> None:
        """From now on each reading's verdicts go into `state`'s `hami:` checks and `publish`'s metrics."""
        for k in self.keys:
            name = CheckKey(Kind.HAMI, k.resource).name
            state.add(name, restarts=False)
            state.checks[name].judged_elsewhere = True
            publish.hami(k.resource, "no_evidence", None)
        self._into = (state, publish)

    def kubelet_version(self) -> str:
        """The kubelet's version as this node's Node last reported it ("" none, or a Node of another
        machine: a wrong NODE_NAME must not choose the kubelet's rules)."""
        node = self.reading.node if self.reading is not None else None
        if node is None or (self.boot_id and node.boot_id != self.boot_id):
            return ""
        return node.kubelet_version

    def due(self) -> bool:
        """Whether a reading is due (at most one every `every` seconds)."""
        return self.read_at is None or self.clock() - self.read_at >= self.every

    async def round(
        self,
        checks_ok: Mapping[str, tuple[bool, bool]],
        kubelet: Reading[dict[str, frozenset[str]]] | None = None,
    ) -> dict[str, tuple[HamiEvidence, HamiVerdict]]:
        """Read and judge, when due; `checks_ok`: per resource, (plugin:, registered:) pass. `kubelet`:
        the healthy device IDs by resource, when the caller has them (else pod-resources is read)."""
        if not self.due():
            return self.last
        self.read_at = self.clock()
        keys = sorted({k for hk in self.keys for k in (hk.register, hk.handshake)})
        self.reading = reading = await read_node(self.access, self.node, keys, self.timeout, self.reader)
        if kubelet is None and reading.node is not None:
            kubelet = await pod_resources_devices(self.pod_resources_socket, self.timeout)
        out = {}
        for k in self.keys:
            r = k.resource
            listed = kubelet.value if kubelet is not None else None
            plugin_ok, registered_ok = checks_ok.get(r, (False, False))
            ev = HamiEvidence(
                node=reading.node,
                why=reading.why,
                not_found=reading.not_found,
                boot_id=self.boot_id,
                kubelet=None if listed is None else listed.get(r, frozenset()),
                kubelet_why=kubelet.error if kubelet is not None else "not read",
                plugin_ok=plugin_ok,
                registered_ok=registered_ok,
                plugin_id=socket_identity(self.plugin_paths[r]) if r in self.plugin_paths else None,
            )
            out[r] = (ev, self.judge.judge(r, ev))
        self.last = out
        self._publish(out)
        return out

    async def close(self) -> None:
        """Close the API server's session."""
        if self.reader is not None:
            await self.reader.close()

    def _publish(self, verdicts: Mapping[str, tuple[HamiEvidence, HamiVerdict]]) -> None:
        if self._into is None:
            return
        state, publish = self._into
        for r, (_, v) in verdicts.items():
            name = CheckKey(Kind.HAMI, r).name
            was = state.checks[name].live_failed
            state.assign(name, v.status, v.reason, restarts=v.restarts)
            if v.live_failed and not was:
                publish.restart_requested(r)
            publish.hami(r, v.code, v.gpus)

    def document(self, now: float) -> dict[str, object]:
        """What /status shows."""
        r = self.reading
        return {
            "node": self.node,
            "api": (self.access.source or self.access.server) if self.access else None,
            "read_seconds_ago": None if self.read_at is None else round(now - self.read_at, 3),
            "reading": None if r is None else ("ok" if r.node is not None else r.why),
            "resources": {
                res: {
                    "register_annotation": self.judge.keys[res].register,
                    "handshake_annotation": self.judge.keys[res].handshake,
                    "handshake": HamiJudge.handshake_of(self.judge.keys[res], ev.node),
                    "reason_code": v.code,
                    "judged": v.code not in NOT_JUDGED,
                    "scheduler": v.scheduler or None,
                    "annotation_healthy_gpus": v.gpus,
                    "restarts_in_vain": self.judge.restarts_in_vain(res),
                    "fails_liveness": v.live_failed,
                }
                for res, (ev, v) in self.last.items()
            },
        }


def plugin_checks(state: HealthState, resources: list[str]) -> dict[str, tuple[bool, bool]]:
    """Per resource, whether its `plugin:` and `registered:` checks pass now."""

    def ok(kind: Kind, r: str) -> bool:
        c = state.checks.get(CheckKey(kind, r).name)
        return c is not None and c.status is Status.OK

    return {r: (ok(Kind.PLUGIN, r), ok(Kind.REGISTERED, r)) for r in resources}


def hami_keys_of(s: Settings, resource: str, register: str) -> HamiKeys:
    """Where HAMi keeps `resource`'s registration, by its vendor's profile: the handshake key, the format
    HAMi decodes the register in, whether the plugin stamps the handshake on a timer, and whether the
    HAMi release (--hami-version) retries a failed patch itself."""
    v = s.profile_for(resource)
    return HamiKeys(
        resource,
        register,
        s.hami_handshake(resource),
        v.hami.register_format,
        stamps=v.hami.stamps_on_timer,
        cache_fixed=v.hami.stuck_cache and cache_fixed(s.hami_version, s.hami_cache_fixed_in),
    )


def from_settings(s: Settings, clock: Callable[[], float] = time.monotonic) -> HamiWatch | None:
    """The sidecar's watch of HAMi's registration; None when off, with no API server known, or no
    configured plugin has a known HAMi annotation."""
    keys = tuple(hami_keys_of(s, r, k) for r, k in s.hami_keys())
    if not s.hami_registration or s.hami_api is None or not keys:
        return None
    return HamiWatch(
        keys,
        {p.resource: s.plugin_path(p) for p in s.plugins},
        s.hami_api,
        s.node_name,
        pod_resources_socket=s.pod_resources_socket,
        timeout=max(s.probe_timeout, 1.0),
        every=s.hami_interval,
        repair=s.hami_repair,
        clock=clock,
    )
