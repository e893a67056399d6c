"""What HAMi's code does with its Node annotations, as numbers and as the words the `hami:` verdicts say.

From Project-HAMi/HAMi at v2.10.0 (docs/kubelet.md#hami-registration names the files), and Go's runtime
for the order in which HAMi's plugin lists its GPUs; pure. The verdicts (`sidecar.hami.verdicts`) say
these facts in their reasons; the test rig's writers (testing/hamiwriter.py, tests/hamifixture.py)
mirror the same facts.
"""

from __future__ import annotations

# The plugin's WatchAndRegister: a changed device list is patched within 30 s (5 s after an error).
HAMI_LOOP = 30.0
# The scheduler's CheckHealth: a Requesting_ stamp older than 60 s with allocatable 0 cleans the node.
HANDSHAKE_EXPIRY = 60.0
SCHEDULER_TICK = 15.0  # RegisterFromNodeAnnotations' ticker
# A small Go map keeps its entries in one group of 8 slots, and each range starts at a random slot of it.
MAP_GROUP = 8


def same_order_odds(gpus: int) -> float:
    """How often HAMi's plugin lists `gpus` GPUs in the same order two rounds running.

    `getAPIDevices` ranges over a Go map (`rm.Devices`, keyed by UUID) with no sort. Go starts each range
    at a random slot of the map's group of 8 (go1.26 `internal/runtime/maps`: `entryOffset = rand()`; the
    runtime before 1.24 did the same with its bucket's `offset`), so with n <= 8 entries in slots 0..n-1
    the order is the rotation that starts at the first filled slot at or after that offset: slot 0 (the
    usual order, `usual_order_odds`) for 9 - n of the 8 offsets, slot k for one each. Two rounds agree
    with the chance that both start at the same slot. Above 8 GPUs the map has several groups; measured
    with go1.26, about 1 round in 8.
    """
    if gpus <= 1:
        return 1.0
    if gpus > MAP_GROUP:
        return 1 / MAP_GROUP
    return ((MAP_GROUP + 1 - gpus) ** 2 + gpus - 1) / MAP_GROUP**2


def usual_order_odds(gpus: int) -> float:
    """How often a round lists `gpus` GPUs in the usual order, the first one added to the map first: the
    order a round most likely cached, and the one whose cache lasts longest (`same_order_odds`)."""
    if gpus <= 1:
        return 1.0
    if gpus > MAP_GROUP:
        return 1 / MAP_GROUP
    return (MAP_GROUP + 1 - gpus) / MAP_GROUP


def rounds_to_repatch(gpus: int) -> float:
    """The rounds, on average, from a failed patch to the one that patches again (that one counted): the
    cached order waits for a round in another order, long where it is the usual one (0: never, one GPU)."""
    if gpus <= 1:
        return 0.0
    usual = usual_order_odds(gpus)
    rest = 1 / MAP_GROUP
    others = gpus - 1 if gpus <= MAP_GROUP else MAP_GROUP - 1
    return usual / (1 - usual) + others * rest / (1 - rest)


def cache_note(gpus: int) -> str:
    """Why HAMi's plugin may not write a stale annotation again by itself, for a node of `gpus` GPUs
    (0: not known)."""
    head = (
        "HAMi's plugin patches only an encoding that differs from its cache and writes the cache before "
        "the patch, so after a failed patch (or an annotation removed by another hand) it may skip every "
        "later round as 'unchanged' until the plugin restarts"
    )
    if gpus == 1:
        return f"{head} (with one GPU it always does: one GPU's list never changes order)"
    if gpus > 1:
        other = round(100 * (1 - usual_order_odds(gpus)))
        return (
            f"{head} (with {gpus} GPUs, until a round lists them in another order than the cached one, "
            f"Go's map order: from the usual order, about {other} % of rounds)"
        )
    return f"{head} (on several GPUs, until a round lists them in another order, Go's map order)"


# What HAMi's scheduler does with the node, for each kind of difference (the harm the reason names).
HARM = {
    "missing": (
        "HAMi's scheduler reads no GPU of this node from it: GPU Pods get 'node unregistered' where it "
        "never read an earlier annotation (one it read, it keeps scheduling on)"
    ),
    "unparsable": (
        "HAMi's scheduler cannot decode it: GPU Pods get 'node unregistered' where it never read an "
        "earlier annotation (one it read, it keeps scheduling on)"
    ),
    "mismatched": "HAMi's scheduler does not offer the GPU(s) the annotation leaves out or marks unhealthy",
    "stale_health": (
        "HAMi's scheduler places GPU Pods on the GPU(s) the kubelet took out, which the annotation still "
        "lists as healthy"
    ),
    "last_copy": (
        "HAMi's scheduler keeps scheduling on its last copy of the annotation, which no later change of "
        "the node's GPUs reaches; once it cleans the node up (the Node's allocatable at 0) it has none, "
        "and GPU Pods get 'node unregistered'"
    ),
}


def plugin_down_note(resource: str) -> str:
    """What HAMi's scheduler does with a node whose plugin is down but whose annotation still lists GPUs."""
    return (
        f"it drops the node once the Node's allocatable {resource} is 0, and (v2.9 and later) adds it back "
        "from the annotation at a later tick and drops it again, until the plugin writes the annotation anew"
    )


def _release(version: str) -> tuple[int, ...] | None:
    """A HAMi release `v2.10.0` (or `2.10.0`, a suffix after `-` or `+` ignored) as numbers; None: not one."""
    core = version.strip().removeprefix("v").split("-", 1)[0].split("+", 1)[0]
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() and len(p) < 6 for p in parts):
        return None
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def cache_fixed(version: str, fixed_in: str) -> bool:
    """Whether HAMi release `version` caches its plugin's annotation only after the patch succeeds (the
    fix of the cache written before the patch): only when a setting names the first release that
    carries it (`fixed_in`) and `version` is that one or later. No release up to v2.10.0 carries it;
    unknown (either empty or not a release) keeps the stuck-cache rule."""
    have, first = _release(version), _release(fixed_in)
    return have is not None and first is not None and have >= first
