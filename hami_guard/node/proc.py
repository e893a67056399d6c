"""Is the kubelet visible, and under which name? A cheap /proc scan shared by the checks and psutil.

Standard library only: `initcheck.checks` asks here first, so psutil (`hami_guard.node.kubelet`)
is imported only when there is a kubelet to inspect.

The kubelet is not always a process of its own: k3s runs it inside the `k3s` process
(`k3s-server` or `k3s-agent`), microk8s inside `kubelite`. RKE2 starts the real `kubelet`
binary from its own data folder. The name `kubelet` therefore means "the kubelet, wherever it
runs"; any other name means exactly that process.
"""

from __future__ import annotations

import os

DEFAULT_NAME = "kubelet"
# Processes that run the kubelet inside themselves, in the order they are looked for after `kubelet`.
EMBEDDING = ("k3s-server", "k3s-agent", "k3s", "kubelite")
COMM_LENGTH = 15  # the kernel keeps 15 characters of a process name


def process_names(name: str) -> tuple[str, ...]:
    """The process names that may hold the kubelet: `kubelet` also means k3s and microk8s."""
    return (name, *EMBEDDING) if name == DEFAULT_NAME else (name,)


def process_visible(name: str) -> bool:
    """Is any process that may be the kubelet (see `process_names`) visible? Reads /proc/<pid>/comm,
    so psutil (about 13 ms of imports) is loaded only when there is a kubelet to inspect."""
    wanted = {n[:COMM_LENGTH] for n in process_names(name)}
    try:
        pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True  # no /proc to scan: let psutil say
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().rstrip("\n") in wanted:
                    return True
        except OSError:
            continue
    return False


def distribution(comm: str, cmdline: list[str]) -> str:
    """Which Kubernetes distribution runs this kubelet process: kubelet, k3s, rke2 or microk8s."""
    if comm.startswith("k3s"):
        return "k3s"
    if comm == "kubelite":
        return "microk8s"
    if any("/rancher/rke2/" in part for part in cmdline[:1]):
        return "rke2"
    return "kubelet"


def no_kubelet(name: str) -> str:
    """Why the kubelet's listening paths were not read."""
    names = " or ".join(process_names(name))
    return (
        f"no process named {names} is visible, so where it listens was not checked "
        "(the pod needs hostPID: true; HAMi's DaemonSet has it)"
    )
