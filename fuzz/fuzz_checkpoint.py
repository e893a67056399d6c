"""The kubelet's device manager checkpoint (sidecar/deviceplugin/checkpoint.py): `parse_registered` answers
the resources and their device IDs, or raises `CheckpointError`, the one failure its callers handle."""

from __future__ import annotations

from sidecar.deviceplugin.checkpoint import CheckpointError, parse_registered


def TestOneInput(data: bytes) -> None:
    try:
        registered = parse_registered(data)
    except CheckpointError:
        return
    for resource, ids in registered.items():
        assert isinstance(resource, str) and isinstance(ids, tuple)
        assert all(isinstance(i, str) for i in ids)
