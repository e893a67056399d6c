"""Where the API server is and how to authenticate to it: the Pod's ServiceAccount, or a kubeconfig.

Configuration only, for `sidecar.config` and `doctor.settings` to name without importing the reading
itself (`sidecar.kube.client`, which brings aiohttp): the standard library, nothing else (a kubeconfig
in YAML is read with PyYAML when it is installed; JSON always).
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SA_DIR}/token"
DEFAULT_CA_FILE = f"{SA_DIR}/ca.crt"
MAX_KUBECONFIG = 1024 * 1024
MAX_PEM = 4 * 1024 * 1024  # a CA bundle, a client certificate or key: kilobytes, a system bundle 200 KiB


class NotRegularFile(OSError):
    """A credential's path names something else than a regular file (a FIFO, a device, a folder, a
    socket): it is not read."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` (OSError beyond). Looked at before it is
    opened and once open, and opened with O_NONBLOCK: a FIFO, a device or a folder is `NotRegularFile`
    at once, never an open or a read that waits for a writer (the sidecar's event loop, the doctor)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(errno.EINVAL, f"{_kind(mode)}, not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode  # what was opened, had the path changed since
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"{_kind(mode)}, not a regular file", path)
        chunks: list[bytes] = []
        taken = 0
        while taken <= limit and (chunk := os.read(fd, min(1 << 16, limit + 1 - taken))):
            chunks.append(chunk)
            taken += len(chunk)
    finally:
        os.close(fd)
    if taken > limit:
        raise OSError(errno.EFBIG, f"over {limit} bytes", path)
    return b"".join(chunks)


@dataclass(frozen=True)
class ApiAccess:
    """The API server, and what proves who asks: a token file re-read on every request (a projected
    ServiceAccount token rotates), or a kubeconfig's inline token or client certificate."""

    server: str  # https://host:port
    token_file: str = DEFAULT_TOKEN_FILE
    ca_file: str = DEFAULT_CA_FILE
    token: str = ""  # inline (a kubeconfig's); wins over token_file
    ca_data: str = ""  # PEM (a kubeconfig's certificate-authority-data, decoded); wins over ca_file
    cert_file: str = ""  # a client certificate (a kubeconfig's client-certificate, e.g. the kubelet's)
    key_file: str = ""
    cert_data: str = ""  # PEM, inline
    key_data: str = ""
    source: str = ""  # where these came from, for the reasons ("" the ServiceAccount's files)

    def read_token(self, limit: int) -> str:
        """The token in `token_file`, read now (a projected token rotates): a regular file of at most
        `limit` bytes, else OSError (`read_regular`)."""
        return read_regular(self.token_file, limit).decode("utf-8", "replace").strip()

    def read_ca(self) -> str:
        """The PEM certificates in `ca_file` (a regular file: `read_regular`), for `cadata`: what is not
        ASCII (a bundle's comments) is left out, which no PEM block holds. Raises OSError."""
        return read_regular(self.ca_file, MAX_PEM).decode("ascii", "ignore")

    def check_client_files(self) -> None:
        """`cert_file` and `key_file`, which OpenSSL opens by name, are regular files: OSError else."""
        for path in (self.cert_file, self.key_file):
            if path and not stat.S_ISREG(mode := os.stat(path).st_mode):
                raise NotRegularFile(errno.EINVAL, f"{_kind(mode)}, not a regular file", path)


def in_cluster(environ: Mapping[str, str] | None = None) -> str:
    """The API server's address from the Pod's environment, "" when it is not there."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class KubeconfigError(ValueError):
    """A kubeconfig that cannot be used, and why (one line)."""


def from_kubeconfig(path: str, context: str = "") -> ApiAccess:
    """The API server and credentials of a kubeconfig's context (its current one by default). Paths in
    it are relative to its folder, as kubectl reads them. Raises KubeconfigError."""
    try:
        raw = read_regular(path, MAX_KUBECONFIG)
    except OSError as e:
        raise KubeconfigError(f"{path}: {e.strerror or e}") from e
    doc = _load(raw, path)
    ctx_name = context or _str(doc.get("current-context"))
    ctx = _named(doc, "contexts", ctx_name, path).get("context")
    if not isinstance(ctx, dict):
        raise KubeconfigError(f"{path}: context {ctx_name!r} has no cluster and user")
    cluster = _named(doc, "clusters", _str(ctx.get("cluster")), path).get("cluster")
    user = _named(doc, "users", _str(ctx.get("user")), path).get("user") if ctx.get("user") else {}
    if not isinstance(cluster, dict) or not isinstance(user, dict):
        raise KubeconfigError(f"{path}: context {ctx_name!r}: its cluster or user is not a mapping")
    server = _str(cluster.get("server"))
    if not server.startswith("https://"):
        raise KubeconfigError(f"{path}: cluster server {server!r} is not an https:// address")
    base = os.path.dirname(os.path.abspath(path))

    def rel(v: Any) -> str:
        s = _str(v)
        return s if not s or os.path.isabs(s) else os.path.join(base, s)

    if "exec" in user or "auth-provider" in user:
        raise KubeconfigError(
            f"{path}: user of context {ctx_name!r} authenticates with a plugin (exec/auth-provider), which "
            "hami-doctor does not run: use a token or a client certificate (the kubelet's kubeconfig has one)"
        )
    return ApiAccess(
        server=server,
        token_file=rel(user.get("tokenFile")),
        ca_file=rel(cluster.get("certificate-authority")),
        token=_str(user.get("token")),
        ca_data=_b64(cluster.get("certificate-authority-data"), path),
        cert_file=rel(user.get("client-certificate")),
        key_file=rel(user.get("client-key")),
        cert_data=_b64(user.get("client-certificate-data"), path),
        key_data=_b64(user.get("client-key-data"), path),
        source=f"kubeconfig {path} (context {ctx_name})",
    )


def _load(raw: bytes, path: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        try:
            import yaml  # noqa: PLC0415 (optional: only a YAML kubeconfig needs it)
        except ImportError:
            raise KubeconfigError(
                f"{path} is YAML and PyYAML is not installed here: give it as JSON "
                "(kubectl config view --raw --minify -o json > kubeconfig.json)"
            ) from None
        try:
            doc = yaml.safe_load(raw)
        except (yaml.YAMLError, RecursionError) as e:
            raise KubeconfigError(f"{path}: neither JSON nor YAML ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise KubeconfigError(f"{path}: not a kubeconfig (no mapping at the top)")
    return doc


def _named(doc: dict[str, Any], section: str, name: str, path: str) -> dict[str, Any]:
    for item in doc.get(section) or ():
        if isinstance(item, dict) and item.get("name") == name:
            return item
    raise KubeconfigError(f"{path}: no {section[:-1]} named {name!r}")


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _b64(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        return ""
    try:
        return base64.b64decode(v, validate=True).decode("ascii")
    except (binascii.Error, ValueError, UnicodeDecodeError) as e:
        raise KubeconfigError(f"{path}: inline certificate data is not base64 PEM ({e})") from None
