"""HAMi's own registration, as hami-doctor reads and judges it: the rows hami-registration and
hami-handshake.

The evidence is the sidecar's (`sidecar.hami.watch`): this node's Node from the API server (the Pod's
ServiceAccount, or --kubeconfig), the kubelet's healthy devices from pod-resources, judged with no wait
for HAMi's 30 s loop (a snapshot: a difference may be HAMi's loop at work, which the plugin's log tells
apart: `patch node error` then `Device info unchanged, skipping annotation update` is its cache skipping
the patch, which it may do until the plugin restarts). A Node that cannot be read is "unknown" with the
API's answer; a plugin that does not serve or register is "unknown" too, said as not judged, with what
HAMi's scheduler does meanwhile. The handshake is judged as it stands: a `Deleted_` handshake and a
`Requesting_` one with no allocatable GPU are what HAMi's scheduler cleans a node up for
(docs/kubelet.md#hami-registration).
"""

from __future__ import annotations

from collections.abc import Sequence

from doctor.patterns import RESTART_PLUGIN
from doctor.types import Cause, HamiReading, LogFindings, LogHit
from hami_guard import profiles
from sidecar.deviceplugin.probes import Reading
from sidecar.hami.annotation import CSV, JSON, parse_handshake
from sidecar.hami.facts import HAMI_LOOP, cache_note
from sidecar.hami.verdicts import DIFFERS, HamiKeys
from sidecar.hami.watch import HamiWatch
from sidecar.health import Status
from sidecar.kube.access import ApiAccess

PATCH_ERROR = "patch node error"
SKIPPED = "Device info unchanged, skipping annotation update"


async def gather_hami(
    api: ApiAccess,
    node: str,
    keys: Sequence[tuple[str, str]],
    handshake: str,
    *,
    kubelet: Reading[dict[str, frozenset[str]]],
    serving: dict[str, bool],
    timeout: float,
) -> tuple[HamiReading, ...]:
    """One reading of the Node, each resource judged with no wait (a snapshot). `serving`: per resource,
    the plugin answers its probe; the kubelet holds it when pod-resources lists its devices."""
    # Each vendor's register format, as HAMi decodes it; no stamp rule (a snapshot cannot see a stamp
    # stop advancing).
    hkeys = tuple(HamiKeys(r, k, handshake, register_format(r)) for r, k in keys)
    watch = HamiWatch(hkeys, {}, api, node, pod_resources_socket="", timeout=timeout, every=0.0, repair=0.0)
    listed = kubelet.value or {}
    checks = {k.resource: (serving.get(k.resource, False), bool(listed.get(k.resource))) for k in hkeys}
    try:
        found = await watch.round(checks, kubelet)
    finally:
        await watch.close()
    where = api.source or api.server
    out = []
    for k in hkeys:
        ev, verdict = found[k.resource]
        n = ev.node
        out.append(
            HamiReading(
                k,
                ev,
                verdict,
                n.annotations.get(k.handshake) if n is not None else None,
                n.allocatable.get(k.resource) if n is not None else None,
                where,
                node,
            )
        )
    return tuple(out)


def register_format(resource: str) -> str:
    """The format HAMi decodes `resource`'s register annotation in: its vendor profile's, else JSON."""
    v = profiles.for_resource(resource)
    return v.hami.register_format if v is not None else JSON


def hami_causes(readings: Sequence[HamiReading], plugin_logs: Sequence[LogFindings]) -> list[Cause]:
    """hami-registration and hami-handshake: one row each."""
    return [registration_cause(readings, plugin_logs), handshake_cause(readings)]


def registration_cause(readings: Sequence[HamiReading], logs: Sequence[LogFindings]) -> Cause:
    """Does HAMi's register annotation list the GPUs the kubelet lists healthy?"""
    cause = Cause("hami-registration", "ok")
    stuck = _defect_lines(logs)
    for r in readings:
        v, key, res = r.verdict, r.keys.register, r.keys.resource
        if v.code in ("no_evidence", "plugin_down"):
            cause.verdict = "unknown" if cause.verdict == "ok" else cause.verdict
            where = f" ({r.api})" if v.code == "no_evidence" else ""
            cause.evidence.append(f"{res}: {v.reason}{where}")
        elif v.code == "wrong_node":
            cause.problem(
                f"{res}: {v.reason}",
                [
                    "run hami-doctor with NODE_NAME set to this node's name (the Pod sets it from "
                    "spec.nodeName)"
                ],
            )
        elif v.code == "format_skew":
            cause.problem(f"{res}: {v.reason.split('. A plugin restart', 1)[0]}", _skew_fix(r.keys.format))
        elif v.status is Status.FAILED and v.code in DIFFERS:
            cause.problem(f"{res}: {_snapshot(v.reason)}", _fix(stuck, key, v.code))
            cause.note_first(f"{res}: HAMi's scheduler {v.scheduler}")
            for line in stuck:
                cause.evidence.insert(1, line)
        else:
            cause.evidence.append(f"{res}: {v.reason}")
    return cause


def _skew_fix(reads: str) -> list[str]:
    """What mends a register annotation in the format HAMi's decoder for the vendor does not read."""
    wants = "the legacy CSV text (EncodeNodeDevices)" if reads == CSV else "JSON (MarshalNodeDevices)"
    return [
        f"HAMi's scheduler decodes this vendor's annotation as {wants}; the plugin writes the other "
        "format, and a restart writes the same again: do not restart it. Run the plugin release made for "
        "your HAMi release (or the HAMi release that reads what the plugin writes); compare the images:",
        "$ kubectl get daemonsets -A -o wide | grep -i -e hami -e device-plugin",
    ]


def _snapshot(reason: str) -> str:
    """The verdict's reason and the harm it names, without the sidecar's timing and HAMi's loop (a
    snapshot has none: the fix says it)."""
    return reason.split(". HAMi's loop would have", 1)[0].replace(" for 0s while", " while", 1)


def _fix(stuck: list[str], key: str, code: str) -> list[str]:
    why = {
        "stale_health": "until then HAMi's scheduler places GPU Pods on the GPU(s) the kubelet took out: ",
        "last_copy": "until then HAMi's scheduler schedules on its last copy: ",
    }.get(code, "")
    if stuck:
        return [
            f"HAMi's plugin cached {key}'s new content before a patch that failed, and now skips the patch "
            f"as unchanged (its log, above); {why}restart the plugin pod, which writes it again:",
            RESTART_PLUGIN,
        ]
    return [
        f"HAMi's loop rewrites a changed device list within {HAMI_LOOP:.0f} s: run hami-doctor again in a "
        f"minute; if it still differs, {cache_note(0)} (raise its log level to -v=3 to see `Device info "
        f"unchanged`); {why}restart the plugin pod:",
        RESTART_PLUGIN,
    ]


def _defect_lines(logs: Sequence[LogFindings]) -> list[str]:
    """The plugin's log lines that prove the stuck cache: a current failed patch, then skipped rounds."""
    out = []
    for f in logs:
        hits: dict[str, LogHit] = {h.text: h for h in f.current if h.pattern.cause == "hami-registration"}
        failed, skipped = hits.get(PATCH_ERROR), hits.get(SKIPPED)
        if failed is not None:
            out.append(f"{f.source}: {failed.count} x {failed.newest!r} ({failed.meaning})")
            if skipped is not None:
                out.append(f"{f.source}: then {skipped.count} x {skipped.newest!r}")
    return out


def handshake_cause(readings: Sequence[HamiReading]) -> Cause:
    """The scheduler's handshake with this node, as it stands."""
    cause = Cause("hami-handshake", "ok")
    for r in readings:
        if r.evidence.node is None:
            cause.verdict = "unknown" if cause.verdict == "ok" else cause.verdict
            cause.evidence.append(f"{r.keys.resource}: the Node could not be read")
            continue
        hs = parse_handshake(r.handshake)
        name = f"{r.keys.handshake}={r.handshake!r}"
        remove = f"$ kubectl annotate node {r.node} {r.keys.handshake}-"
        if hs.state == "deleted":
            cause.problem(
                f"{name}: HAMi's scheduler cleaned this node's devices up. Schedulers before v2.10 wrote "
                "this; those before v2.9 keep it and the node's devices out (NVIDIA's v2.8 ignores it, "
                "v2.9 replaces it after 60 s, v2.10 writes none)",
                ["remove it; the scheduler hands shakes again within 15 s:", remove],
            )
        elif hs.state == "requesting" and not r.allocatable:
            cause.problem(
                f"{name}, and the Node's allocatable {r.keys.resource} is {r.allocatable or 0}: HAMi's "
                "scheduler drops the node's devices (`Device is unhealthy, cleaning up node`) once the stamp "
                "is 60 s old; v2.10 at once, then adds them back from the annotation for a minute at a time",
                ["the kubelet does not report the GPUs in the Node's status: see the rows above"],
            )
        elif hs.state == "absent":
            cause.evidence.append(
                f"{r.keys.resource}: no {r.keys.handshake}: HAMi's scheduler has not looked at this node "
                "yet, or does not select it (its node selector, gpu=on by default) or does not run, or "
                "cleaned it up within the last 15 s (v2.10 removes the handshake then)"
            )
        else:
            cause.evidence.append(f"{r.keys.resource}: {name}; allocatable {r.allocatable}")
    return cause
