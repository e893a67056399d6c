"""The DRA drivers' configuration: which drivers to watch and where (`DraSpec`, `dra_spec`), their
grace, and how the sidecar and hami-doctor reach the API server for their ResourceSlices
(`ApiAccess`).

Configuration only, for `sidecar.config` and `doctor.settings` to name without importing the
verdicts or the reading itself (`sidecar.dra.slices`, which brings aiohttp): the standard library,
nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SA_DIR}/token"
DEFAULT_CA_FILE = f"{SA_DIR}/ca.crt"

# The grace covers one full retry interval of the kubelet (at most 2 min 2 s apart: the verdicts'
# KUBELET_RETRY_CAP) plus its registration and connection.
DEFAULT_GRACE = 150.0

# The kubelet's plugin watcher folder, and the helper's default registration socket name.
DEFAULT_REGISTRY = "/var/lib/kubelet/plugins_registry"


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
        raise ValueError(f"expected NAME[=SOCKET] (gpu.nvidia.com=gpu.nvidia.com-reg.sock), got {value!r}")
    if "\0" in sock:
        raise ValueError(f"a socket path has no NUL: {value!r}")
    sock = sock or f"{name}-reg.sock"
    path = sock if sock.startswith("/") else f"{registry.rstrip('/')}/{sock}"
    return DraSpec(name, path)


@dataclass(frozen=True)
class ApiAccess:
    """The API server to read ResourceSlices from, and the ServiceAccount's token and CA to do it with."""

    server: str  # https://host:port
    token_file: str = DEFAULT_TOKEN_FILE
    ca_file: str = DEFAULT_CA_FILE


def in_cluster(environ: Mapping[str, str] | None = None) -> str:
    """The API server's address from the Pod's environment, "" when it is not there."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
