"""Text output that survives any locale.

Under `LC_ALL=C` (and no PYTHONUTF8/PYTHONIOENCODING) Python opens stdout and stderr as ASCII with
errors="strict" (or "surrogateescape"): the first `…` or non-ASCII text a command prints raises
UnicodeEncodeError, a traceback instead of the report. The entry points call `tolerate_any_encoding`
first: what the encoding cannot show becomes a `\\u2026`-style escape, while a path's undecodable
bytes (surrogate escapes, as Python decodes argv and file names under such a locale) are written back
as the bytes they were. JSON output is `json.dumps` with its ASCII escapes, valid either way.
"""

from __future__ import annotations

import codecs
import io
import sys

ERRORS = "hami_guard.escape"


def _escape(error: UnicodeError) -> tuple[str | bytes, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    bad = error.object[error.start : error.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
        return bytes(ord(c) - 0xDC00 for c in bad), error.end
    return codecs.backslashreplace_errors(error)


codecs.register_error(ERRORS, _escape)


def tolerate_any_encoding() -> None:
    """Make sys.stdout and sys.stderr escape, rather than raise on, characters they cannot encode."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors in ("strict", "surrogateescape"):
            stream.reconfigure(errors=ERRORS)
