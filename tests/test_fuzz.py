"""The fuzz harnesses (fuzz/fuzz_<name>.py) and their runner (fuzz/run.py, `make fuzz`).

Every seed of every harness is replayed here without the fuzzer: an input a fuzz run found, once fixed and
copied into fuzz/corpus/<name>/, is a regression test of each `make test`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fuzz.run import FOLDER, SlowInput, harnesses, load, name_of, timed

REPO = FOLDER.parent


@pytest.mark.parametrize("path", harnesses(), ids=name_of)
def test_every_harness_passes_its_seed_corpus(path: Path) -> None:
    seeds = sorted((FOLDER / "corpus" / name_of(path)).glob("*"))
    assert seeds, f"{path.name} has no seed corpus in fuzz/corpus/{name_of(path)}/"
    test = load(path).TestOneInput
    for seed in seeds:
        test(seed.read_bytes())  # any exception fails this test, naming the seed in its traceback


def clock_of(costs: list[float]) -> tuple[Callable[[], float], Callable[[bytes], None]]:
    """A clock and a harness that advances it by the next of `costs` on each call."""
    now = [0.0]

    def test(data: bytes) -> None:
        now[0] += costs.pop(0)

    return lambda: now[0], test


def test_an_input_is_slow_only_when_every_try_is() -> None:
    clock, test = clock_of([0.5, 0.05])  # a first slow run (a collection, a cold cache), then fast
    timed(test, 0.1, clock)(b"x")
    clock, test = clock_of([0.2, 0.15, 0.11])
    with pytest.raises(SlowInput, match="1-byte input: 110 ms of CPU at best of 3 tries"):
        timed(test, 0.1, clock)(b"x")
    clock, test = clock_of([0.1])  # at the bound is not over it
    timed(test, 0.1, clock)(b"x")


HARNESSES = {
    "fuzz_boom.py": 'def TestOneInput(data: bytes) -> None:\n    if data.startswith(b"boom"):\n'
    '        raise ValueError("boom")\n',
    "fuzz_fine.py": "def TestOneInput(data: bytes) -> None:\n    pass\n",
    "fuzz_unasked.py": "raise ImportError('a harness not asked for is not even imported')\n",
    # Burns 150 ms of CPU on the seed: over the bound whatever else runs on the machine.
    "fuzz_slow.py": "import time\n\n\ndef TestOneInput(data: bytes) -> None:\n"
    '    if data.startswith(b"slow"):\n        end = time.thread_time() + 0.15\n'
    "        while time.thread_time() < end:\n            pass\n",
}


def test_the_runner_fails_on_an_exception_or_a_slow_input_and_saves_the_input(tmp_path: Path) -> None:
    for name, text in HARNESSES.items():
        (tmp_path / name).write_text(text)
    for name, seed in (("boom", b"boom!"), ("slow", b"slow"), ("fine", b"anything")):
        (tmp_path / "corpus" / name).mkdir(parents=True)
        (tmp_path / "corpus" / name / "seed").write_bytes(seed)
    crashes = tmp_path / "crashes"
    argv = [sys.executable, "-m", "fuzz.run", "--folder", str(tmp_path), "--crashes", str(crashes)]
    done = subprocess.run(
        [*argv, "--seconds", "1", "boom", "fine", "slow"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "fuzz: 1 passed, 2 failed: boom, slow"
    (fine,) = [line for line in lines if line.startswith("fine ")]
    assert fine.endswith("  ok") and int(fine.split()[1]) > 0  # inputs executed
    assert "ValueError: boom" in done.stdout
    assert "SlowInput: 4-byte input: " in done.stdout
    assert "unasked" not in done.stdout
    saved = {p.name.split("-crash-")[0]: p.read_bytes() for p in crashes.iterdir()}
    assert saved == {"boom": b"boom!", "slow": b"slow"}
    # The seeds are read, never written: what the fuzzer found went elsewhere.
    assert sorted(os.listdir(tmp_path / "corpus" / "fine")) == ["seed"]
    done = subprocess.run([*argv, "nope"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "no harness fuzz/fuzz_<name>.py for nope" in done.stderr
