"""The API server's credentials read from files (`--kube-token-file`, `--kube-ca-file`, a kubeconfig and
its `tokenFile`, `certificate-authority`, `client-certificate`): a FIFO, a device or a folder in their
place is a clear error at once, never an open or a read that waits for a writer (the doctor would hang
for good, the sidecar's event loop would stop)."""

from __future__ import annotations

import json
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from sidecar.kube.access import ApiAccess, KubeconfigError, NotRegularFile, from_kubeconfig
from sidecar.kube.client import MAX_TOKEN, _token, ssl_context

T = TypeVar("T")
BOUND = 30.0  # far more than any of these takes; past it, the call waits for a writer that never comes


def promptly(call: Callable[[], T], fifo: str) -> T:
    """`call()`'s result or exception, from a thread; a test failure if it is still blocked after BOUND
    seconds (it waits on `fifo`: a writer is then opened and closed to let the thread go)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # handed to the test
            err.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BOUND)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader sees EOF
        worker.join(BOUND)
        pytest.fail(f"blocked on the FIFO {fifo} for {BOUND:g}s")
    if err:
        raise err[0]
    return out[0]


@pytest.fixture
def fifo(tmp_path: Path) -> str:
    path = str(tmp_path / "token")
    os.mkfifo(path)
    return path


def kubeconfig(tmp_path: Path, cluster: dict[str, str], user: dict[str, str]) -> str:
    doc = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", **cluster}}],
        "users": [{"name": "u", "user": user}],
    }
    path = tmp_path / "kubeconfig.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_fifo_token_file_is_an_error_not_a_hang(fifo: str) -> None:
    token, why = promptly(lambda: _token(ApiAccess("https://127.0.0.1:6443", token_file=fifo)), fifo)
    assert (token, why) == ("", f"no ServiceAccount token ({fifo}: a named pipe, not a regular file)")


def test_a_device_or_a_folder_is_no_token(tmp_path: Path) -> None:
    for path, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a folder")):
        assert _token(ApiAccess("https://x", token_file=path)) == (
            "",
            f"no ServiceAccount token ({path}: {kind}, not a regular file)",
        )


def test_a_regular_token_file_is_read_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(" t0ken\n")
    assert _token(ApiAccess("https://x", token_file=str(path))) == ("t0ken", "")
    path.write_text("x" * (MAX_TOKEN + 1))
    assert _token(ApiAccess("https://x", token_file=str(path)))[1].endswith(f": over {MAX_TOKEN} bytes)")


def test_a_fifo_ca_file_is_an_error_not_a_hang(fifo: str) -> None:
    with pytest.raises(NotRegularFile, match="a named pipe, not a regular file"):
        promptly(lambda: ssl_context(ApiAccess("https://x", ca_file=fifo)), fifo)


def test_a_kubeconfig_that_is_a_fifo_is_an_error_not_a_hang(fifo: str) -> None:
    with pytest.raises(KubeconfigError, match="a named pipe, not a regular file"):
        promptly(lambda: from_kubeconfig(fifo), fifo)


def test_a_kubeconfigs_files_that_are_fifos_are_errors_not_hangs(tmp_path: Path, fifo: str) -> None:
    """The doctor's --kubeconfig: its tokenFile, its certificate-authority, its client-certificate."""
    access = from_kubeconfig(kubeconfig(tmp_path, {}, {"tokenFile": fifo}))
    assert access.token_file == fifo
    assert promptly(lambda: _token(access), fifo)[1].endswith("a named pipe, not a regular file)")
    access = from_kubeconfig(kubeconfig(tmp_path, {"certificate-authority": fifo}, {"token": "t"}))
    with pytest.raises(NotRegularFile):
        promptly(lambda: ssl_context(access), fifo)
    access = from_kubeconfig(kubeconfig(tmp_path, {}, {"client-certificate": fifo, "client-key": fifo}))
    with pytest.raises(NotRegularFile):
        promptly(lambda: ssl_context(access), fifo)


def test_a_regular_ca_file_is_still_the_trust(tmp_path: Path) -> None:
    """A CA bundle with comments that are not ASCII (as some distributions' bundles have) is read."""
    bundle = ssl.get_default_verify_paths().cafile or ""
    if not bundle or not os.path.isfile(bundle):
        pytest.skip("no CA bundle on this machine")
    with open(bundle, "rb") as f:
        pem = f.read()
    path = tmp_path / "ca.crt"
    path.write_bytes("# Autorité de certification\n".encode() + pem)
    ctx = ssl_context(ApiAccess("https://x", ca_file=str(path)))
    assert ctx.cert_store_stats()["x509_ca"] > 0
