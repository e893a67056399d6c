"""`make fuzz`: each harness fuzz/fuzz_<name>.py under atheris (coverage-guided, libFuzzer), in a process
of its own.

    python -m fuzz.run [--seconds N] [--crashes DIR] [NAME ...]     (FUZZ_SECONDS=N: the same as --seconds)

A harness is a file fuzz/fuzz_<name>.py with `def TestOneInput(data: bytes) -> None` that lets every
exception escape; its seed corpus is fuzz/corpus/<name>/ (read, never written: what the fuzzer finds goes
to a temporary folder). Each harness runs for N seconds and fails on:

- any exception that escapes TestOneInput;
- any input slower than 100 ms: the thread's CPU time, which other load on the machine does not inflate,
  in each of three tries (libFuzzer's own -timeout counts whole seconds of wall time: it is kept, at
  10 s, for an input that hangs);
- a crash of the process itself (libFuzzer's memory limit, a signal).

The input that failed is saved to DIR (default fuzz/crashes/) as <name>-crash-<sha1>. Turn it into a
regression test: fix the parser, then copy the input into fuzz/corpus/<name>/, which tests/test_fuzz.py
replays through every harness on each `make test`. The runner prints the inputs each harness executed and
exits 1 when any harness failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parent
SLOW_SECONDS = 0.1
TRIES = 3
HANG_SECONDS = 10

Harness = Callable[[bytes], None]


class SlowInput(Exception):
    """An input the harness took longer than SLOW_SECONDS of CPU time over, in each of TRIES tries."""


def timed(
    test: Harness, limit: float = SLOW_SECONDS, clock: Callable[[], float] = time.thread_time
) -> Harness:
    """`test`, failing an input that takes more than `limit` of `clock` every time of TRIES.

    A first slow run is tried again: a garbage collection or a cold cache is not the input's cost.
    """

    def run(data: bytes) -> None:
        took: list[float] = []
        for _ in range(TRIES):
            started, wall = clock(), time.perf_counter()
            test(data)
            took.append(clock() - started)
            if took[-1] <= limit:
                return
        raise SlowInput(
            f"{len(data)}-byte input: {min(took) * 1000:.0f} ms of CPU at best of {TRIES} tries, over the "
            f"{limit * 1000:.0f} ms bound (the last try took {(time.perf_counter() - wall) * 1000:.0f} ms "
            "of wall time)"
        )

    return run


def harnesses(folder: Path = FOLDER) -> list[Path]:
    return sorted(folder.glob("fuzz_*.py"))


def name_of(path: Path) -> str:
    return path.stem.removeprefix("fuzz_")


def load(path: Path) -> ModuleType:
    """A harness module, imported from its file (whatever folder it is in)."""
    spec = importlib.util.spec_from_file_location(f"fuzz_harness_{name_of(path)}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "TestOneInput", None)):
        raise ImportError(f"{path} has no TestOneInput(data: bytes)")
    return module


def child(path: Path, seconds: int, crashes: Path, found: Path) -> None:
    """In the harness's own process: instrument what it imports, then fuzz until the time is up. What the
    fuzzer adds to the corpus goes to `found`, never to the seeds."""
    import atheris  # noqa: PLC0415  # in the child only: it instruments what is imported after it

    with atheris.instrument_imports():
        module = load(path)
    seeds = path.parent / "corpus" / name_of(path)
    argv = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        f"-timeout={HANG_SECONDS}",
        f"-artifact_prefix={crashes}/{name_of(path)}-",
        "-print_final_stats=1",
        str(found),
        *([str(seeds)] if seeds.is_dir() else []),
    ]
    atheris.Setup(argv, timed(module.TestOneInput))
    atheris.Fuzz()


@dataclass
class Outcome:
    name: str
    code: int
    executed: int
    seconds: float
    cpu: float  # seconds of CPU the harness's process used: what other load on the machine does not take
    crash: str  # the saved input, "" when none
    output: str

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.crash


def fuzz_one(path: Path, seconds: int, crashes: Path) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"hg-fuzz-{name_of(path)}-") as found:
        return _fuzz_one(path, seconds, crashes, found)


def _fuzz_one(path: Path, seconds: int, crashes: Path, found: str) -> Outcome:
    argv = [sys.executable, "-m", "fuzz.run", "--child", str(path), "--seconds", str(seconds)]
    argv += ["--crashes", str(crashes), "--found", found]
    started, cpu = time.monotonic(), _children_cpu()
    try:
        done = subprocess.run(
            argv,
            cwd=FOLDER.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=seconds + HANG_SECONDS + 120,
            check=False,
        )
        code, output = done.returncode, done.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, bytes) else b""
        code, output = -1, out.decode(errors="replace") + "\n(the harness did not stop in time: killed)"
    took, cpu = time.monotonic() - started, _children_cpu() - cpu
    executed = re.findall(r"stat::number_of_executed_units:\s*(\d+)", output) or re.findall(
        r"^#(\d+)\s", output, re.MULTILINE
    )
    crash = re.findall(r"Test unit written to (\S+)", output)
    return Outcome(
        name_of(path),
        code,
        int(executed[-1]) if executed else 0,
        took,
        cpu,
        crash[-1] if crash else "",
        output,
    )


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def report(o: Outcome) -> str:
    rate = o.executed / o.cpu if o.cpu else 0.0
    head = (
        f"{o.name:<16} {o.executed:>10} inputs in {o.seconds:4.0f} s ({o.cpu:4.0f} s of CPU: {rate:5.0f}/s)"
    )
    if o.ok:
        return f"{head}  ok"
    why = "an escaping exception or a slow input" if o.crash else f"the process ended with status {o.code}"
    lines = [f"{head}  FAILED: {why}"]
    if o.crash:
        lines.append(f"  the input: {o.crash}")
    noise = re.compile(r"^(INFO:|WARNING: Failed to find function|#\d+\s)")
    tail = [line for line in o.output.splitlines() if line.strip() and not noise.match(line)][-30:]
    lines += ["  " + line for line in tail]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="harnesses to run (fuzz_<name>.py), default: all")
    p.add_argument("--seconds", type=int, default=int(os.environ.get("FUZZ_SECONDS") or 60))
    p.add_argument("--crashes", type=Path, default=FOLDER / "crashes")
    p.add_argument("--folder", type=Path, default=FOLDER, help="where the harnesses are")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--found", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seconds < 1:
        p.error("--seconds must be at least 1")
    crashes = args.crashes.resolve()
    crashes.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        child(args.child.resolve(), args.seconds, crashes, args.found or Path(tempfile.mkdtemp()))
        return 0
    paths = [h for h in harnesses(args.folder.resolve()) if not args.names or name_of(h) in args.names]
    missing = set(args.names) - {name_of(h) for h in paths}
    if missing or not paths:
        p.error(f"no harness fuzz/fuzz_<name>.py for {', '.join(sorted(missing)) or 'any name'}")
    print(
        f"fuzzing {len(paths)} harness(es), {args.seconds} s each; failed inputs go to {crashes}", flush=True
    )
    outcomes = []
    for path in paths:
        outcomes.append(fuzz_one(path, args.seconds, crashes))
        print(report(outcomes[-1]), flush=True)
    failed = [o.name for o in outcomes if not o.ok]
    print(
        f"fuzz: {len(outcomes) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
