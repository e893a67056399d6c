"""hami-doctor's command line: settings, evidence, causes, repairs, one of three outputs, exit code.

Never a traceback: a usage error is one line (with --npd, NPD's Unknown line on stdout), and an
internal error is one line in every output, exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from doctor import render
from doctor.npd import npd_error, npd_usage, one_line
from doctor.settings import DoctorSettings, parse_settings
from doctor.types import Report
from hami_guard.console import tolerate_any_encoding
from hami_guard.envflags import env_name

USAGE = 2


def diagnose(settings: DoctorSettings) -> Report:
    """Gather the evidence, judge it, plan the repairs and, with --fix, apply them.

    The modules that need grpc and psutil are imported here, so that a broken installation is an
    internal error the command line reports in one line, not a traceback at import.
    """
    # After the flags: a broken grpc or psutil is an internal error said in one line, not a traceback.
    from doctor import causes, evidence, repairs  # noqa: PLC0415

    found = asyncio.run(evidence.gather(settings))
    planned = repairs.plan(found)
    return Report(
        causes.diagnose(found),
        repairs.apply(planned) if settings.fix else planned,
        found.kubelet,
        found.errors,
    )


def wants_npd(argv: Sequence[str], environ: dict[str, str] | os._Environ[str]) -> bool:
    """--npd as the parser would read it, before the parser runs (a usage error must answer NPD too)."""
    if "--npd" in argv:
        return True
    return environ.get(env_name("--npd"), "").lower() in ("1", "true", "yes", "on")


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run hami-doctor with `argv` (the process's when None), print to `out`; the exit code."""
    out = out or sys.stdout
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_npd(argv, os.environ):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                settings = parse_settings(argv)
        except SystemExit as e:
            if e.code in (0, None):
                raise
            print(npd_usage(err.getvalue().splitlines()[0] if err.getvalue() else "bad flags"), file=out)
            return USAGE
    else:
        settings = parse_settings(argv)
    try:
        report = diagnose(settings)
    except Exception as e:  # an internal error is one line in every output, never a traceback
        if settings.npd:
            print(npd_error(e), file=out)
        elif settings.output == "json":
            print(
                json.dumps({"healthy": None, "exit_code": USAGE, "error": f"{type(e).__name__}: {e}"}),
                file=out,
            )
        else:
            print(
                f"hami-doctor: could not diagnose: {type(e).__name__}: {one_line(str(e))}",
                file=sys.stderr,
            )
        return USAGE
    if settings.fix:
        to = out if not settings.npd and settings.output == "text" else sys.stderr
        for line in render.fix_lines(report.repairs):
            print(line, file=to)
    if settings.npd:
        print(render.npd_line(report), file=out)
    elif settings.output == "json":
        print(render.as_json(report), file=out)
    else:
        print(render.as_text(report, settings.fix), file=out)
    return report.exit_code


def run() -> None:
    """Console-script entry point."""
    tolerate_any_encoding()
    raise SystemExit(main())
