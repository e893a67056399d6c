"""A hostile node: a C locale, signal storms, FIFOs where files belong, a huge checkpoint.

Real processes; every wait and loop is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testing import free_port
from tests.test_serving import _sidecar_argv as sidecar_argv
from tests.test_sidecar_cli import CLEAN_ENV, get, stop, wait_serving

# Python's own defaults under a C locale: ASCII, no UTF-8 mode, no encoding override.
C_LOCALE = {
    **{k: v for k, v in CLEAN_ENV.items() if k not in ("PYTHONIOENCODING", "LANG", "LANGUAGE")},
    "LC_ALL": "C",
    "PYTHONUTF8": "0",
}
UTF8_LOCALE = {**C_LOCALE, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}


def _run(module: str, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, env=env, timeout=120, check=False
    )


@pytest.mark.parametrize("output", ["text", "json", "npd"])
def test_the_doctor_writes_under_a_c_locale(output: str, short_tmp: str) -> None:
    """Its text has `…` and the paths it names may be non-ASCII: escaped, never a traceback."""
    root = os.path.join(short_tmp, "nœud")
    argv = ["--device-plugin-dir", os.path.join(root, "device-plugins")]
    argv += ["--npd"] if output == "npd" else ["--output", output]
    c = _run("doctor", argv, C_LOCALE)
    utf8 = _run("doctor", argv, UTF8_LOCALE)
    assert b"Traceback" not in c.stderr, c.stderr.decode(errors="replace")
    assert c.returncode == utf8.returncode
    assert c.returncode in (0, 1, 2, 3)
    c.stdout.replace(root.encode(), b"").decode("ascii")  # escapes, but a path's own bytes
    if output == "json":
        assert json.loads(c.stdout)["exit_code"] == c.returncode
    if output == "text":
        assert "\\u2026" in c.stdout.decode() or "…" not in utf8.stdout.decode()


def test_initcheck_writes_under_a_c_locale(short_tmp: str) -> None:
    folder = os.path.join(short_tmp, "plugins-é")
    os.mkdir(folder)
    c = _run("initcheck", ["--device-plugin-dir", folder], C_LOCALE)
    utf8 = _run("initcheck", ["--device-plugin-dir", folder], UTF8_LOCALE)
    assert b"Traceback" not in c.stdout + c.stderr
    assert c.returncode == utf8.returncode
    assert b"plugins-" in c.stdout  # one_line escapes the path's undecodable bytes itself


def test_the_sidecar_logs_under_a_c_locale(short_tmp: str) -> None:
    """A bad configuration naming a non-ASCII value: its line and logs escape it; still exit 2."""
    port = free_port()
    proc = subprocess.Popen(
        sidecar_argv(short_tmp, port, "--probe-timeout", "bientôt…"),
        env=C_LOCALE,
        stderr=subprocess.PIPE,
        text=True,
        errors="strict",
        encoding="ascii",
    )
    try:
        wait_serving(proc, port)
        assert get(port, "/healthz") == (200, "ok")
    finally:
        code, err = stop(proc)
    assert "Traceback" not in err
    assert "Logging error" not in err
    assert "--probe-timeout: expected seconds, got 'bient" in err
    assert code == 2
