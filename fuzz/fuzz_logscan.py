"""The doctor's log parsing (doctor/logscan.py): `scan` over the kubelet's and the plugin's patterns (the
catalogue, doctor/patterns.toml), with and without a time window, and `lines_of` (klog, CRI with partial
lines, journal lines)."""

from __future__ import annotations

import calendar

from doctor.logscan import MAX_LINE, lines_of, scan
from doctor.patterns import KUBELET_PATTERNS, PLUGIN_PATTERNS

# The seeds (fuzz/seeds.py) are stamped 2026-12-03T06:00:00Z: the window of an hour holds them.
NOW = calendar.timegm((2026, 12, 3, 6, 30, 0, 0, 0, 0))


def TestOneInput(data: bytes) -> None:
    for patterns, since in ((KUBELET_PATTERNS, 3600.0), (PLUGIN_PATTERNS, 3600.0), (PLUGIN_PATTERNS, None)):
        found = scan(data, patterns, "fuzz", since, NOW)
        assert found.read and not found.problem and found.lines >= 0
        for hit in found.hits:
            assert hit.count >= 1 and len(hit.newest) <= MAX_LINE and hit.meaning
    for _, line in lines_of(data):
        assert "\n" not in line
