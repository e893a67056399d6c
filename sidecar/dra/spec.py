"""How the sidecar and hami-doctor reach the API server for the DRA drivers' ResourceSlices.

Configuration only, for `sidecar.config` and `doctor.settings` to name without importing the
reading itself (`sidecar.dra.slices`, which brings aiohttp): the standard library, nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SA_DIR}/token"
DEFAULT_CA_FILE = f"{SA_DIR}/ca.crt"


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
