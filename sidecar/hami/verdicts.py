"""Does HAMi's scheduler see the node's GPUs as the kubelet does? The `hami:<resource>` verdict, pure.

Evidence in (this node's Node object as the API server holds it, the kubelet's healthy devices, the
plugin's own checks), a verdict out; no I/O, the clock injected. The HAMi behaviour each rule rests
on (HAMi v2.10.0, and the older releases where they differ) is in docs/kubelet.md#hami-registration and
`sidecar.hami.facts`, the comparison in `sidecar.hami.compare`; the rules in
docs/design.md#hami-registration:

1. No reading of the Node (no token, a 401 or 403, the API server unreachable, an answer that does
   not parse): `no_evidence`, never a failure; the reason says so. So is a register annotation longer
   than hami-guard's own bound on a value it reads (`annotation.MAX_VALUE`, 1 MiB; the API server caps
   all of a Node's annotations at 256 KiB): the bound is this sidecar's, not HAMi's, so it cannot tell
   what HAMi's scheduler makes of a value it refuses to read, and a plugin restart would not change that.
2. No Node of `NODE_NAME` (404), or a Node whose boot ID is not this machine's: `wrong_node`, the
   sidecar is told the wrong node name. Readiness only: a plugin restart reads the same name.
3. A difference not judged (it passes): while the Node has no handshake annotation (`no_handshake`: no
   scheduler of HAMi's selects the node, or none runs), or while the plugin does not serve or register
   (`plugin_down`: its own checks judge it; the reason says what HAMi's scheduler does meanwhile, which
   still offers the node from the annotation).
4. The register annotation differing from the kubelet's healthy devices, while the plugin serves and
   the kubelet holds it and the scheduler has handshaken: missing or not decodable (`missing`,
   `unparsable`; `last_copy` once this sidecar saw it in place for a scheduler tick before: the
   scheduler keeps that copy and schedules on it), listing as healthy GPUs the kubelet does not list
   healthy (`stale_health`: the scheduler places Pods on them), or leaving out or marking unhealthy GPUs
   the kubelet lists healthy (`mismatched`). HAMi's loop rewrites a changed device list every 30 s, so a
   difference that outlasts `repair` is one its loop may never mend: its cache, written before the
   patch, makes it skip later rounds as "unchanged" after a failed patch (on one GPU until the plugin
   restarts; on several until its map order changes). It fails liveness, at most `RESTART_BUDGET`
   restarts in vain (each restart's new plugin socket that did not mend it), then readiness only.
5. The scheduler's handshake: a `Deleted_` that stays (HAMi before v2.10 wrote it when it cleaned the
   node up; up to v2.8 nothing replaced it), or the Node's allocatable of the resource at 0 for HAMi's
   60 s with a `Requesting_` handshake (the scheduler drops the node's devices: v2.10 at once, and adds
   them back from the annotation for a minute at a time). Readiness only: the scheduler's doing, which a
   plugin restart does not change.
6. The register annotation in the format HAMi's decoder for the vendor does not read (`format_skew`:
   JSON where HAMi v2.10.0 reads Hygon DCU's as the legacy CSV text, CSV where it reads JSON): readiness
   only, never liveness, however long it lasts: a plugin restart writes the same format.
7. A plugin that stamps its own handshake every 30 s (`HamiKeys.stamps`: Ascend's, DCU's) whose
   handshake has not changed for twice `repair` while it serves and registers, with the same socket
   (`stamp_stalled`): its register loop stopped; liveness, within the same restart budget as 4. A
   restarted plugin whose stamp has not moved yet is the same episode. A snapshot (`repair` 0) never.
8. Rule 4 for a HAMi release whose plugin caches its annotation only after the patch
   (`HamiKeys.cache_fixed`, from --hami-version and --hami-cache-fixed-in): readiness only, since
   HAMi's own loop retries a failed patch. No release up to v2.10.0 carries that fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from sidecar.hami.annotation import JSON, MAX_VALUE, NodeView, Register, parse_handshake, parse_register
from sidecar.hami.compare import Diff, Read, agrees, compare, diff_note, meanwhile
from sidecar.hami.facts import HAMI_LOOP, HANDSHAKE_EXPIRY, HARM, SCHEDULER_TICK, cache_note
from sidecar.health import Status
from sidecar.reasons import HAMI_CODES as CODES
from sidecar.reasons import HamiCode as Code

__all__ = [
    "CODES",
    "DIFFERS",
    "HAMI_LOOP",
    "HANDSHAKE_EXPIRY",
    "NOT_JUDGED",
    "RESTART_BUDGET",
    "SCHEDULER_TICK",
    "SKEWED",
    "UNSEEN",
    "Code",
    "HamiEvidence",
    "HamiJudge",
    "HamiKeys",
    "HamiVerdict",
]

# Restarts of the plugin (new sockets) that did not mend the annotation, before liveness stops asking.
RESTART_BUDGET = 3

# Fails readiness only: the annotation in the format HAMi's decoder for the vendor does not read (a
# restart rewrites the same format).
SKEWED: frozenset[Code] = frozenset({"format_skew"})
# Passes, with the reason why nothing was judged: the Node unread, the plugin down, no scheduler.
NOT_JUDGED: frozenset[Code] = frozenset({"no_evidence", "plugin_down", "no_handshake"})
# The annotation differs from the kubelet: past `repair`, a plugin restart is the remedy.
DIFFERS: frozenset[Code] = frozenset({"missing", "unparsable", "mismatched", "stale_health", "last_copy"})
# HAMi's scheduler does not see (some of) the GPUs the kubelet lists: HamiSchedulerCannotSeeGPUs.
UNSEEN: frozenset[Code] = frozenset(
    {"missing", "unparsable", "mismatched", "handshake_deleted", "handshake_expired", "format_skew"}
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
    scheduler: str = ""  # what HAMi's scheduler does with the node, by this reading ("" not known)

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
    read: Read | None = None  # the annotation being read now
    copy: Read | None = None  # the last one HAMi's scheduler has read: in place for a tick of its
    zero_since: float | None = None  # the Node's allocatable of the resource at 0 since
    zero_requesting: bool = False  # a Requesting_ handshake seen while it is
    stamp: tuple[str, float, Hashable | None] | None = None  # the handshake, since when, with which plugin
    stalled_at: str | None = None  # the handshake that stopped at the last stamp_stalled failure


@dataclass(frozen=True)
class HamiKeys:
    """Where HAMi keeps one resource's registration: the register and handshake annotation keys (""
    none: AMD's), the format HAMi's decoder reads the register in, whether the plugin stamps the
    handshake on a timer (Ascend's and DCU's `Reported` every 30 s), and whether the scheduler's HAMi
    release retries a failed patch itself (its plugin caches the annotation only after the patch)."""

    resource: str
    register: str
    handshake: str
    format: str = JSON
    stamps: bool = False
    cache_fixed: bool = False


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
            return HamiVerdict(Status.OK, f"no evidence: the Node cannot be read: {ev.why}", "no_evidence")
        if ev.boot_id and node.boot_id and ev.boot_id != node.boot_id:
            st.differs_since = None
            return HamiVerdict(
                Status.FAILED,
                f"Node {self.node!r} is another machine (its boot ID {node.boot_id} is not this one's "
                f"{ev.boot_id}): NODE_NAME (--node-name) is wrong; set it from the Pod's spec.nodeName",
                "wrong_node",
            )
        value = node.annotations.get(k.register)
        if value is not None and len(value) > MAX_VALUE:
            st.differs_since = None
            return HamiVerdict(Status.OK, _unread(k.register, value), "no_evidence")
        register = parse_register(value, k.format) if value is not None else None
        handshake = node.annotations.get(k.handshake) if k.handshake else None
        _remember(st, value, register, handshake, now)
        _zero(st, node, resource, handshake, now)
        stalled = self._stalled(resource, ev, handshake, now)
        d = compare(k.register, value, register, ev.kubelet, st.copy, resource=resource)
        if d.text and not (ev.plugin_ok and ev.registered_ok):
            return self._plugin_down(resource, ev, d, handshake is not None)
        early = self._vendor(resource, ev, d, handshake, stalled)
        if early is not None:
            return early
        if d.text:
            return self._differs(resource, ev, d)
        st.differs_since = None
        st.restarts_in_vain, st.failed_with, st.episode = 0, None, False
        note = diff_note(register, ev.kubelet, ev.kubelet_why, resource)
        found = self._handshake(resource, k, node, now)
        if found is not None:
            code, why, does = found
            return HamiVerdict(Status.FAILED, f"{why}{note}", code, gpus=d.gpus, scheduler=does)
        return HamiVerdict(
            Status.OK, f"{agrees(register, ev.kubelet)}{note}", "ok", gpus=d.gpus, scheduler=d.scheduler
        )

    def _vendor(
        self, resource: str, ev: HamiEvidence, d: Diff, handshake: str | None, stalled: str | None
    ) -> HamiVerdict | None:
        """The verdicts of the vendor's own ways, before the comparison's: the plugin's stamp stopped (and
        a restart's new plugin not stamping yet), no scheduler's handshake, the format skew."""
        k, st = self.keys[resource], self._state[resource]
        if stalled is not None:
            return self._live(resource, ev, "stamp_stalled", stalled, d)
        if handshake is not None and handshake == st.stalled_at:
            # A restart's new plugin, whose stamp has not moved yet: the same episode, not a mended one.
            st.episode = False
            return HamiVerdict(
                Status.OK,
                f"the plugin restarted after its stamp {k.handshake} stopped; waiting {2 * self.repair:g}s "
                "for its new register loop to stamp it",
                "repairing",
                gpus=d.gpus,
                scheduler=d.scheduler,
            )
        if d.text and handshake is None and k.handshake:
            # No scheduler of HAMi's looks at this node (it stamps every node it selects within 15 s):
            # HAMi's annotations decide nothing here, and a plugin that is not HAMi's writes none.
            st.differs_since = None
            return HamiVerdict(
                Status.OK,
                f"not judged: HAMi's scheduler has not handshaken with this node (no {k.handshake}: it does "
                f"not select the node, or does not run): {d.whole}",
                "no_handshake",
                gpus=d.gpus,
                scheduler="does not look at this node (no handshake)",
            )
        if d.code in SKEWED:
            st.differs_since, st.episode = None, False
            return HamiVerdict(
                Status.FAILED,
                f"{d.text}. A plugin restart rewrites the same format: not ready, no restart; run the "
                "plugin release that writes the format HAMi's release reads (or the HAMi release that reads "
                "it)",
                d.code,
                gpus=0,
                scheduler=d.scheduler,
            )
        return None

    def _plugin_down(self, resource: str, ev: HamiEvidence, d: Diff, handshake: bool) -> HamiVerdict:
        st = self._state[resource]
        st.differs_since, st.episode = None, False
        what = "serve" if not ev.plugin_ok else "register"
        said, does = meanwhile(d, st.copy, resource, handshake)
        return HamiVerdict(
            Status.OK,
            f"not judged while the plugin does not {what} (plugin:/registered: judge that): {d.whole}; "
            f"meanwhile {said}",
            "plugin_down",
            gpus=d.gpus,
            scheduler=does,
        )

    def _differs(self, resource: str, ev: HamiEvidence, d: Diff) -> HamiVerdict:
        st, now = self._state[resource], self.clock()
        if st.differs_since is None or st.differs_for != ev.plugin_id:
            st.differs_since, st.differs_for = now, ev.plugin_id  # a new plugin gets HAMi's loop again
        lasted = now - st.differs_since
        if lasted < self.repair:
            st.episode = False
            return HamiVerdict(
                Status.OK,
                f"{d.text} for {lasted:.0f}s{d.more}; HAMi's loop rewrites a changed device list within "
                f"{HAMI_LOOP:.0f}s (judged after {self.repair:g}s)",
                "repairing",
                gpus=d.gpus,
                scheduler=d.scheduler,
            )
        why = (
            f"{d.text} for {lasted:.0f}s while the plugin serves and the kubelet holds it: {HARM[d.code]}"
            f"{d.more}. "
            f"HAMi's loop would have rewritten a changed list within {HAMI_LOOP:.0f}s; {cache_note(d.count)}"
        )
        if self.keys[resource].cache_fixed:
            # HAMi's release caches the annotation only after its patch: the loop retries by itself.
            st.episode = False
            why += (
                "; this HAMi release retries a failed patch itself (its plugin caches the annotation only "
                "after the patch): not ready, no restart"
            )
            return HamiVerdict(Status.FAILED, why, d.code, gpus=d.gpus, scheduler=d.scheduler)
        return self._live(resource, ev, d.code, why, d)

    def _live(self, resource: str, ev: HamiEvidence, code: Code, why: str, d: Diff) -> HamiVerdict:
        """A failure a plugin restart mends: liveness, within the restart budget."""
        st = self._state[resource]
        if not st.episode:
            st.episode = True
            if st.failed_with is not None and st.failed_with != ev.plugin_id:
                st.restarts_in_vain += 1  # the plugin restarted for it, and its new one did not mend it
            st.failed_with = ev.plugin_id
        spent = st.restarts_in_vain >= RESTART_BUDGET
        if spent:
            why += f"; restart budget spent: {st.restarts_in_vain} plugin restarts did not mend it"
        return HamiVerdict(
            Status.FAILED,
            why,
            code,
            restarts=not spent,
            gpus=d.gpus,
            budget_spent=spent,
            scheduler=d.scheduler,
        )

    def _stalled(self, resource: str, ev: HamiEvidence, handshake: str | None, now: float) -> str | None:
        """Why the plugin's register loop stopped: the handshake it stamps every 30 s unchanged for twice
        `repair` while it serves and registers (the same plugin all along); None: it did not."""
        st, k = self._state[resource], self.keys[resource]
        # A snapshot (no `repair`: hami-doctor) cannot see a stamp stop.
        if not k.stamps or self.repair <= 0 or handshake is None or not (ev.plugin_ok and ev.registered_ok):
            st.stamp = None
            return None
        if handshake != st.stalled_at:
            st.stalled_at = None
        if st.stamp is None or st.stamp[0] != handshake or st.stamp[2] != ev.plugin_id:
            st.stamp = (handshake, now, ev.plugin_id)
        lasted = now - st.stamp[1]
        if lasted < 2 * self.repair:
            return None
        st.stalled_at = handshake
        return (
            f"the plugin's handshake stamp {k.handshake}={handshake[:80]!r} has not changed for "
            f"{lasted:.0f}s while the plugin serves: its register loop patches the stamp (and the register "
            f"annotation) every {HAMI_LOOP:.0f}s, so the loop has stopped and no change of the devices "
            "reaches HAMi; a plugin restart starts it again"
        )

    def _handshake(
        self, resource: str, k: HamiKeys, node: NodeView, now: float
    ) -> tuple[Code, str, str] | None:
        """Why the scheduler drops (or dropped) the node's devices, from its handshake and the Node's
        allocatable, with what it does; None: it does not."""
        st = self._state[resource]
        hs = parse_handshake(node.annotations.get(k.handshake))
        if st.handshake is None or st.handshake[0] != hs.value:
            st.handshake = (hs.value, now)
        unchanged = now - st.handshake[1]
        fix = f"kubectl annotate node {self.node} {k.handshake}-"
        if hs.state == "deleted" and unchanged >= HANDSHAKE_EXPIRY + SCHEDULER_TICK:
            return (
                "handshake_deleted",
                f"HAMi's scheduler cleaned this node up and its handshake {k.handshake}={hs.value!r} has "
                f"stayed for {unchanged:.0f}s: schedulers before HAMi v2.10 wrote it and up to v2.8 never "
                f"replace it, so they keep the node's devices out; remove it ({fix}) and the scheduler "
                "hands shakes again within 15 s",
                "keeps the node's devices out (a scheduler before v2.9)",
            )
        if st.zero_since is None:
            return None
        # v2.10 removes the handshake when it cleans the node up and stamps a new one at its next tick:
        # absent in between is the same episode.
        lasted = now - st.zero_since
        if st.zero_requesting and hs.state in ("requesting", "absent") and lasted >= HANDSHAKE_EXPIRY:
            shown = "0" if resource in node.allocatable else "absent"
            return (
                "handshake_expired",
                f"the Node's allocatable {resource} has been {shown} for {lasted:.0f}s though the kubelet "
                "lists the GPUs (the kubelet has not reported them in the Node's status): kube-scheduler "
                "fits no GPU Pod here, and HAMi's scheduler drops the node's devices once its handshake "
                f"{hs.value or '(removed)'!r} is {HANDSHAKE_EXPIRY:.0f}s old (v2.10 at once, then adds "
                "them back from the annotation for a minute at a time)",
                "drops the node's devices (v2.10: adds them back for a minute at a time)",
            )
        return None

    @staticmethod
    def handshake_of(keys: HamiKeys, node: NodeView | None) -> str:
        """The handshake annotation's value as read, for /status ("" when absent or unread)."""
        return node.annotations.get(keys.handshake, "") if node is not None else ""


def _unread(key: str, value: str) -> str:
    """Why a register annotation past hami-guard's own bound is not judged: the bound is ours, not HAMi's."""
    return (
        f"no evidence: HAMi's annotation {key} is {len(value)} characters, over hami-guard's own bound of "
        f"{MAX_VALUE} ({MAX_VALUE >> 20} MiB) on a value it reads: not read, so what HAMi's scheduler makes "
        "of it is not judged (a plugin restart cannot change this bound)"
    )


def _remember(
    st: _State, value: str | None, register: Register | None, handshake: str | None, now: float
) -> None:
    """Keeps what HAMi's scheduler has read: an annotation that lists GPUs, in place with the same handshake
    for a scheduler tick, it has read (it reads every node it selects every 15 s). A new handshake means
    the scheduler cleaned the node up since (v2.10 removes it, older releases write `Deleted_`), and its
    copy with it."""
    if st.copy is not None and st.copy.handshake != handshake:
        st.copy = None
    if value is None or register is None or not register.gpus or handshake is None:
        st.read = None
        return
    if st.read is None or st.read.value != value or st.read.handshake != handshake:
        st.read = Read(value, register, handshake, now, now)
    st.read.last = now
    if st.read.last - st.read.first >= SCHEDULER_TICK:
        st.copy = st.read


def _zero(st: _State, node: NodeView, resource: str, handshake: str | None, now: float) -> None:
    """Since when the Node's allocatable of the resource is 0, and whether a `Requesting_` handshake was
    seen meanwhile. HAMi reads the quantity's value: absent is 0; one that is not a plain count is not 0."""
    if resource in node.allocatable and node.allocatable[resource] != 0:
        st.zero_since, st.zero_requesting = None, False
        return
    if st.zero_since is None:
        st.zero_since = now
    st.zero_requesting = st.zero_requesting or parse_handshake(handshake).state == "requesting"
