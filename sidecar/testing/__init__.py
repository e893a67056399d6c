"""A kubelet simulator and a fake device plugin, shipped for tests, the demo and the benchmarks.

Like `aiohttp.test_utils`, this is part of the package: `from sidecar.testing import FakeKubelet`.
"""

from sidecar.testing.kubelet import (
    ERR_DIAL,
    ERR_INVALID_RESOURCE_NAME,
    ERR_OPTIONS,
    ERR_UNSUPPORTED_VERSION,
    KUBELET_SOCKET,
    FakeKubelet,
    is_extended_resource_name,
)
from sidecar.testing.plugin import FakeDevicePlugin

__all__ = [
    "ERR_DIAL",
    "ERR_INVALID_RESOURCE_NAME",
    "ERR_OPTIONS",
    "ERR_UNSUPPORTED_VERSION",
    "KUBELET_SOCKET",
    "FakeDevicePlugin",
    "FakeKubelet",
    "is_extended_resource_name",
]
