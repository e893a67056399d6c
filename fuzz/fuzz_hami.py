"""Fuzz harness: HAMi's Node annotations and the Node object, parsed totally, and judged.

`parse_node` reads the API server's answer (a Node), `parse_register` HAMi's register annotation as its
scheduler decodes it (JSON, or the legacy CSV of `parse_csv`: each vendor's), `parse_handshake` the
scheduler's handshake, `gpu_of` a kubelet device ID; none ever raises, and the `hami:` verdict on what
they give is always one of its codes, a format skew never a restart. Any exception, or an answer of the
wrong shape, is a finding (`make fuzz`; seeds in fuzz/corpus/hami/).
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.hami.annotation import (
    CSV,
    Handshake,
    NodeView,
    Register,
    gpu_of,
    parse_csv,
    parse_handshake,
    parse_node,
    parse_register,
)
from sidecar.hami.verdicts import CODES, DIFFERS, HamiEvidence, HamiJudge, HamiKeys
from sidecar.health import Status

KEYS = HamiKeys("nvidia.com/gpu", "hami.io/node-nvidia-register", "hami.io/node-handshake")
DCU = HamiKeys(
    "hygon.com/dcunum", "hami.io/node-dcu-register", "hami.io/node-handshake-dcu", CSV, stamps=True
)


def TestOneInput(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    for register in (parse_register(text), parse_register(text, CSV), parse_csv(text)):
        assert isinstance(register, Register)
        assert (register.gpus is None) == bool(register.why)
        assert not register.skew or register.gpus is None
        assert all(isinstance(g.id, str) and g.index >= 0 for g in register.gpus or ())
    assert isinstance(parse_handshake(text), Handshake)
    node = parse_node(data, [KEYS.register, KEYS.handshake, DCU.register, DCU.handshake])
    assert isinstance(node, NodeView | str)
    ids = frozenset(text.split("\n")[:64])
    for device in ids:
        for resource in ("", KEYS.resource, DCU.resource):
            g = gpu_of(device, resource)
            assert g is None or device.startswith(g)
    if isinstance(node, NodeView):
        for keys in (KEYS, DCU):
            judge_node(node, keys, ids)


def judge_node(node: NodeView, keys: HamiKeys, ids: frozenset[str]) -> None:
    """Every path a Node's text can reach, for one vendor's keys: read twice a scheduler tick apart (the
    scheduler's copy), then without the annotation, then with the plugin down."""
    now = [0.0]
    judge = HamiJudge((keys,), "gpu-node-1", 60.0, lambda: now[0])
    ev = HamiEvidence(node, kubelet=ids, plugin_ok=True, registered_ok=True, boot_id=node.boot_id)
    gone = NodeView(node.name, {k: v for k, v in node.annotations.items() if k != keys.register})
    for e in (ev, ev, ev, replace(ev, node=gone), replace(ev, node=gone, plugin_ok=False)):
        v = judge.judge(keys.resource, e)
        assert v.code in CODES and isinstance(v.status, Status) and v.reason
        live = v.code in {*DIFFERS, "stamp_stalled"} and v.status is Status.FAILED and not v.budget_spent
        assert v.live_failed == live
        assert not (v.code == "format_skew" and v.restarts)
        now[0] += 61.0
