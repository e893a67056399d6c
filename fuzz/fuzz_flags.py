"""Fuzz flag and HAMI_GUARD_* variable parsing of the three programs, and the value types they share.

Typed results only: hami-sidecar's read_settings gives Settings or BadConfig (or exits 0 for
--help); hami-initcheck's and hami-doctor's parsers give a namespace or exit 2 with exactly one line
on stderr (or 0 for --help); a value type returns or raises argparse.ArgumentTypeError. Anything
else escapes.

Input: NUL-separated fields. The first field picks the program; then arguments, until a field
`=`, after which fields alternate a variable's name suffix (HAMI_GUARD_ is prefixed) and its value.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable
from typing import Any

from doctor.settings import parse_settings as doctor_settings
from hami_guard import flags
from hami_guard.envflags import PREFIX, parse_with_env
from initcheck.cli import build_parser as initcheck_parser
from sidecar.config import BadConfig, Settings, read_settings

_TYPES: list[Callable[[str], Any]] = [
    flags.seconds(flags.MIN_PERIOD, flags.DAY),
    flags.duration(0, 30 * flags.DAY),
    flags.integer(0, 1000),
    flags.number(0.0, 1.0),
    flags.numeric_id,
    flags.octal,
    flags.plugin_spec,
    flags.expect_devices,
    flags.listen_address,
]


def _split(data: bytes) -> tuple[int, list[str], dict[str, str]]:
    text = data.decode("utf-8", "surrogateescape")
    fields = text.split("\0")
    pick = ord(fields[0][0]) if fields[0] else 0
    argv, env, rest = [], {}, fields[1:]
    if "=" in rest:
        at = rest.index("=")
        argv, pairs = rest[:at], rest[at + 1 :]
        for name, value in zip(pairs[::2], pairs[1::2], strict=False):
            env[PREFIX + name] = value
    else:
        argv = rest
    return pick, argv, env


def _exits_cleanly(run: Callable[[], object]) -> None:
    """A parser's run: a result, or exit 0 (help) or 2 with one line on stderr."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except SystemExit as e:
        if e.code == 0:
            return
        if e.code != 2:
            raise AssertionError(f"exit {e.code!r}") from e
        lines = err.getvalue().splitlines()
        if len(lines) != 1 or "error: " not in lines[0]:
            raise AssertionError(f"not one line: {err.getvalue()!r}") from e


def TestOneInput(data: bytes) -> None:
    pick, argv, env = _split(data)
    which = pick % 4
    if which == 0:
        result: object = None
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                result = read_settings(argv, env)
        except SystemExit as e:
            if e.code != 0:  # only --help (or an abbreviation of it) exits
                raise AssertionError(f"read_settings exited {e.code!r}: {err.getvalue()!r}") from e
            return
        if not isinstance(result, Settings | BadConfig):
            raise AssertionError(f"read_settings gave {result!r}")
        if isinstance(result, BadConfig) and ("\n" in result.error or not 0 <= result.port <= 65535):
            raise AssertionError(f"a bad configuration read as {result!r}")
    elif which == 1:
        _exits_cleanly(lambda: parse_with_env(initcheck_parser(), argv, env))
    elif which == 2:
        _exits_cleanly(lambda: doctor_settings(argv, env))
    else:
        value = argv[0] if argv else ""
        for parse in _TYPES:
            with contextlib.suppress(argparse.ArgumentTypeError):
                parse(value)
