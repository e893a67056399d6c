"""Environment variable twins of flags: `--probe-interval` <-> `HAMI_GUARD_PROBE_INTERVAL`. A flag wins."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

PREFIX = "HAMI_GUARD_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(option: str) -> str:
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def parse_with_env(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse argv; each flag not given takes its HAMI_GUARD_* variable, checked like the flag itself."""
    environ = os.environ if environ is None else environ
    appended: dict[str, object] = {}
    for action in parser._actions:
        long = next(
            (o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")), None
        )
        if long is None or action.dest == "help":
            continue
        var = env_name(long)
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            value = _convert(action, raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{var}={raw!r}: {e}")
        if isinstance(action, argparse._AppendAction):
            appended[action.dest] = value  # a default list would be appended to, not replaced
        else:
            parser.set_defaults(**{action.dest: value})
    args = parser.parse_args(argv)
    for dest, value in appended.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return args


def _convert(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError("expected true or false")
    convert = action.type if callable(action.type) else str
    if isinstance(action, argparse._AppendAction):
        return [_checked(action, convert(item.strip())) for item in raw.replace(",", " ").split()]
    return _checked(action, convert(raw))


def _checked(action: argparse.Action, value: object) -> object:
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value
