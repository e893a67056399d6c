"""The reason codes the checks publish as a metric's label: vocabulary the judges and the metrics share
(docs/design.md#layers), written once here. Standard library only; it imports nothing of the project, so
every layer may import it."""

from __future__ import annotations

from typing import Literal, get_args

# The `hami:` check's reason codes (`sidecar.hami.verdicts`): the values of
# device_plugin_hami_registration's `reason` label (`sidecar.server.metrics`), in this order, and the
# words of its help text. A code added here is judged, published and described everywhere.
HamiCode = Literal[
    "ok",
    "repairing",
    "no_evidence",
    "plugin_down",
    "no_handshake",
    "missing",
    "unparsable",
    "mismatched",
    "stale_health",
    "last_copy",
    "wrong_node",
    "handshake_deleted",
    "handshake_expired",
    "format_skew",
    "stamp_stalled",
]
HAMI_CODES: tuple[HamiCode, ...] = get_args(HamiCode)
