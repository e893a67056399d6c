"""Does HAMi's scheduler see the node's GPUs as the kubelet does? The `hami:<resource>` verdict, pure.

Evidence in (this node's Node object as the API server holds it, the kubelet's healthy devices, the
plugin's own checks), a verdict out; no I/O, the clock injected. The HAMi behaviour each rule rests
on is in docs/kubelet.md#hami-registration; the rules in docs/design.md#hami-registration:

1. No reading of the Node (no token, a 401 or 403, the API server unreachable, an answer that does
   not parse): no evidence, never a failure; the reason says so.
2. No Node of `NODE_NAME` (404), or a Node whose boot ID is not this machine's: the sidecar is told
   the wrong node name. Readiness only: a plugin restart reads the same name.
3. The register annotation missing, not decodable, or listing other GPUs or other health than the
   kubelet lists healthy, while the plugin serves and the kubelet holds it and HAMi's scheduler has
   handshaken with the node (without its handshake annotation, no scheduler of HAMi's selects the
   node, and the annotation decides nothing: not judged): HAMi's loop rewrites a
   changed device list every 30 s, so a difference that outlasts `repair` is one its loop will never
   mend. HAMi caches the new content before it patches the Node, and after one failed patch skips
   every later one as "unchanged": only a plugin restart (an empty cache) writes it again. It fails
   liveness, at most `RESTART_BUDGET` restarts in vain (each restart's new plugin socket that did not
   mend it), then readiness only.
4. The scheduler's handshake: a `Deleted_` that stays (HAMi before v2.10 wrote it when it cleaned the
   node up; up to v2.8 nothing replaced it), or a `Requesting_` that stays unchanged for HAMi's 60 s
   while the Node's allocatable of the resource is 0 (the scheduler then removes the node's devices).
   Readiness only: the scheduler's doing, which a plugin restart does not change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal, get_args

from sidecar.hami.annotation import NodeView, Register, gpu_of, parse_handshake, parse_register
from sidecar.health import Status

# HAMi's WatchAndRegister: a changed device list is patched within 30 s (5 s after an error).
HAMI_LOOP = 30.0
# The scheduler's CheckHealth: a Requesting_ stamp older than 60 s with allocatable 0 cleans the node.
HANDSHAKE_EXPIRY = 60.0
SCHEDULER_TICK = 15.0  # RegisterFromNodeAnnotations' ticker
# Restarts of the plugin (new sockets) that did not mend the annotation, before liveness stops asking.
RESTART_BUDGET = 3
MAX_LISTED = 4  # GPU IDs named in a reason

Code = Literal[
    "ok",
    "repairing",
    "no_evidence",
    "missing",
    "unparsable",
    "mismatched",
    "wrong_node",
    "handshake_deleted",
    "handshake_expired",
]
CODES: tuple[Code, ...] = get_args(Code)
# The codes under which HAMi's scheduler does not see the GPUs the kubelet has (the alert's).
UNSEEN: frozenset[Code] = frozenset(
    {"missing", "unparsable", "mismatched", "handshake_deleted", "handshake_expired"}
)


@dataclass(frozen=True)
class HamiEvidence:
    """One reading for one resource. `node` None: no reading, `why` says why (`not_found`: a 404)."""

    node: NodeView | None
    why: str = ""
    not_found: bool = False
    boot_id: str = ""  # this machine's (/proc/sys/kernel/random/boot_id); "" unknown
    kubelet: frozenset[str] | None = None  # the healthy device IDs the kubelet lists; None: unknown
    kubelet_why: str = ""
    plugin_ok: bool = False  # plugin:<resource> passes
    registered_ok: bool = False  # registered:<resource> passes
    plugin_id: Hashable | None = None  # the plugin's socket file: a new one is a plugin restart


@dataclass(frozen=True)
class HamiVerdict:
    """The `hami:<resource>` check's verdict, with its reason code and what the annotation lists."""

    status: Status
    reason: str
    code: Code
    restarts: bool = False  # a failure fails liveness
    gpus: int | None = None  # healthy GPUs HAMi's annotation lists (0 when absent); None: no reading
    budget_spent: bool = False

    @property
    def live_failed(self) -> bool:
        """Failed, and a plugin restart is its remedy."""
        return self.status is Status.FAILED and self.restarts


@dataclass
class _State:
    differs_since: float | None = None  # monotonic: the current difference, for the current socket
    differs_for: Hashable | None = None  # the plugin socket it was first seen with
    failed_with: Hashable | None = None  # the plugin socket that failed liveness last
    restarts_in_vain: int = 0
    handshake: tuple[str, float] | None = None  # the handshake's value, and since when it is unchanged
    episode: bool = False  # failing liveness now


@dataclass(frozen=True)
class HamiKeys:
    """Where HAMi keeps one resource's registration: the register and handshake annotation keys."""

    resource: str
    register: str
    handshake: str


class HamiJudge:
    """The `hami:` verdict of each configured resource, round after round."""

    def __init__(
        self,
        keys: tuple[HamiKeys, ...],
        node: str,
        repair: float = 2 * HAMI_LOOP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = {k.resource: k for k in keys}
        self.node = node
        self.repair = repair
        self.clock = clock
        self._state: dict[str, _State] = {k.resource: _State() for k in keys}

    def restarts_in_vain(self, resource: str) -> int:
        """Plugin restarts that did not mend the annotation, since it last matched."""
        return self._state[resource].restarts_in_vain

    def judge(self, resource: str, ev: HamiEvidence) -> HamiVerdict:
        """This round's verdict on `resource`."""
        k, st, now = self.keys[resource], self._state[resource], self.clock()
        node = ev.node
        if node is None:
            st.differs_since = None
            if ev.not_found:
                return HamiVerdict(
                    Status.FAILED,
                    f"the API server has no Node {self.node!r}: NODE_NAME (--node-name) is wrong; set it "
                    "from the Pod's spec.nodeName (a plugin restart reads the same name)",
                    "wrong_node",
                )
            return HamiVerdict(Status.OK, f"no evidence: {ev.why}", "no_evidence")
        if ev.boot_id and node.boot_id and ev.boot_id != node.boot_id:
            st.differs_since = None
            return HamiVerdict(
                Status.FAILED,
                f"Node {self.node!r} is another machine (its boot ID {node.boot_id} is not this one's "
                f"{ev.boot_id}): NODE_NAME (--node-name) is wrong; set it from the Pod's spec.nodeName",
                "wrong_node",
            )
        value = node.annotations.get(k.register)
        register = parse_register(value) if value is not None else None
        code, diff, gpus = _compare(k.register, value, register, ev.kubelet)
        if diff and k.handshake not in node.annotations:
            # No scheduler of HAMi's looks at this node (it stamps every node it selects within 15 s):
            # HAMi's annotations decide nothing here, and a plugin that is not HAMi's writes none.
            st.differs_since = None
            return HamiVerdict(
                Status.OK,
                f"not judged: HAMi's scheduler has not handshaken with this node (no {k.handshake}: it does "
                f"not select the node, or does not run): {diff}",
                "no_evidence",
                gpus=gpus,
            )
        if diff:
            return self._differs(resource, ev, code, diff, gpus)
        st.differs_since = None
        st.restarts_in_vain, st.failed_with, st.episode = 0, None, False
        note = diff_note(register, ev)
        handshake = self._handshake(resource, k, node, now)
        if handshake is not None:
            return HamiVerdict(Status.FAILED, f"{handshake[1]}{note}", handshake[0], gpus=gpus)
        return HamiVerdict(Status.OK, f"{_agrees(register, ev)}{note}", "ok", gpus=gpus)

    def _differs(self, resource: str, ev: HamiEvidence, code: Code, diff: str, gpus: int) -> HamiVerdict:
        st, now = self._state[resource], self.clock()
        if not (ev.plugin_ok and ev.registered_ok):
            st.differs_since, st.episode = None, False
            what = "serve" if not ev.plugin_ok else "register"
            return HamiVerdict(
                Status.OK,
                f"not judged while the plugin does not {what} (plugin:/registered: judge that): {diff}",
                "no_evidence",
                gpus=gpus,
            )
        if st.differs_since is None or st.differs_for != ev.plugin_id:
            st.differs_since, st.differs_for = now, ev.plugin_id  # a new plugin gets HAMi's loop again
        lasted = now - st.differs_since
        if lasted < self.repair:
            st.episode = False
            return HamiVerdict(
                Status.OK,
                f"{diff} for {lasted:.0f}s; HAMi's loop rewrites a changed device list within "
                f"{HAMI_LOOP:.0f}s (judged after {self.repair:g}s)",
                "repairing",
                gpus=gpus,
            )
        if not st.episode:
            st.episode = True
            if st.failed_with is not None and st.failed_with != ev.plugin_id:
                st.restarts_in_vain += 1  # the plugin restarted for it, and its new one did not mend it
            st.failed_with = ev.plugin_id
        spent = st.restarts_in_vain >= RESTART_BUDGET
        why = (
            f"{diff} for {lasted:.0f}s while the plugin serves and the kubelet holds it: HAMi's loop "
            f"would have rewritten it within {HAMI_LOOP:.0f}s; it skips the patch as 'unchanged' after a "
            "failed one (its cache is written first), until the plugin restarts"
        )
        if spent:
            why += f"; restart budget spent: {st.restarts_in_vain} plugin restarts did not mend it"
        return HamiVerdict(Status.FAILED, why, code, restarts=not spent, gpus=gpus, budget_spent=spent)

    def _handshake(self, resource: str, k: HamiKeys, node: NodeView, now: float) -> tuple[Code, str] | None:
        """Why the scheduler drops (or dropped) the node's devices, from its handshake; None: it does not."""
        st = self._state[resource]
        hs = parse_handshake(node.annotations.get(k.handshake))
        if st.handshake is None or st.handshake[0] != hs.value:
            st.handshake = (hs.value, now)
        unchanged = now - st.handshake[1]
        fix = f"kubectl annotate node {self.node} {k.handshake}-"
        if hs.state == "deleted" and unchanged >= HANDSHAKE_EXPIRY + SCHEDULER_TICK:
            return "handshake_deleted", (
                f"HAMi's scheduler cleaned this node up and its handshake {k.handshake}={hs.value!r} has "
                f"stayed for {unchanged:.0f}s: schedulers before HAMi v2.10 wrote it and up to v2.8 never "
                f"replace it, so they keep the node's devices out; remove it ({fix}) and the scheduler "
                "hands shakes again within 15 s"
            )
        # HAMi reads the quantity's value: absent is 0; one that is not a plain count is not 0.
        zero = resource not in node.allocatable or node.allocatable[resource] == 0
        if hs.state == "requesting" and zero and unchanged >= HANDSHAKE_EXPIRY:
            shown = "0" if resource in node.allocatable else "absent"
            return "handshake_expired", (
                f"HAMi's scheduler removes this node's devices: its handshake {hs.value!r} is over "
                f"{HANDSHAKE_EXPIRY:.0f}s old and the Node's allocatable {resource} is {shown} (the kubelet "
                "has not reported the devices in the Node's status)"
            )
        return None

    @staticmethod
    def handshake_of(keys: HamiKeys, node: NodeView | None) -> str:
        """The handshake annotation's value as read, for /status ("" when absent or unread)."""
        return node.annotations.get(keys.handshake, "") if node is not None else ""


def _compare(
    key: str, value: str | None, register: Register | None, kubelet: frozenset[str] | None
) -> tuple[Code, str, int]:
    """What differs between the annotation and the kubelet's healthy devices ("" nothing), and the
    healthy GPUs the annotation lists."""
    if register is None:
        return "missing", f"HAMi's annotation {key} is absent", 0
    if register.gpus is None:
        shown = (value or "")[:80]
        return "unparsable", f"HAMi's annotation {key} does not decode ({register.why}): {shown!r}", 0
    gpus = len(register.healthy)
    if kubelet is None or not comparable(register, kubelet):
        return "ok", "", gpus
    listed = {g for d in kubelet if (g := gpu_of(d)) is not None}
    missing = listed - register.ids
    marked = listed & (register.ids - register.healthy)
    extra = register.healthy - listed
    parts = []
    if missing:
        parts.append(f"the kubelet lists healthy GPU(s) it does not list: {_ids(missing)}")
    if marked:
        parts.append(f"it marks unhealthy GPU(s) the kubelet lists healthy: {_ids(marked)}")
    if extra:
        parts.append(f"it lists as healthy GPU(s) the kubelet does not list healthy: {_ids(extra)}")
    if not parts:
        return "ok", "", gpus
    return "mismatched", f"HAMi's annotation {key} differs from the kubelet: " + "; ".join(parts), gpus


def comparable(register: Register, kubelet: frozenset[str]) -> bool:
    """Whether the two lists name the same things: every kubelet ID a GPU or HAMi's split of one, and
    every annotated GPU a UUID outside MIG (whose devices the kubelet names otherwise)."""
    return all(gpu_of(d) is not None for d in kubelet) and all(
        gpu_of(g.id) == g.id and g.mode.lower() != "mig" for g in register.gpus or ()
    )


def diff_note(register: Register | None, ev: HamiEvidence) -> str:
    """What the verdict could not compare, said after it."""
    if ev.kubelet is None:
        why = ev.kubelet_why
        return f"; the kubelet's devices cannot be read ({why}): only the annotation's presence is judged"
    if register is not None and register.gpus is not None and not comparable(register, ev.kubelet):
        return "; its devices are not GPU UUIDs or HAMi's splits of them (MIG?): not compared"
    return ""


def _agrees(register: Register | None, ev: HamiEvidence) -> str:
    n = len(register.healthy) if register is not None else 0
    if ev.kubelet is None:
        return f"HAMi's annotation lists {n} healthy GPU(s)"
    return f"HAMi's annotation lists the {n} healthy GPU(s) the kubelet lists"


def _ids(ids: set[str] | frozenset[str]) -> str:
    shown = sorted(ids)
    more = f" and {len(shown) - MAX_LISTED} more" if len(shown) > MAX_LISTED else ""
    return ", ".join(shown[:MAX_LISTED]) + more
