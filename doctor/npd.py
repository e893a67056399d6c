"""node-problem-detector's one line, and the one-line forms of what can go wrong before a report.

Standard library only, so that the command line can answer NPD (Unknown, exit 2) even when a
heavier module (grpc, psutil) cannot be imported.
"""

from __future__ import annotations

NPD_MAX = 200  # node-problem-detector keeps this much of a custom plugin's message


def one_line(text: str) -> str:
    """Control characters (a newline in a file name) shown escaped: one line stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def npd_error(error: BaseException) -> str:
    """An internal error as NPD's Unknown message: one line, within NPD_MAX."""
    return one_line(f"hami-doctor could not diagnose: {type(error).__name__}: {error}")[:NPD_MAX]


def npd_usage(message: str) -> str:
    """argparse's one line ("hami-doctor: error: argument --x: ..."), as NPD's Unknown message."""
    text = message.strip().removeprefix("hami-doctor: error: ")
    return one_line(f"hami-doctor: usage error: {text}")[:NPD_MAX]
