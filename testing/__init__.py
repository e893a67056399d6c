"""A kubelet simulator and a fake device plugin, shipped for tests, the demo and the benchmarks.

Like `aiohttp.test_utils`, this is part of the package: `from testing import FakeKubelet`.
"""

import socket

from testing.kubelet import (
    ERR_ALREADY_CONNECTED,
    ERR_DIAL,
    ERR_INVALID_RESOURCE_NAME,
    ERR_OPTIONS,
    ERR_RATE_LIMIT,
    ERR_UNSUPPORTED_VERSION,
    KUBELET_SOCKET,
    DeviceManagerError,
    FakeKubelet,
    RealKubeletFolderError,
    go_quote,
    invalid_resource_name_error,
    is_extended_resource_name,
    is_simulator_checkpoint,
    unsupported_version_error,
)
from testing.plugin import FakeDevicePlugin, hami_device_ids


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (as aiohttp.test_utils.unused_port)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


__all__ = [
    "ERR_ALREADY_CONNECTED",
    "ERR_DIAL",
    "ERR_INVALID_RESOURCE_NAME",
    "ERR_OPTIONS",
    "ERR_RATE_LIMIT",
    "ERR_UNSUPPORTED_VERSION",
    "KUBELET_SOCKET",
    "DeviceManagerError",
    "FakeDevicePlugin",
    "FakeKubelet",
    "RealKubeletFolderError",
    "free_port",
    "go_quote",
    "hami_device_ids",
    "invalid_resource_name_error",
    "is_extended_resource_name",
    "is_simulator_checkpoint",
    "unsupported_version_error",
]
