"""hami-initcheck: check kubelet.sock before the device plugin starts; exit 0, 100 (with the fix) or 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import TextIO

from initcheck import exitcodes
from initcheck.checks import DEFAULT_DIR, DEFAULT_SOCKET, Finding, Options, run_checks
from initcheck.envflags import parse_with_env

POLL_SECONDS = 0.1  # --wait polls at this period (the spec allows up to 250 ms)
# Failures that a starting kubelet clears by itself: --wait waits these out.
TRANSIENT = {"DIR_MISSING", "SOCKET_MISSING", "STALE_SOCKET"}


class Terminated(Exception):
    pass


def _octal(value: str) -> int:
    try:
        mode = int(value, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {value!r}") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"mode out of range: {value!r}")
    return mode


def _id(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a numeric id, got {value!r}")
    return int(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 <= seconds < 86400:
        raise argparse.ArgumentTypeError(f"out of range: {value!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hami-initcheck",
        description="Check the kubelet's registration socket before a device plugin starts. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin; a flag wins.",
        epilog="exit codes: 0 all checks passed, 100 a check failed, 2 usage error",
    )
    p.add_argument("--kubelet-socket", default=DEFAULT_SOCKET, help="socket name in the folder, or a path")
    p.add_argument("--device-plugin-dir", default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    p.add_argument("--plugin-uid", type=_id, help="uid the plugin runs as (default: this process's)")
    p.add_argument("--plugin-gid", type=_id, help="gid the plugin runs as (default: this process's)")
    p.add_argument("--expect-owner", type=_id, help="fail unless the socket is owned by this uid")
    p.add_argument("--expect-group", type=_id, help="fail unless the socket's group is this gid")
    p.add_argument("--expect-mode", type=_octal, help="fail unless the socket's mode is this (octal)")
    p.add_argument("--wait", type=_seconds, default=0.0, help="wait up to N s for the kubelet to listen")
    p.add_argument("--connect", action=argparse.BooleanOptionalAction, default=True, help="try a connect()")
    p.add_argument("--strict", action="store_true", help="a world-writable socket fails instead of warning")
    p.add_argument("--kubelet-process-name", default="kubelet", help="process name of the kubelet")
    p.add_argument("--output", choices=("text", "json"), default="text")
    return p


def options_from(args: argparse.Namespace) -> Options:
    path = os.path.join(args.device_plugin_dir, args.kubelet_socket)
    own_identity = args.plugin_uid is None and args.plugin_gid is None
    return Options(
        socket_path=os.path.abspath(path),
        plugin_uid=os.geteuid() if args.plugin_uid is None else args.plugin_uid,
        plugin_gid=os.getegid() if args.plugin_gid is None else args.plugin_gid,
        plugin_groups=tuple(os.getgroups()) if own_identity else (),
        expect_owner=args.expect_owner,
        expect_group=args.expect_group,
        expect_mode=args.expect_mode,
        connect=args.connect,
        strict=args.strict,
        kubelet_process=args.kubelet_process_name,
    )


def check_with_wait(options: Options, wait: float) -> list[Finding]:
    deadline = time.monotonic() + wait
    while True:
        findings = run_checks(options)
        failed = {f.id for f in findings if f.status == "fail"}
        if not failed or not failed <= TRANSIENT or time.monotonic() >= deadline:
            return findings
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = parse_with_env(build_parser(), sys.argv[1:] if argv is None else argv)
    options = options_from(args)

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise Terminated(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        findings = check_with_wait(options, args.wait)
    except Terminated as e:
        print(f"fail: {e} while waiting for {options.socket_path}; the plugin was not started", file=out)
        return exitcodes.FAILED
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = exitcodes.FAILED if any(f.status == "fail" for f in findings) else exitcodes.OK
    if args.output == "json":
        import json

        doc = {
            "ok": code == exitcodes.OK,
            "exit_code": code,
            "kubelet_socket": options.socket_path,
            "checks": [f.as_dict() for f in findings],
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        print_text(findings, options, code, out)
    return code


def print_text(findings: list[Finding], options: Options, code: int, out: TextIO) -> None:
    for f in findings:
        if f.status in ("fail", "warn"):
            line = f"{f.status}: {f.id} {f.path}: found {f.found}"
            if f.expected:
                line += f"; expected {f.expected}"
            if f.remedy:
                line += f"; fix: {f.remedy}"
            print(line, file=out)
        elif f.status == "skip" and f.id == "PATH_MISMATCH":
            print(f"note: {f.id} skipped: {f.found}", file=out)
    if code == exitcodes.OK:
        passed = sum(f.status == "pass" for f in findings)
        print(f"ok: {options.socket_path}: {passed} checks passed", file=out)


def run() -> None:
    """Console-script entry point."""
    raise SystemExit(main())
