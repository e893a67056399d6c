"""What differs between HAMi's register annotation and the kubelet's healthy devices, and what HAMi's
scheduler makes of it: the `hami:` verdicts' comparison (`sidecar.hami.verdicts`), pure.

The facts it names are docs/kubelet.md#hami-registration's (HAMi v2.10.0): HAMi's scheduler reads a
GPU's health from the annotation alone and places Pods on one it lists healthy; an annotation it cannot
read (missing, not decodable, an empty list) leaves it on the copy it last read; one it never read
leaves Pods with `node unregistered`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.hami.annotation import Register, gpu_of
from sidecar.hami.facts import plugin_down_note
from sidecar.reasons import HamiCode as Code

MAX_LISTED = 4  # GPU IDs named in a reason


@dataclass
class Read:
    """A register annotation as read, decodable and listing GPUs, with the handshake beside it."""

    value: str
    register: Register
    handshake: str
    first: float  # monotonic: first and last read with this value and this handshake
    last: float


@dataclass(frozen=True)
class Diff:
    """What differs between the annotation and the kubelet, and what HAMi's scheduler makes of it."""

    code: Code
    text: str  # "" nothing differs
    gpus: int  # healthy GPUs the annotation lists
    scheduler: str
    count: int = 0  # the GPUs HAMi's plugin lists on this node, as far as known (0: not known)
    more: str = ""  # said after the difference and how long it lasted

    @property
    def whole(self) -> str:
        return self.text + self.more


def compare(
    key: str,
    value: str | None,
    register: Register | None,
    kubelet: frozenset[str] | None,
    copy: Read | None,
    *,
    resource: str = "",
) -> Diff:
    """What differs between the annotation and the kubelet's healthy devices, and what HAMi's scheduler
    makes of it."""
    listed = {g for d in kubelet or () if (g := gpu_of(d, resource)) is not None}
    if register is None or register.gpus is None:
        return unreadable(key, value, register, copy, listed if kubelet is not None else None)
    gpus = len(register.healthy)
    count = max(len(register.ids), len(listed))
    ok = Diff("ok", "", gpus, f"offers the {gpus} healthy GPU(s) the annotation lists", count)
    if kubelet is None or not comparable(register, kubelet, resource):
        return ok
    if not register.gpus and listed and copy is not None:
        # HAMi's NVIDIA decoder takes an empty list for an error ("no gpu found on node"): the copy stays.
        return last_copy(key, "lists no GPU", copy, listed)
    missing = listed - register.ids
    marked = listed & (register.ids - register.healthy)
    extra = register.healthy - listed
    parts = []
    if extra:
        parts.append(f"it lists as healthy GPU(s) the kubelet does not list healthy: {listed_ids(extra)}")
    if missing:
        parts.append(f"the kubelet lists healthy GPU(s) it does not list: {listed_ids(missing)}")
    if marked:
        parts.append(f"it marks unhealthy GPU(s) the kubelet lists healthy: {listed_ids(marked)}")
    if not parts:
        return ok
    text = f"HAMi's annotation {key} differs from the kubelet: " + "; ".join(parts)
    if extra:
        return Diff(
            "stale_health",
            text,
            gpus,
            f"places Pods on GPU(s) the kubelet took out: {listed_ids(extra)}",
            count,
        )
    return Diff(
        "mismatched",
        text,
        gpus,
        f"does not offer GPU(s) the kubelet lists: {listed_ids(missing | marked)}",
        count,
    )


def unreadable(
    key: str, value: str | None, register: Register | None, copy: Read | None, listed: set[str] | None
) -> Diff:
    """The annotation absent, or not decodable by HAMi's decoder for the vendor (in the other format:
    a skew)."""
    count = len(listed or ())
    if register is not None and register.skew:
        return skewed(key, value, register, count)
    if register is None:
        code: Code = "missing"
        what = "is absent"
    else:
        code, what = "unparsable", f"does not decode ({register.why}): {(value or '')[:80]!r}"
    if copy is not None:
        return last_copy(key, what, copy, listed)
    return Diff(
        code,
        f"HAMi's annotation {key} {what}",
        0,
        "sees no GPU of this node from it ('node unregistered'), unless it read an earlier one",
        count,
    )


def skewed(key: str, value: str | None, register: Register, count: int) -> Diff:
    """The annotation in the format HAMi's decoder for the vendor does not read."""
    return Diff(
        "format_skew",
        f"HAMi's annotation {key} is {register.why}: {(value or '')[:80]!r}",
        0,
        "cannot decode the annotation: it keeps a copy it read before, else the node is 'node unregistered'",
        count,
    )


def last_copy(key: str, what: str, copy: Read, listed: set[str] | None) -> Diff:
    """The annotation unreadable after HAMi's scheduler read `copy`: its last copy."""
    n = len(copy.register.healthy)
    more = (
        f" (HAMi's scheduler read it: {n} healthy GPU(s), in place {copy.last - copy.first:.0f}s with its "
        "handshake, and keeps that copy)"
    )
    stale = copy.register.healthy - listed if listed is not None else frozenset()
    if stale:
        more += f"; the copy lists as healthy GPU(s) the kubelet does not list healthy: {listed_ids(stale)}"
    count = max(len(copy.register.ids), len(listed or ()))
    text = f"HAMi's annotation {key} {what}"
    return Diff("last_copy", text, 0, f"schedules on its last copy: {n} healthy GPU(s)", count, more)


def meanwhile(d: Diff, copy: Read | None, resource: str, handshake: bool) -> tuple[str, str]:
    """What HAMi's scheduler does while the plugin is down, where the annotation shows it: the reason's
    words and the short form."""
    if not handshake:
        return (
            "the Node has no handshake of HAMi's scheduler: none selects the node, or it has just cleaned "
            "the node up (v2.10 removes the handshake, and at its next tick stamps a new one and reads the "
            "annotation again)",
            "no handshake now: it does not select the node, or has just cleaned it up",
        )
    if d.code == "last_copy" and copy is not None:
        n = len(copy.register.healthy)
        return (
            f"HAMi's scheduler schedules on its last copy ({n} healthy GPU(s)): {plugin_down_note(resource)}",
            f"schedules on its last copy: {n} healthy GPU(s), while the Node's allocatable is above 0",
        )
    if d.gpus:
        return (
            f"HAMi's scheduler still offers the node from this annotation ({d.gpus} healthy GPU(s)): "
            f"{plugin_down_note(resource)}",
            f"still offers the node from the last annotation: {d.gpus} healthy GPU(s)",
        )
    return (
        "HAMi's scheduler offers no GPU of this node from the annotation",
        "offers no GPU of this node from the annotation",
    )


def comparable(register: Register, kubelet: frozenset[str], resource: str = "") -> bool:
    """Whether the two lists name the same things: every kubelet ID a device of the resource's vendor or
    a share of one, and every annotated device such an ID outside MIG (whose devices the kubelet names
    otherwise)."""
    return all(gpu_of(d, resource) is not None for d in kubelet) and all(
        gpu_of(g.id, resource) == g.id and g.mode.lower() != "mig" for g in register.gpus or ()
    )


def diff_note(register: Register | None, kubelet: frozenset[str] | None, why: str, resource: str = "") -> str:
    """What the verdict could not compare, said after it."""
    if kubelet is None:
        return f"; the kubelet's devices cannot be read ({why}): only the annotation's presence is judged"
    if register is not None and register.gpus is not None and not comparable(register, kubelet, resource):
        return "; its devices are not GPU UUIDs or HAMi's splits of them (MIG?): not compared"
    return ""


def agrees(register: Register | None, kubelet: frozenset[str] | None) -> str:
    """The verdict's words when the annotation lists what the kubelet lists."""
    n = len(register.healthy) if register is not None else 0
    if kubelet is None:
        return f"HAMi's annotation lists {n} healthy GPU(s)"
    return f"HAMi's annotation lists the {n} healthy GPU(s) the kubelet lists"


def listed_ids(ids: set[str] | frozenset[str]) -> str:
    """Some of the IDs, sorted, and how many more."""
    shown = sorted(ids)
    more = f" and {len(shown) - MAX_LISTED} more" if len(shown) > MAX_LISTED else ""
    return ", ".join(shown[:MAX_LISTED]) + more
