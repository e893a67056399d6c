"""hami-initcheck: check kubelet.sock before the device plugin starts; exit 0, 100 (with the fix) or 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TextIO

from hami_guard import flags
from hami_guard.console import tolerate_any_encoding
from hami_guard.envflags import parse_with_env
from hami_guard.flags import one_line
from hami_guard.node.sockets import DEFAULT_DIR, DEFAULT_KUBELET_PROCESS, DEFAULT_SOCKET
from initcheck import exitcodes
from initcheck.checks import Finding, Options, options_for, run_checks

POLL_SECONDS = 0.1  # --wait polls at this period: a starting kubelet is seen within 100 ms
# Failures that a starting kubelet clears by itself: --wait waits these out.
TRANSIENT = {"DIR_MISSING", "SOCKET_MISSING", "STALE_SOCKET"}


class Terminated(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = flags.Parser(
        prog="hami-initcheck",
        description="Check the kubelet's registration socket before a device plugin starts. "
        "Every flag has a HAMI_GUARD_<FLAG> environment variable twin; a flag wins.",
        epilog="exit codes: 0 all checks passed, 100 a check failed, 2 usage error",
        parents=[
            flags.socket_flags(device_plugin_dir=DEFAULT_DIR, kubelet_socket=DEFAULT_SOCKET),
            flags.identity_flags(),
            flags.kubelet_process_flag(kubelet_process_name=DEFAULT_KUBELET_PROCESS),
        ],
    )
    p.add_argument(
        "--wait",
        type=flags.seconds(0.0, flags.DAY),
        default=0.0,
        help="wait up to N s for the kubelet to listen (default 0: no wait)",
    )
    p.add_argument("--connect", action=argparse.BooleanOptionalAction, default=True, help="try a connect()")
    p.add_argument("--strict", action="store_true", help="a world-writable socket fails instead of warning")
    p.add_argument("--output", choices=("text", "json"), default="text")
    return p


def options_from(args: argparse.Namespace, proc: str = "/proc") -> Options:
    return options_for(
        os.path.join(args.device_plugin_dir, args.kubelet_socket),
        plugin_uid=args.plugin_uid,
        plugin_gid=args.plugin_gid,
        expect_owner=args.expect_owner,
        expect_group=args.expect_group,
        expect_mode=args.expect_mode,
        connect=args.connect,
        strict=args.strict,
        kubelet_process=args.kubelet_process_name,
        proc=proc,
    )


def check_with_wait(
    options: Options, wait: float, on_round: Callable[[list[Finding]], object] | None = None
) -> list[Finding]:
    """Run the checks; while the only failures are TRANSIENT ones, run them again until `wait` is over.

    `on_round` sees each round's findings (tests count rounds instead of sleeping).
    """
    deadline = time.monotonic() + wait
    while True:
        findings = run_checks(options)
        if on_round is not None:
            on_round(findings)
        failed = {f.id for f in findings if f.status == "fail"}
        if not failed or not failed <= TRANSIENT or time.monotonic() >= deadline:
            return findings
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, proc: str = "/proc") -> int:
    """hami-initcheck; `proc` is where the process table is read (a test gives one of its own)."""
    out = out or sys.stdout
    args = parse_with_env(build_parser(), sys.argv[1:] if argv is None else argv)
    options = options_from(args, proc)

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        findings = check_with_wait(options, args.wait)
    except Terminated as e:
        print(f"fail: {e} while waiting for {options.socket_path}; the plugin was not started", file=out)
        return exitcodes.FAILED
    except Exception as e:  # a bug must not break the 0/100/2 contract: refuse, in one line
        print(
            f"fail: INTERNAL_ERROR {options.socket_path}: {type(e).__name__}: {one_line(str(e))}; fix: "
            "report this as a hami-guard bug",
            file=out,
        )
        return exitcodes.FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = exitcodes.FAILED if any(f.status == "fail" for f in findings) else exitcodes.OK
    if args.output == "json":
        import json  # noqa: PLC0415  # only for --output json: initcheck's start-up is its cost

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
            print(one_line(line), file=out)
        elif f.status == "skip" and f.id == "PATH_MISMATCH":
            print(one_line(f"note: {f.id} skipped: {f.found}"), file=out)
        for ignored in f.ignored:  # processes of a kubelet's name that are not the kubelet
            print(one_line(f"note: {f.id} ignored: {ignored}"), file=out)
    if code == exitcodes.OK:
        passed = sum(f.status == "pass" for f in findings)
        print(one_line(f"ok: {options.socket_path}: {passed} checks passed"), file=out)


def run() -> None:
    """Console-script entry point."""
    tolerate_any_encoding()
    try:
        code = main()
    except KeyboardInterrupt:  # SIGINT before main's handler: one line, not a traceback
        print("fail: SIGINT before the checks ran; the plugin was not started")
        code = exitcodes.FAILED
    raise SystemExit(code)
