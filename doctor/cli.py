"""hami-doctor's command line: settings, evidence, causes, repairs, one of three outputs, exit code."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import TextIO

from doctor import causes, evidence, render, repairs
from doctor.settings import DoctorSettings, parse_settings


def diagnose(settings: DoctorSettings) -> render.Report:
    """Gather the evidence, judge it, plan the repairs and, with --fix, apply them."""
    found = asyncio.run(evidence.gather(settings))
    planned = repairs.plan(found)
    return render.Report(
        causes.diagnose(found),
        repairs.apply(planned) if settings.fix else planned,
        found.kubelet,
    )


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    try:
        report = diagnose(settings)
    except Exception as e:  # an internal error is NPD's Unknown, never a traceback
        if settings.npd:
            print(render.npd_error(e), file=out)
            return 2
        raise
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
    raise SystemExit(main())
