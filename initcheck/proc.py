"""Is a process visible by name? A cheap /proc scan shared by the checks and the psutil lookup.

Standard library only: `initcheck.checks` asks here first, so psutil (`initcheck.kubelet`)
is imported only when there is a kubelet to inspect.
"""

from __future__ import annotations

import os


def process_visible(name: str) -> bool:
    """Is any process named `name` visible? Reads /proc/<pid>/comm, so psutil (about 13 ms of
    imports) is loaded only when there is a kubelet to inspect."""
    try:
        pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True  # no /proc to scan: let psutil say
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().rstrip("\n") == name[:15]:  # the kernel keeps 15 characters
                    return True
        except OSError:
            continue
    return False


def no_kubelet(name: str) -> str:
    """Why the kubelet's listening paths were not read."""
    return (
        f"no process named {name} is visible, so where it listens was not checked "
        "(the pod needs hostPID: true; HAMi's DaemonSet has it)"
    )
