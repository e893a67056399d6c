"""A second `Register` on the plugin's own socket, and a second instance on the same path after the old
one exited: the real sidecar's verdicts against the kubelet's own device manager, at every release.

Two scenarios, TRIALS each per release, on a node of the real-kubelet fixture (tests/realkubelet) with
the real sidecar in process (tests/e2e/realnode.py: probe interval 0.5 s):

- `again`: the kubelet restarted (a clean manager), the plugin registered and the sidecar ready; the
  plugin calls `Register` once more on its own socket while its first stream runs. 1.30 to 1.36
  accept it (a second client replaces the first, whose stream keeps running): the sidecar must keep
  saying registered, ready and live. 1.37 refuses it (`device plugin already connected`) and forgets
  the first client while its stream keeps feeding the devices: expected, readiness fails and liveness
  stays (a plugin restart would be refused too); what the sidecar says is printed.
- `successor`: the registered plugin is killed (its socket removed); once the kubelet has processed
  its stream's end, a new instance binds the same path and registers. Every release accepts it: the
  sidecar must say registered, ready and live.

A trial's verdicts are read from the sidecar's state every 50 ms: liveness from the moment `Register`
returns (`successor`: from SETTLE), registration and readiness from SETTLE seconds after (the drop
confirmation and two rounds) to WINDOW seconds after: REFUSAL_CONFIRM (3 s here, the sidecar's
refusal_confirm, 10 s by default) and 1.5 s, so that a Register wrongly called refused is seen; after
a refused Register (1.37) to REFUSAL_CONFIRM and 5 s, and how long readiness took to fail is printed. A
verdict that differs from the expected one is a wrong verdict; a trial whose truth moved (no stream
open on the plugin, or allocatable short, at the window's end) is counted apart ("truth lost") and
not judged. Printed per release and scenario: trials, Register accepted, wrong
verdicts, truth lost, and what the sidecar said at the window's end.

Run it twice over: with the machine as it is, then loaded by two `go build -a -p 1 std` loops (each
with a throwaway GOCACHE, stopped and removed at the phase's end). Each release runs in a process of
its own, PARALLEL (8) at a time: each mostly waits on its kubelet and its sidecar's rounds.

    python -m bench.second_register                    # every built release, 50 trials, both loads
    TRIALS=10 RELEASES=v1.37.2,v1.30.14 LOAD=loaded SCENARIOS=again python -m bench.second_register
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from testing.realkubelet import VERSIONS, RealPlugin, Release, disconnected_log, fixture_binary, has_pr_135437
from tests.e2e.realnode import RealNode, real_node

TRIALS = int(os.environ.get("TRIALS", "50"))
RELEASES = os.environ.get("RELEASES", "all")
LOAD = os.environ.get("LOAD", "both")  # idle, loaded or both
PARALLEL = int(os.environ.get("PARALLEL", "8"))
SETTLE = 1.2  # the drop confirmation (0.2 s) and two probe rounds (0.5 s each)
# How long a later connection may go unrecorded before the sidecar calls its Register refused (10 s by
# default; shorter here, which only makes a late record on a loaded machine likelier to be misjudged).
REFUSAL_CONFIRM = float(os.environ.get("REFUSAL_CONFIRM", "3.0"))
WINDOW = REFUSAL_CONFIRM + 1.5  # seconds after Register returns that the verdicts are read
REFUSED_WINDOW = REFUSAL_CONFIRM + 5.0  # after a refused one: its confirmation and rounds under load
SCENARIOS = os.environ.get("SCENARIOS", "again,successor").split(",")
POLL = 0.05
GPU = "nvidia.com/gpu"
DEVICES = ("GPU-0", "GPU-1")


@dataclass
class Tally:
    release: str
    scenario: str
    load: str
    trials: int = 0
    accepted: int = 0
    wrong: int = 0
    truth_lost: int = 0
    errors: int = 0
    said: Counter[str] = field(default_factory=Counter)
    # A refused Register: seconds from its answer to the sidecar's first readiness failure.
    told: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def note(self, what: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(what)


def sidecar_says(node: RealNode) -> tuple[bool, bool, bool, str]:
    """(registered ok, live, ready, what it says: the registered check, then each check not ok)."""
    state = node.sidecar.state
    check = state.checks[f"registered:{GPU}"]
    ready = bool(node.sidecar.ready and state.all_ok())
    said = [f"registered {check.status.value}"]
    for c in state.checks.values():
        if c.status.value != "ok":
            said.append(f"{c.key.name} {c.status.value}: {c.reason}")
    return check.status.value == "ok", state.healthy(), ready, "; ".join(said)


async def watch(
    node: RealNode, expect: str, started: float, live_from: float = 0.0, tally: Tally | None = None
) -> tuple[str | None, str]:
    """Read the verdicts until WINDOW after `started` (REFUSED_WINDOW for a refusal); the first
    disagreement (or None), and what the sidecar said at the end. `expect`: "registered" or "refused"
    (readiness fails, liveness stays); liveness is judged from `live_from` seconds on."""
    wrong: str | None = None
    said = ""
    told: float | None = None
    window = REFUSED_WINDOW if expect == "refused" else WINDOW
    while True:
        now = time.monotonic() - started
        registered, live, ready, said = sidecar_says(node)
        if not live and now >= live_from and wrong is None:
            wrong = f"liveness failed at {now:.2f} s ({said})"
        if now >= SETTLE and wrong is None and expect == "registered" and not (registered and ready):
            wrong = f"not registered at {now:.2f} s, ready={ready} ({said})"
        if told is None and not ready:
            told = now
            if tally is not None and expect == "refused":
                tally.told.append(round(now, 2))
        if now >= window:
            break
        await asyncio.sleep(POLL)
    if expect == "refused" and wrong is None and ready:
        wrong = f"ready at the window's end after a refused Register ({said})"
    return wrong, said


async def truth_held(node: RealNode, plugin: RealPlugin) -> bool:
    allocatable = int((await node.kubelet.capacity())["allocatable"].get(GPU, 0))
    return await plugin.streams_open() > 0 and allocatable == len(DEVICES)


async def ready_again(node: RealNode, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not sidecar_says(node)[2]:
        if time.monotonic() > deadline:
            said = sidecar_says(node)[3]
            raise TimeoutError(f"the sidecar not ready {timeout} s after a fresh registration: {said}")
        await asyncio.sleep(POLL)


def short(said: str) -> str:
    """The verdict without what varies from trial to trial (counts, seconds, inodes): each part's
    check and status, and the first words of its reason."""
    parts = []
    for part in said.split("; "):
        head, _, reason = part.partition(": ")
        words = " ".join(reason.split("(")[0].split()[:8])
        parts.append(f"{head}: {words}" if words else head)
    return "; ".join(parts)


async def again(node: RealNode, plugin: RealPlugin, tally: Tally) -> None:
    await node.kubelet.restart()
    mark = plugin.mark()
    if not await plugin.restart():
        why = plugin.last_register_error
        raise RuntimeError(f"a fresh Register after a kubelet restart was refused: {why}")
    await plugin.wait_event("stream-open", after=mark)
    await ready_again(node)
    mark = plugin.mark()
    accepted = await plugin.register()
    started = time.monotonic()
    tally.accepted += accepted
    if accepted:
        await plugin.wait_event("stream-open", after=mark)
    expect = "registered" if accepted else "refused"
    if accepted != (not has_pr_135437(node.release)):
        tally.note(f"Register accepted={accepted}: {plugin.last_register_error}")
    wrong, said = await watch(node, expect, started, tally=tally)
    tally.said[short(said)] += 1
    if expect == "registered" and not await truth_held(node, plugin):
        tally.truth_lost += 1
    elif wrong is not None:
        tally.wrong += 1
        tally.note(wrong)


async def successor(node: RealNode, old: RealPlugin, tally: Tally) -> RealPlugin:
    mark = node.kubelet.mark()
    await old.crash(remove_socket=True)
    await node.kubelet.wait_log(disconnected_log(node.release), after=mark, timeout=10)
    await old.close()
    new = await node.plugin(devices=DEVICES, watch_kubelet=False, register=False)
    mark = new.mark()
    accepted = await new.register()
    started = time.monotonic()
    tally.accepted += accepted
    if not accepted:
        tally.note(f"Register refused: {new.last_register_error}")
        raise RuntimeError(f"the successor's Register was refused: {new.last_register_error}")
    await new.wait_event("stream-open", after=mark)
    # Liveness too from SETTLE on: the old instance's end failed it, rightly, until a round sees the new.
    wrong, said = await watch(node, "registered", started, live_from=SETTLE)
    tally.said[short(said)] += 1
    if not await truth_held(node, new):
        tally.truth_lost += 1
    elif wrong is not None:
        tally.wrong += 1
        tally.note(wrong)
    return new


async def run_release(release: Release, trials: int, load: str) -> list[Tally]:
    root = tempfile.mkdtemp(prefix="hg-sr-")
    dp_dir = os.path.join(root, "device-plugins")
    os.mkdir(dp_dir, 0o750)
    tallies = []
    try:
        for scenario in SCENARIOS:
            tally = Tally(release, scenario, load)
            started = time.monotonic()
            async with real_node(dp_dir, root, release, refusal_confirm=REFUSAL_CONFIRM) as node:
                plugin = await node.plugin(devices=DEVICES, watch_kubelet=False)
                await ready_again(node)
                for _ in range(trials):
                    tally.trials += 1
                    try:
                        if scenario == "again":
                            await again(node, plugin, tally)
                        else:
                            plugin = await successor(node, plugin, tally)
                    except Exception as e:  # a fixture that failed: counted, never a verdict
                        tally.errors += 1
                        tally.note(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        break
                    except BaseException as e:  # pytest.fail from the tests' helpers
                        if isinstance(e, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                            raise
                        tally.errors += 1
                        tally.note(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        break
            tally.seconds = time.monotonic() - started
            tallies.append(tally)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tallies


class Load:
    """Two `go build -a -p 1 std` loops, each with a throwaway GOCACHE: two cores' worth of compiling,
    stopped (process group killed) and removed when the phase ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.caches: list[str] = []

    def __enter__(self) -> Load:
        go = shutil.which("go") or "/usr/local/go/bin/go"
        for _ in range(2):
            cache = tempfile.mkdtemp(prefix="hg-load-gocache-")
            self.caches.append(cache)
            env = dict(os.environ, GOCACHE=cache, GOFLAGS="")
            loop = f"while :; do '{go}' build -a -p 1 std >/dev/null 2>&1; done"
            self.procs.append(subprocess.Popen(["sh", "-c", loop], env=env, start_new_session=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for cache in self.caches:
            shutil.rmtree(cache, ignore_errors=True)


def releases() -> list[str]:
    names = list(VERSIONS) if RELEASES == "all" else [r.strip() for r in RELEASES.split(",") if r.strip()]
    missing = [r for r in names if fixture_binary(r) is None]
    for r in missing:
        print(f"{r}: the fixture is not built (make kubelet-fixtures-all), skipped", file=sys.stderr)
    return [r for r in names if r not in missing]


def phase(names: list[str], load: str) -> tuple[list[dict[str, Any]], list[float]]:
    """Every release in a child process, PARALLEL at a time; their tallies, and the load averages seen."""
    results: list[dict[str, Any]] = []
    loads: list[float] = []
    pending = list(names)
    running: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Any] = {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            r = pending.pop(0)
            argv = [sys.executable, "-m", "bench.second_register", "--child", r, str(TRIALS), load]
            # The sidecars' logs (every transition) go to a file, printed when the child fails.
            logs[r] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed once the child is read)
            running[r] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=logs[r], text=True)
        time.sleep(1)
        loads.append(os.getloadavg()[0])
        for r, p in list(running.items()):
            if p.poll() is None:
                continue
            out = p.stdout.read() if p.stdout else ""
            del running[r]
            lines = [line for line in out.splitlines() if line.startswith("{")]
            log = logs.pop(r)
            if p.returncode != 0 or not lines:
                log.seek(0)
                tail = log.read()[-3000:]
                print(f"{r} ({load}): the child exited {p.returncode}:\n{tail}", file=sys.stderr)
                continue
            log.close()
            results.extend(json.loads(lines[-1])["tallies"])
    return results, loads


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        release, trials, load = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        tallies = asyncio.run(run_release(release, trials, load))  # type: ignore[arg-type]
        print(json.dumps({"tallies": [{**vars(t), "said": dict(t.said)} for t in tallies]}))
        return
    names = releases()
    loads = ["idle", "loaded"] if LOAD == "both" else [LOAD]
    print(f"{TRIALS} trials per release and scenario; releases {', '.join(names)}; {PARALLEL} at a time")
    rows: list[dict[str, Any]] = []
    for load in loads:
        started = time.monotonic()
        if load == "loaded":
            with Load():
                found, seen = phase(names, load)
        else:
            found, seen = phase(names, load)
        rows += found
        print(
            f"{load}: {time.monotonic() - started:.0f} s, load average {min(seen, default=0):.1f} to "
            f"{max(seen, default=0):.1f}",
            flush=True,
        )
    print()
    columns = ("release", "scenario", "load", "trials", "accepted", "wrong verdicts", "truth lost", "errors")
    print("| " + " | ".join((*columns, "the sidecar said at the window's end")) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for t in sorted(rows, key=lambda t: (VERSIONS.index(t["release"]), t["scenario"], t["load"])):
        said = "; ".join(f"{n}x {s}" for s, n in Counter(t["said"]).most_common())
        keys = ("release", "scenario", "load", "trials", "accepted", "wrong", "truth_lost", "errors")
        cells = [t[k] for k in keys]
        print("| " + " | ".join(str(c) for c in (*cells, said)) + " |")
    for t in rows:
        told = sorted(t["told"])
        if told:
            mid = told[len(told) // 2]
            print(
                f"{t['release']} {t['scenario']} {t['load']}: readiness failed {mid:.2f} s (median) after "
                f"the refused Register, {told[0]:.2f} to {told[-1]:.2f} s, in {len(told)} of {t['trials']}"
            )
        for e in t["examples"]:
            print(f"{t['release']} {t['scenario']} {t['load']}: {e}")


if __name__ == "__main__":
    main()
