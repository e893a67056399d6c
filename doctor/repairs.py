"""The only repairs hami-doctor makes: removing plugin sockets that nothing listens on.

Never `kubelet.sock`, never the checkpoint; permission fixes on `kubelet.sock` are printed
as commands, not applied. `plan` reads the evidence only; `apply` looks again before
each removal, since a plugin may have started listening in between.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

from doctor.evidence import NodeEvidence
from initcheck.checks import try_connect
from sidecar.checkpoint import CHECKPOINT_NAME

STALE = "a plugin socket nothing listens on (the plugin died)"


@dataclass(frozen=True)
class Repair:
    path: str
    why: str
    command: str
    applied: bool = False
    error: str = ""


def plan(e: NodeEvidence) -> list[Repair]:
    """A removal for each socket file in the folder that refused a connection, but the kubelet's own."""
    names = {os.path.basename(e.kubelet_path), CHECKPOINT_NAME}

    def protected(path: str) -> bool:
        return os.path.basename(path) in names or os.path.abspath(path) == os.path.abspath(e.kubelet_path)

    return [
        Repair(s.path, STALE, f"rm {s.path}")
        for s in e.folder_sockets
        if not s.listening and not protected(s.path)
    ]


def apply(repairs: Iterable[Repair]) -> list[Repair]:
    """Each repair carried out, or why not; a socket that accepts connections again is left alone."""
    done = []
    for r in repairs:
        try:
            if try_connect(r.path, timeout=0.2) is None:
                done.append(replace(r, error="skipped: it accepts connections again"))
                continue
            os.unlink(r.path)
            done.append(replace(r, applied=True))
        except OSError as e:
            done.append(replace(r, error=e.strerror or str(e)))
    return done
