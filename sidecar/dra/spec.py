"""The DRA drivers' configuration: which drivers to watch and where (`DraSpec`, `dra_spec`), their
grace, and how the sidecar and hami-doctor reach the API server for their ResourceSlices
(`ApiAccess`).

Configuration only, for `sidecar.config` and `doctor.settings` to name without importing the
verdicts or the reading itself (`sidecar.dra.slices`, which brings aiohttp): the standard library,
nothing else. The API server's access is the project's shared one (`sidecar.kube.access`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hami_guard.profiles import DEFAULT as PROFILE
from sidecar.kube.access import DEFAULT_CA_FILE, DEFAULT_TOKEN_FILE, SA_DIR, ApiAccess, in_cluster

__all__ = [
    "DEFAULT_CA_FILE",
    "DEFAULT_GRACE",
    "DEFAULT_REGISTRY",
    "DEFAULT_TOKEN_FILE",
    "SA_DIR",
    "ApiAccess",
    "DraSpec",
    "dra_spec",
    "in_cluster",
]

# The grace covers one full retry interval of the kubelet (at most 2 min 2 s apart: the verdicts'
# KUBELET_RETRY_CAP) plus its registration and connection.
DEFAULT_GRACE = 150.0

# The kubelet's plugin watcher folder, and the helper's default registration socket name.
DEFAULT_REGISTRY = "/var/lib/kubelet/plugins_registry"
# A driver's name for the examples: the default vendor profile's first DRA driver.
EXAMPLE = next((driver for _, driver in PROFILE.dra), "gpu.example.com")


@dataclass(frozen=True)
class DraSpec:
    """A DRA driver to watch: its name, its registration socket, and optionally its service socket
    (by default the endpoint its GetInfo names)."""

    name: str
    registration: str
    service: str = ""


def dra_spec(value: str, registry: str = DEFAULT_REGISTRY) -> DraSpec:
    """`NAME[=SOCKET]`: a driver name and its registration socket, a path or a file name in
    `registry` (default `<NAME>-reg.sock`, the kubelet plugin helper's). Raises ValueError."""
    name, _, sock = value.strip().partition("=")
    name, sock = name.strip(), sock.strip()
    if not name or "/" in name or any(c.isspace() for c in name) or "," in name:
        raise ValueError(f"expected NAME[=SOCKET] ({EXAMPLE}={EXAMPLE}-reg.sock), got {value!r}")
    if "\0" in sock:
        raise ValueError(f"a socket path has no NUL: {value!r}")
    sock = sock or f"{name}-reg.sock"
    path = sock if sock.startswith("/") else f"{registry.rstrip('/')}/{sock}"
    return DraSpec(name, path)
