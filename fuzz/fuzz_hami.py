"""Fuzz harness: HAMi's Node annotations and the Node object, parsed totally, and judged.

`parse_node` reads the API server's answer (a Node), `parse_register` HAMi's register annotation as its
scheduler decodes it, `parse_handshake` the scheduler's handshake, `gpu_of` a kubelet device ID; none ever
raises, and the `hami:` verdict on what they give is always one of its codes. Any exception, or an answer
of the wrong shape, is a finding (`make fuzz`; seeds in fuzz/corpus/hami/).
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.hami.annotation import (
    Handshake,
    NodeView,
    Register,
    gpu_of,
    parse_handshake,
    parse_node,
    parse_register,
)
from sidecar.hami.verdicts import CODES, DIFFERS, HamiEvidence, HamiJudge, HamiKeys
from sidecar.health import Status

KEYS = HamiKeys("nvidia.com/gpu", "hami.io/node-nvidia-register", "hami.io/node-handshake")


def TestOneInput(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    register = parse_register(text)
    assert isinstance(register, Register)
    assert (register.gpus is None) == bool(register.why)
    assert all(isinstance(g.id, str) and g.index >= 0 for g in register.gpus or ())
    assert isinstance(parse_handshake(text), Handshake)
    node = parse_node(data, [KEYS.register, KEYS.handshake])
    assert isinstance(node, NodeView | str)
    ids = frozenset(text.split("\n")[:64])
    for device in ids:
        g = gpu_of(device)
        assert g is None or device.startswith(g)
    if isinstance(node, NodeView):
        now = [0.0]
        judge = HamiJudge((KEYS,), "gpu-node-1", 60.0, lambda: now[0])
        ev = HamiEvidence(node, kubelet=ids, plugin_ok=True, registered_ok=True, boot_id=node.boot_id)
        # Read twice a scheduler tick apart (the scheduler's copy), then without the annotation, then with
        # the plugin down: every path a Node's text can reach.
        gone = NodeView(node.name, {k: v for k, v in node.annotations.items() if k != KEYS.register})
        for e in (ev, ev, replace(ev, node=gone), replace(ev, node=gone, plugin_ok=False)):
            v = judge.judge(KEYS.resource, e)
            assert v.code in CODES and isinstance(v.status, Status) and v.reason
            assert v.live_failed == (v.code in DIFFERS and v.status is Status.FAILED and not v.budget_spent)
            now[0] += 61.0
