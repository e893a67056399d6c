"""The kubelet's device-plugin socket: where it is by default, and whether a Unix socket accepts."""

from __future__ import annotations

import errno
import socket

# The kubelet's defaults (docs/kubelet.md#socket-path) and the name its process has.
DEFAULT_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_SOCKET = "kubelet.sock"
DEFAULT_KUBELET_PROCESS = "kubelet"


def try_connect(path: str, timeout: float = 1.0) -> int | None:
    """errno of a Unix connect(), or None when it was accepted (a full backlog counts as listening)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError as e:
            return e.errno or errno.EIO
    return None
