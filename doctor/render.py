"""The report, three ways: a text table for people (80 columns), JSON for machines, one line for NPD.

Reads only the report (`doctor.types.Report`): no I/O, and neither grpc nor psutil is imported
with it, so the command line imports it before it diagnoses.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable

from doctor.npd import NPD_MAX, one_line
from doctor.shell import split_words
from doctor.types import Repair, Report

WIDTH = 80


def as_json(report: Report) -> str:
    """The report's JSON document, indented."""
    return json.dumps(report.as_dict(), indent=2)


def as_text(report: Report, fixing: bool) -> str:
    """A table that reads in 80 columns: one row per cause, problems first with evidence and fixes."""
    problems = report.problems
    if problems:
        lines = [f"hami-doctor: {len(problems)} problem(s) found; the most likely cause first"]
    else:
        lines = ["hami-doctor: no problem found; the kubelet sees the device plugin"]
    lines += ["", f"{'#':>2}  {'CAUSE':<31} {'VERDICT':<8} {'EVIDENCE'}"]
    wrap = textwrap.TextWrapper(
        width=WIDTH,
        initial_indent=" " * 4,
        subsequent_indent=" " * 6,
        break_on_hyphens=False,
    )
    room = WIDTH - 45  # after "NN  CAUSE (31) VERDICT (8) "
    for i, c in enumerate(report.causes, 1):
        verdict = "PROBLEM" if c.verdict == "problem" else c.verdict
        summary = one_line("; ".join(c.evidence))
        if len(summary) > room:
            summary = summary[: room - 1] + "…"
        lines.append(f"{i:>2}  {c.title:<31} {verdict:<8} {summary}".rstrip())
        if c.verdict == "problem":
            lines += [wrap.fill(one_line(line)) for line in c.evidence]
            lines += [
                shell_lines(f[2:]) if f.startswith("$ ") else wrap.fill(one_line("fix: " + f)) for f in c.fix
            ]
    if report.repairs and not fixing:
        lines += ["", "repairs (hami-doctor --fix applies these and nothing else):"]
        for r in report.repairs:
            lines += [wrap.fill(one_line(f"# {r.why}")), shell_lines(r.command)]
    if report.errors:
        lines += ["", "not read (the rows above do without it):"]
        lines += [wrap.fill(one_line(e)) for e in report.errors]
    return "\n".join(lines)


def shell_lines(command: str, indent: int = 6) -> str:
    """A command wrapped at 80 columns with backslashes between its words (never inside a quoted word),
    so that it still pastes into a shell."""
    lines, line = [], ""
    for word in split_words(command):
        if line and indent + len(line) + 1 + len(word) > WIDTH - 2:
            lines.append(line + " \\")
            line = "  " + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(" " * indent + ln for ln in [*lines, line])


def npd_line(report: Report) -> str:
    """node-problem-detector's message: the first line of output, the most likely cause and its evidence."""
    if not report.problems:
        return "hami-doctor: the device plugin is registered"
    c = report.problems[0]
    return one_line(f"{c.title}: {c.evidence[0] if c.evidence else 'problem'}")[:NPD_MAX]


def fix_lines(repairs: Iterable[Repair]) -> list[str]:
    """What --fix did, one line per repair."""
    return [one_line(f"fix: {r.command}: {'done' if r.applied else r.error}") for r in repairs]
