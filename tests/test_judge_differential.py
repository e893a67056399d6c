"""The device-plugin judge against itself as it was: a change meant to keep its behaviour must keep it.

`tests.judge_before.verdicts` is the judge before its rules were split into rule families; the judge
under test is whatever `sidecar.deviceplugin.verdicts.DevicePluginJudge` is now. Both are driven in
lockstep by the same random but meaningful node (a `World`: a kubelet that restarts, plugins that
restart, crash, hang and register, connections that come and go, a checkpoint and pod-resources that
follow them, or fail to be read), each with its own clocks (the same values), its own recording
listener and evidence built from the same draws with its own module's classes. After every step
everything the judge says is compared: the step's answer, every check whole, the listener's calls and
the log lines since the step before, the wake-ups, and what /status reads. The first difference fails
with the seed, the step, the event and the two outputs.

`python -m tests.test_judge_differential [SEEDS] [STEPS]` prints what the generator reaches: the
checks' reason templates by status, the listener's calls and the log lines (run it under `coverage`
for the judge's lines).
"""

from __future__ import annotations

import logging
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import partial
from operator import attrgetter
from types import ModuleType
from typing import Any

import pytest

import sidecar.deviceplugin.budget as new_budget
import sidecar.deviceplugin.evidence as new_evidence
import sidecar.deviceplugin.verdicts as new_verdicts
from hami_guard.flags import DeviceExpectation, Expect, PluginSpec
from sidecar.deviceplugin.checkpoint import Checkpoint
from sidecar.deviceplugin.hamiconfig import Expectation, Filtered
from sidecar.deviceplugin.probes import ProbeResult, Reading, SocketId
from sidecar.deviceplugin.recovery import RecoveryEvidence
from sidecar.health import Check, Status
from tests.judge_before import verdicts as old_verdicts

SEEDS = 300
STEPS = 400
CHUNKS = 12  # parametrized chunks of SEEDS // CHUNKS seeds: pytest-xdist spreads them
LOGGERS = ("sidecar", "tests.judge_before")  # every logger either judge (and recovery.py) writes to


@dataclass(frozen=True)
class Side:
    """Where one judge's classes come from: the evidence types and the judge itself."""

    name: str
    evidence: ModuleType  # RoundEvidence, PluginEvidence, AfterDeletion, Rules, KubeletRules, NEWEST
    verdicts: ModuleType  # DevicePluginJudge


OLD = Side("old", old_verdicts, old_verdicts)
NEW = Side("new", new_evidence, new_verdicts)


# -- the draws: plain data, turned into each side's own evidence ------------------------------------
@dataclass(frozen=True)
class PluginDraw:
    probe: ProbeResult
    identity_after: SocketId | None
    connections: Reading[int]
    owner: str
    owner_reason: str
    connection_ids: frozenset[int] | None


@dataclass(frozen=True)
class RoundDraw:
    kubelet: ProbeResult
    plugins: tuple[tuple[str, PluginDraw], ...]
    checkpoint: Reading[Checkpoint]
    pod_resources: Reading[dict[str, frozenset[str]]]
    host_devices: int | None
    generation: int | None
    expectation: Expectation | None
    others: tuple[tuple[str, SocketId], ...]
    checkpoint_before: int | None
    kubelet_rules: tuple[str, str, bool] | None  # (version, source, refuses a second Register); None: NEWEST
    recovery: RecoveryEvidence | None  # None: the default (not read)


@dataclass(frozen=True)
class AfterDraw:
    plugin: SocketId | None
    kubelet: SocketId | None
    kubelet_refuses: bool
    listening: bool | None


def build_round(side: Side, d: RoundDraw) -> Any:
    """`d` as `side`'s RoundEvidence, every mutable container copied: neither judge sees the other's."""
    ev = side.evidence
    cp = d.checkpoint.value
    checkpoint = (
        Reading(Checkpoint({r: tuple(ids) for r, ids in cp.registered.items()}, cp.mtime_ns))
        if cp is not None
        else Reading[Checkpoint].failed(d.checkpoint.error)
    )
    pr = d.pod_resources.value
    pod_resources = (
        Reading({r: frozenset(ids) for r, ids in pr.items()})
        if pr is not None
        else Reading[dict[str, frozenset[str]]].failed(d.pod_resources.error)
    )
    plugins = {
        r: ev.PluginEvidence(
            p.probe,
            p.identity_after,
            Reading(p.connections.value, p.connections.error),
            p.owner,
            p.owner_reason,
            frozenset(p.connection_ids) if p.connection_ids is not None else None,
        )
        for r, p in d.plugins
    }
    extra: dict[str, Any] = {}
    if d.kubelet_rules is not None:
        extra["kubelet_rules"] = ev.KubeletRules(*d.kubelet_rules)
    if d.recovery is not None:
        rec = d.recovery
        pods = rec.pod_devices.value
        extra["recovery"] = RecoveryEvidence(
            Reading({r: dict(m) for r, m in pods.items()}, "")
            if pods is not None
            else Reading[dict[str, dict[str, str]]].failed(rec.pod_devices.error),
            rec.driver_uuids,
            rec.device_nodes,
        )
    return ev.RoundEvidence(
        d.kubelet,
        plugins,
        checkpoint,
        pod_resources,
        d.host_devices,
        d.generation,
        expectation=d.expectation,
        others=d.others,
        checkpoint_before=d.checkpoint_before,
        **extra,
    )


def build_after(side: Side, d: AfterDraw) -> Any:
    return side.evidence.AfterDeletion(d.plugin, d.kubelet, d.kubelet_refuses, d.listening)


def build_rules(side: Side, settings: Mapping[str, Any]) -> Any:
    return side.evidence.Rules(**settings)


# -- one side: a judge, its clocks, what it told the wiring and the logs ---------------------------------
class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


_FIELDS: dict[type, attrgetter[Any]] = {}  # each dataclass's fields, as one getter
_CHECK_FIELDS = attrgetter(*(f.name for f in fields(Check)))


def check_fields(check: Check) -> tuple[Any, ...]:
    """Every public field of a check (its properties derive from them, in health.py, shared)."""
    return _CHECK_FIELDS(check)


class Recorder:
    """A listener that keeps every call, with its arguments as they were then."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def take(self) -> list[tuple[Any, ...]]:
        calls, self.calls = self.calls, []
        return calls

    def attempt_opened(self, resource: str) -> None:
        self.calls.append(("attempt_opened", resource))

    def attempt_closed(self, resource: str, latency: float | None) -> None:
        self.calls.append(("attempt_closed", resource, latency))

    def kubelet_restarted(self) -> None:
        self.calls.append(("kubelet_restarted",))

    def transition(self, check: Check, old: Status) -> None:
        self.calls.append(("transition", check_fields(check), old))

    def restart_requested(self, resource: str) -> None:
        self.calls.append(("restart_requested", resource))

    def budget(self, resource: str, spent: bool) -> None:
        self.calls.append(("budget", resource, spent))

    def devices(self, resource: str, counts: Mapping[str, int]) -> None:
        self.calls.append(("devices", resource, dict(counts)))

    def connected(self, resource: str, count: int | None) -> None:
        self.calls.append(("connected", resource, count))

    def recovery(self, resource: str, event: str, count: int) -> None:
        self.calls.append(("recovery", resource, event, count))


class LogTaker(logging.Handler):
    """The log lines since the last take: level and message (the loggers' names differ by side)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))

    def take(self) -> list[tuple[str, str]]:
        lines, self.lines = self.lines, []
        return lines


@contextmanager
def taking_logs() -> Iterator[LogTaker]:
    """Every line the judges' loggers write, at every level, to one taker (and nowhere else meanwhile)."""
    taker = LogTaker()
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        logger.addHandler(taker)
    try:
        yield taker
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(taker)
            logger.setLevel(level)
            logger.propagate = propagate


class Run:
    """One judge driven by the test: its clocks and what it said since the last step."""

    def __init__(
        self,
        side: Side,
        settings: Mapping[str, Any],
        mono: float,
        wall: float,
        wrap: Callable[[Recorder], object] | None = None,
    ) -> None:
        self.side = side
        self.mono, self.wall = Clock(mono), Clock(wall)
        self.recorder = Recorder()
        listener = wrap(self.recorder) if wrap is not None else self.recorder
        self.rules = build_rules(side, settings)
        self.judge = side.verdicts.DevicePluginJudge(self.rules, listener, self.mono, self.wall)
        self._history: tuple[list[tuple[Any, ...]], list[dict[str, Any]]] = ([], [])

    def apply(self, event: Event) -> Any:
        j, k = self.judge, event.kind
        if k == "round":
            assert isinstance(event.arg, RoundDraw)
            return j.round(build_round(self.side, event.arg))
        if k == "created":
            return j.plugin_socket_created(event.resource, event.arg)
        if k == "deleted":
            return j.plugin_socket_deleted(event.resource)
        if k == "vanished":
            assert isinstance(event.arg, AfterDraw)
            return j.judge_vanished(event.resource, build_after(self.side, event.arg), event.window_over)
        if k == "end":
            return j.end_judgement(event.resource)
        if k == "kubelet-deleted":
            return j.kubelet_socket_event("deleted", event.arg)
        if k == "kubelet-created":
            return j.kubelet_socket_event("created", event.arg)
        if k == "folder-gone":
            return j.folder_gone()
        assert k == "tick", k
        return None

    def history(self) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """The registration cycles: every field, and as /status shows them (`as_dict`, a function of the
        fields, asked again of the cycles whose fields changed)."""
        history = self.judge.history
        if not history:
            return [], []
        getter = _FIELDS.get(type(history[0]))
        if getter is None:
            getter = _FIELDS[type(history[0])] = attrgetter(*(f.name for f in fields(history[0])))
        raw = list(map(getter, history))
        if raw != self._history[0]:
            known = dict(zip(*self._history, strict=True))
            self._history = (
                raw,
                [known[r] if r in known else a.as_dict() for r, a in zip(raw, history, strict=True)],
            )
        return self._history

    def outputs(self, answer: Any, logs: LogTaker) -> dict[str, Any]:
        """Everything the judge says after a step, in the order the wiring asks (refresh, then wake_at)."""
        j = self.judge
        out: dict[str, Any] = {"answer": answer}
        out["refresh"] = j.refresh()
        out["wake_at"] = j.wake_at()
        out["checks"] = [(name, check_fields(c)) for name, c in j.state.checks.items()]
        out["verdicts"] = (
            j.state.healthy(),
            j.state.all_ok(),
            sorted(j.state.failed),
            sorted(j.state.not_ok),
        )
        out["registration"] = j.registration()
        out["devices"] = j.devices()
        out["recovery"] = j.recovery()
        out["history"] = self.history()
        out["counters"] = (j.kubelet_restarts, j.generation, j.kubelet_rules.as_dict())
        out["listener"] = self.recorder.take()
        out["logs"] = logs.take()
        return out


@dataclass(frozen=True)
class Event:
    """One step: the clocks, then one call into the judge."""

    # round | created | deleted | vanished | end | kubelet-deleted | kubelet-created | folder-gone | tick
    kind: str
    mono: float
    wall: float
    resource: str = ""
    arg: object = None
    window_over: bool = False

    def __str__(self) -> str:
        what = {
            "round": "round",
            "created": f"plugin_socket_created({self.resource!r}, {self.arg})",
            "deleted": f"plugin_socket_deleted({self.resource!r})",
            "vanished": (
                f"judge_vanished({self.resource!r}, {self.arg}, restart_window_over={self.window_over})"
            ),
            "end": f"end_judgement({self.resource!r})",
            "kubelet-deleted": f"kubelet_socket_event('deleted', {self.arg})",
            "kubelet-created": f"kubelet_socket_event('created', {self.arg})",
            "folder-gone": "folder_gone()",
            "tick": "refresh only",
        }[self.kind]
        detail = f"\n    evidence: {self.arg}" if self.kind == "round" else ""
        return f"{what} at mono={self.mono!r} wall={self.wall!r}{detail}"


class Divergence(AssertionError):
    """The two judges said different things."""

    def __init__(self, seed: int, step: int, event: Event, found: tuple[str, object, object]) -> None:
        key, old, new = found
        self.seed, self.step, self.event, self.key = seed, step, event, key
        super().__init__(
            f"seed {seed}, step {step}: the judges differ in {key}\n  event: {event}\n"
            f"  old: {old!r}\n  new: {new!r}\n"
            f"  (replay: tests.test_judge_differential.run_seeds(range({seed}, {seed + 1}), {STEPS}))"
        )


_CHECK_NAMES = tuple(f.name for f in fields(Check))


def named(out: dict[str, Any]) -> dict[str, Any]:
    """An output with each check's fields by name, for a message that says which check and field."""
    out = dict(out)
    out["checks"] = {name: dict(zip(_CHECK_NAMES, c, strict=True)) for name, c in out["checks"]}
    out["listener"] = [
        (call[0], dict(zip(_CHECK_NAMES, call[1], strict=True)), call[2]) if call[0] == "transition" else call
        for call in out["listener"]
    ]
    return out


def first_difference(a: object, b: object, path: str) -> tuple[str, object, object] | None:
    """Where two outputs first differ: the path to it and both values; None when equal."""
    if a == b and type(a) is type(b):
        return None
    if isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
        for k in a:
            found = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if found is not None:
                return found
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
    return path, a, b


@dataclass(frozen=True)
class Plant:
    """A change planted on the new side, to show the comparison catches it: other settings, a listener
    wrapped, or the judge itself altered once built."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    wrap: Callable[[Recorder], object] | None = None
    alter: Callable[[Any], None] | None = None


class Lockstep:
    """The two judges, the old first, given the same events; compared after each."""

    def __init__(
        self,
        seed: int,
        settings: Mapping[str, Any],
        mono: float,
        wall: float,
        logs: LogTaker,
        *,
        plant: Plant | None = None,
    ) -> None:
        self.seed = seed
        self.logs = logs
        plant = plant or Plant()
        self.old = Run(OLD, settings, mono, wall)
        self.new = Run(NEW, {**settings, **plant.settings}, mono, wall, plant.wrap)
        if plant.alter is not None:
            plant.alter(self.new.judge)
        self.steps = 0
        # Just built, before any event, both must say the same already, and know the same plugins.
        logs.take()
        self.last = self.old.outputs(None, logs)
        outs = (self.last, self.new.outputs(None, logs))
        for out, run in zip(outs, (self.old, self.new), strict=True):
            j = run.judge
            out["plugins"] = [(p, j.plugin(p.socket), j.plugin_for(p.resource)) for p in j.rules.plugins]
            out["plugins"].append(j.plugin("unknown.sock"))
        self._compare(Event("tick", mono, wall), *outs)

    @property
    def judge(self) -> Any:
        """The old judge, whose answers steer the generator (the new one's are the same, or it failed)."""
        return self.old.judge

    def step(self, event: Event) -> Any:
        outs = []
        for run in (self.old, self.new):
            run.mono.now, run.wall.now = event.mono, event.wall
            self.logs.take()
            answer = run.apply(event)
            outs.append(run.outputs(answer, self.logs))
        self._compare(event, outs[0], outs[1])
        self.steps += 1
        self.last = outs[0]
        return outs[0]["answer"]

    def _compare(self, event: Event, old: dict[str, Any], new: dict[str, Any]) -> None:
        for key, value in old.items():
            if first_difference(value, new[key], key) is not None:
                old, new = named(old), named(new)
                found = first_difference(old[key], new[key], key)
                assert found is not None
                raise Divergence(self.seed, self.steps, event, found)


# -- the node: what the generator keeps, and how it moves -------------------------------------------------
GPU_UUIDS = (
    "GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f",
    "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60",
    "GPU-8dac7e20-4b20-6f6e-be6d-2c3d4e5f6071",
)
PLUGIN_SPECS = (PluginSpec("nvidia.com/gpu", "nvidia-gpu.sock"), PluginSpec("example.com/fpga", "fpga.sock"))
KUBELET_INOS = (1, 2, 3)  # kubelet.sock's inodes, reused: identities repeat but for the mtime
CONN_IDS = tuple(range(100, 108))  # the kubelet's connection inodes, reused
MONO0, WALL0 = 1000.0, 1_760_000_000.0
# Clock advances: mostly short, often right around the constants the rules wait on.
SHORT = (0.0, 0.0, 0.0, 0.001, 0.01, 0.05, 0.1, 0.15, 0.3, 0.5, 1.0)
AROUND = (0.19, 0.2, 0.2001, 0.21, 0.25, 1.9, 2.0, 2.01, 2.5, 4.9, 5.0, 5.01, 6.0, 9.9, 10.0, 10.01, 11.0)
LONG = (15.0, 20.0, 30.0, 44.9, 45.0, 45.01, 50.0, 60.0, 61.0, 90.0, 130.0)
PLUGIN_FAULTS = ("timeout", "refused", "error", "wrong-service", "not-socket")


@dataclass
class PluginWorld:
    """One plugin on the node as the generator keeps it."""

    spec: PluginSpec
    inos: tuple[int, ...]  # its socket files' inodes, reused
    devices: tuple[str, ...]  # the physical devices it serves
    style: str  # split | replica | plain: how its device IDs spell them
    ident: SocketId | None = None  # its socket file, where there is one
    state: str = "alive"  # what a probe of the file gets
    listening: bool | None = False  # a listener still bound to its removed file
    conns: list[int] = field(default_factory=list)  # the kubelet's connections to it, oldest first
    unhealthy: set[str] = field(default_factory=set)  # physical devices it reports unhealthy
    owner: str = "unknown"
    alias: str = ""  # serves under this name instead of its own (a renamed resourceName)
    alias_ident: SocketId | None = None
    follows: bool = True  # serves a new socket when kubelet.sock is created (HAMi)
    recorded: SocketId | None = None  # the socket the kubelet recorded a device list from
    dialed: SocketId | None = None  # the socket the kubelet dialed last (a Register)
    restarting: bool = False  # a restart the livenessProbe asked for is under way
    marked: bool = False  # the kubelet marked its devices unhealthy itself (it dropped the plugin)

    def ids(self) -> tuple[str, ...]:
        """The device IDs it lists healthy."""
        out = []
        for i, d in enumerate(self.devices):
            if d in self.unhealthy:
                continue
            if self.style == "split":
                out += [f"{d}-{n}" for n in range(2 + i % 2)]
            elif self.style == "replica":
                out += [f"{d}::{n}" for n in range(2)]
            else:
                out.append(d)
        return tuple(out)


@dataclass
class Config:
    """One seed's settings and leanings."""

    settings: dict[str, Any]
    register: float  # how readily the kubelet records a Register
    fault: float  # how often things go wrong
    conn_modes: tuple[str, ...]  # how the kubelet's connections are read, as the seed leans
    rules: tuple[tuple[str, str, bool] | None, ...]  # the kubelet releases the seed sees


def draw_config(rng: random.Random) -> Config:
    n = 1 if rng.random() < 0.6 else 2
    expect = rng.choice(
        [
            DeviceExpectation(),
            DeviceExpectation(),
            DeviceExpectation.at_least(rng.choice([1, 2, 3, 4, 6])),
            DeviceExpectation(Expect.OFF),
            DeviceExpectation(Expect.AUTO),
            DeviceExpectation(Expect.AUTO),
        ]
    )
    settings: dict[str, Any] = {
        "plugins": PLUGIN_SPECS[:n],
        "grace": rng.choice([10.0, 30.0, 45.0, 45.0, 60.0]),
        "expect_devices": expect,
        "device_glob": "/dev/nvidia[0-9]*",
        "refusal_confirm": rng.choice([10.0, 10.0, 10.0, 3.0]),
        "missed_restart_after": rng.choice([5.0, 5.0, 5.0, 0.0]),
        "recover_unhealthy_after": rng.choice([0.0, 0.0, 5.0, 20.0, 60.0]),
    }
    if rng.random() < 0.15:
        settings["drop_confirm"] = rng.choice([0.1, 0.5])
    if rng.random() < 0.1:
        settings["kubelet_socket"] = "kubelet-x.sock"
    r137, r136 = ("v1.37.2", "the kubelet's binary", True), ("v1.36.5", "the kubelet's binary", False)
    unknown = ("", "the kubelet's binary could not be read in time", True)
    rules = rng.choice([(None,), (r137,), (r136,), (r137, r136), (None, unknown, r137), (r136, r136, None)])
    modes = rng.choice(
        [
            ("ids",),
            ("ids", "ids", "ids", "count", "unreadable"),
            ("count",),
            ("zero-only", "ids"),
            ("unreadable", "ids"),
            ("unreadable",),
        ]
    )
    return Config(settings, rng.choice([0.2, 0.6, 0.9, 0.97]), rng.choice([0.05, 0.15, 0.3]), modes, rules)


class World:
    """A node that evolves: a kubelet, the plugins, the kubelet's records, the folder's events, and what
    the wiring still owes the judge (deleted sockets to look at again)."""

    def __init__(self, rng: random.Random, config: Config) -> None:
        self.rng = rng
        self.config = config
        self.mono, self.wall = MONO0, WALL0 + rng.choice([0.0, 0.123, 0.999])
        self.fs_ns = 1_000_000_000  # the file system's clock
        self.kubelet: SocketId | None = self._new_kubelet(None)
        self.kubelet_state = "alive"
        self.verified = rng.random() > 0.05
        self.rules = rng.choice(config.rules)
        self.checkpoint: dict[str, tuple[str, ...]] | None = {} if rng.random() < 0.5 else None
        self.cp_mtime = self._tick()
        self.cp_error = ""  # the reader's error, "" when it reads
        self.pr_error = "" if rng.random() < 0.8 else "pod-resources socket not mounted"
        self.conn_mode = rng.choice(config.conn_modes)
        self.plugins = [self._plugin(i, spec) for i, spec in enumerate(config.settings["plugins"])]
        self.host = len(GPU_UUIDS)
        self.expectation: Expectation | None = None
        self.strangers: dict[str, SocketId] = {}  # other sockets in the folder, not any plugin's
        self.events: list[tuple[str, str]] = []  # folder events not handled yet: (kind, resource)
        self.follow_ups: list[tuple[str, str]] = []  # (look, resource): first | second
        self.later: list[tuple[float, Callable[[], None]]] = []  # what happens at a time
        self.pods: dict[str, dict[str, str]] | None = {}
        self.driver: frozenset[str] | None = frozenset(GPU_UUIDS)
        self.nodes: int | None = len(GPU_UUIDS)
        self.stale: int | None = None  # a generation a round began with before a restart was seen
        self.last_cp = self.cp_mtime  # the checkpoint's time the last round read

    # -- files -----------------------------------------------------------------------------------
    def _tick(self, most: int = 3_000_000) -> int:
        """The file system's clock, moved on (sometimes not at all: two files within one tick)."""
        self.fs_ns += self.rng.choice([0, 1, 1000, most])
        return self.fs_ns

    def _new_kubelet(self, old: SocketId | None) -> SocketId:
        inos = [i for i in KUBELET_INOS if old is None or i != old.ino] or list(KUBELET_INOS)
        return SocketId(self.rng.choice(inos), self._tick())

    def _new_socket(self, p: PluginWorld) -> SocketId:
        if p.ident is not None and self.rng.random() < 0.04:
            return p.ident  # re-created within one tick, on the same inode: the same identity
        return SocketId(self.rng.choice(p.inos), self._tick())

    def _plugin(self, i: int, spec: PluginSpec) -> PluginWorld:
        rng = self.rng
        if i == 0:
            devices, style = GPU_UUIDS[: rng.choice([1, 2, 3])], rng.choice(["split", "split", "plain"])
        else:
            devices, style = ("fpga-0", "fpga-1"), rng.choice(["plain", "replica"])
        p = PluginWorld(spec, (11 + 4 * i, 12 + 4 * i), devices, style)
        p.follows = rng.random() < 0.85
        if rng.random() < 0.12:
            p.alias = "nvidia-vgpu.sock" if i == 0 else "fpga-x.sock"
            p.alias_ident = SocketId(30 + i, self._tick())
            p.state = "absent"
        elif rng.random() < 0.85:
            p.ident = self._new_socket(p)
        p.listening = p.ident is not None
        return p

    # -- moves ---------------------------------------------------------------------------------------
    def at(self, delay: float, move: Callable[[], None]) -> None:
        self.later.append((self.mono + delay, move))

    def due(self) -> None:
        """The moves whose time came, in their order."""
        now = [m for m in self.later if m[0] <= self.mono]
        self.later = [m for m in self.later if m[0] > self.mono]
        for _, move in sorted(now, key=lambda m: m[0]):
            move()

    def move(self, judge: Any) -> None:
        """One random change of the node, as likely as it is meaningful here."""
        rng, fault = self.rng, self.config.fault
        recovers = 0.3 if self.config.settings["recover_unhealthy_after"] else 0.0
        moves: list[tuple[float, Callable[[], None]]] = [
            (1.0, self.kubelet_acts),
            (0.25 * fault, self.kubelet_restart),
            (0.1 * fault, self.kubelet_blip),
            (0.3 * fault, lambda: self.plugin_fault(rng.choice(self.plugins))),
            (0.15, lambda: self.plugin_restart(rng.choice(self.plugins))),
            (0.3 * fault, lambda: self.plugin_stops(rng.choice(self.plugins))),
            (0.2 * fault + recovers, lambda: self.device_health(rng.choice(self.plugins))),
            (0.2 * fault, self.records_fault),
            (0.1, self.reader_change),
            (0.05, self.host_change),
            (0.05, self.stranger),
            (0.05, self.touch_checkpoint),
        ]
        if not judge.state.healthy():
            # The livenessProbe: the plugin's container restarts (its socket anew).
            moves.append((0.6, lambda: self.liveness_restart(judge)))
        total = sum(w for w, _ in moves)
        pick = rng.random() * total
        for w, m in moves:
            pick -= w
            if pick <= 0:
                m()
                return

    def kubelet_acts(self) -> None:
        """The kubelet's side of registration: dial a served socket, record it, or change its mind."""
        rng = self.rng
        if self.kubelet_state != "alive" or self.kubelet is None:
            return
        p = rng.choice(self.plugins)
        if p.ident is None or p.state != "alive":
            return
        if p.dialed != p.ident or not p.conns:
            if rng.random() < 0.7:  # a Register (again): a connection, then its record
                self._dial(p)
            return
        roll = rng.random()
        if p.recorded != p.ident and roll < self.config.register:
            self.at(rng.choice([0.0, 0.01, 0.5, 3.0, 12.0]), lambda: self._record(p))
        elif roll < 0.2:
            self._dial(p, second=True)  # a second Register on the same socket
        elif roll < 0.5 and len(p.conns) > 1:
            p.conns.remove(rng.choice([p.conns[0], p.conns[-1]]))  # one of them closes
        elif roll < 0.3 + 0.2 * self.config.fault:
            self._drop(p)

    def _dial(self, p: PluginWorld, second: bool = False) -> None:
        free = [c for c in CONN_IDS if all(c not in q.conns for q in self.plugins)]
        if not free:
            return
        rng = self.rng
        if not second:
            p.dialed = p.ident
        conn = rng.choice(free)
        p.conns.append(conn)
        if rng.random() < self.config.register and rng.random() < 0.7:
            self.at(rng.choice([0.0, 0.001, 0.3, 2.0, 11.0]), lambda: self._record(p))
            if second and rng.random() < 0.4:  # up to 1.36: an older stream's end disconnects it
                self.at(rng.choice([1.0, 4.0, 15.0]), partial(self._close, p, conn))
        elif second and rng.random() < 0.3:  # refused: its dial idles out, then the kept stream's
            self.at(rng.choice([12.0, 30.0]), partial(self._close, p, conn))
            self.at(rng.choice([12.0, 30.0, 60.0]), partial(self._close, p, p.conns[0]))

    def _close(self, p: PluginWorld, conn: int) -> None:
        if conn in p.conns:
            p.conns.remove(conn)

    def _record(self, p: PluginWorld) -> None:
        """The kubelet writes the plugin's device list: its checkpoint, and pod-resources' view."""
        if p.ident is None or not p.conns or self.kubelet_state != "alive":
            return
        p.recorded, p.marked = p.ident, False
        self._write_checkpoint(p)

    def _write_checkpoint(self, p: PluginWorld | None = None, drop: str = "") -> None:
        cp = dict(self.checkpoint or {})
        if p is not None:
            cp[p.spec.resource] = p.ids()
        if drop:
            cp.pop(drop, None)
        self.checkpoint = cp
        self.cp_mtime = self._tick(2_000_000)

    def _drop(self, p: PluginWorld) -> None:
        """The kubelet lets go of a plugin that keeps serving: its connections close, and maybe more."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            p.conns.clear()
        elif roll < 0.55 and p.conns:
            p.conns.pop()  # the newest: the one that carried the registration
        elif roll < 0.65 and p.conns:
            p.conns.pop(0)  # the oldest
        elif roll < 0.85:
            p.marked = True  # the kubelet marks its devices unhealthy: pod-resources lists none
            if p.conns and rng.random() < 0.5:
                p.conns.pop(0)
        else:
            self._write_checkpoint(drop=p.spec.resource)  # rewritten without it
            p.recorded = None

    def kubelet_restart(self) -> None:
        """A kubelet restart: the old one stops (its file gone or dead), the new one cleans the folder,
        binds, answers; plugins that follow serve a new socket (or fail to, or miss it)."""
        rng = self.rng
        if self.kubelet_state != "alive":
            return
        for p in self.plugins:
            p.conns.clear()
        if rng.random() < 0.5:
            self.kubelet_state = "refused"  # a dead file first
        else:
            self.kubelet_state, self.kubelet = "absent", None
            self.events.append(("kubelet-deleted", ""))
        if rng.random() < 0.08:
            self.events.append(("folder-gone", ""))
        self.at(rng.choice([0.0, 0.05, 0.5, 3.0]), self._kubelet_cleans)

    def _kubelet_cleans(self) -> None:
        rng = self.rng
        for p in self.plugins:
            if p.ident is not None and rng.random() < 0.9:
                p.ident, p.listening = None, True  # still listening on the unlinked file
                self.events.append(("deleted", p.spec.resource))
        if self.kubelet is not None:
            self.events.append(("kubelet-deleted", ""))
        self.kubelet, self.kubelet_state = None, "absent"
        self.at(rng.choice([0.0, 0.1, 1.0]), self._kubelet_binds)

    def _kubelet_binds(self) -> None:
        rng = self.rng
        self.kubelet = self._new_kubelet(self.kubelet)
        self.kubelet_state = rng.choice(["alive", "alive", "alive", "refused", "error"])
        self.events.append(("kubelet-created", ""))
        if self.kubelet_state != "alive":
            self.at(rng.choice([0.05, 0.5]), self._kubelet_listens)
        if rng.random() < 0.3:  # the new kubelet writes its checkpoint, with or without the old resources
            self.checkpoint = dict(self.checkpoint or {}) if rng.random() < 0.5 else {}
            self.cp_mtime = self._tick()
        if rng.random() < 0.2:
            self.rules = rng.choice(self.config.rules)
        for p in self.plugins:
            p.recorded = None
            if not p.follows:
                continue  # misses the restart
            if p.alias:
                self.at(rng.choice([0.01, 0.2]), partial(self._alias_anew, p))
            elif rng.random() < 0.85:
                self.at(rng.choice([0.0, 0.01, 0.2, 1.0, 6.0]), partial(self._serve_anew, p))
            else:  # a failed start: a socket that comes and goes, and HAMi's retry 30 s later
                self.at(0.05, partial(self._serve_anew, p))
                self.at(rng.choice([0.5, 1.5]), partial(self._stop, p, False))
                self.at(30.0, partial(self._serve_anew, p))

    def _kubelet_listens(self) -> None:
        if self.kubelet is not None:
            self.kubelet_state = "alive"

    def _serve_anew(self, p: PluginWorld) -> None:
        """The plugin serves a new socket file (removing its own first)."""
        if p.ident is not None:
            self.events.append(("deleted", p.spec.resource))
        p.conns.clear()
        p.ident, p.state, p.listening, p.owner = self._new_socket(p), "alive", True, "unknown"
        self.events.append(("created", p.spec.resource))
        if self.rng.random() < 0.3:
            p.unhealthy.clear()  # a restart re-reads every device

    def _alias_anew(self, p: PluginWorld) -> None:
        p.alias_ident = SocketId(p.alias_ident.ino if p.alias_ident else 30, self._tick())

    def _stop(self, p: PluginWorld, listening: bool | None) -> None:
        if p.ident is not None:
            self.events.append(("deleted", p.spec.resource))
        p.ident, p.listening = None, listening
        p.conns.clear()

    def kubelet_blip(self) -> None:
        """A round in which kubelet.sock does not answer as it should, and then does again."""
        if self.kubelet_state != "alive":
            return
        self.kubelet_state = self.rng.choice(["timeout", "timeout", "error", "wrong-service"])
        self.at(self.rng.choice([0.0, 0.3, 3.0, 50.0]), self._kubelet_listens)
        if self.kubelet_state == "timeout" and self.rng.random() < 0.6:  # a starved node: every probe
            for p in self.plugins:
                if p.ident is not None and p.state == "alive":
                    p.state = "timeout"
                    self.at(self.rng.choice([0.0, 0.3, 3.0]), partial(self._heal, p))
        if self.rng.random() < 0.2:
            self.verified = not self.verified

    def plugin_fault(self, p: PluginWorld) -> None:
        if p.ident is None:
            return
        p.state = self.rng.choice(PLUGIN_FAULTS)
        if self.rng.random() < 0.8:
            self.at(self.rng.choice([0.0, 0.1, 0.25, 1.0, 20.0]), lambda: self._heal(p))
        if self.rng.random() < 0.1:
            p.owner = "elsewhere" if p.owner == "unknown" else "unknown"

    def _heal(self, p: PluginWorld) -> None:
        if p.ident is not None:
            p.state = "alive"

    def plugin_restart(self, p: PluginWorld) -> None:
        if p.alias:
            self._alias_anew(p)
        elif p.ident is not None or self.rng.random() < 0.3:
            self._serve_anew(p)

    def liveness_restart(self, judge: Any) -> None:
        failed = judge.state.failed
        for p in self.plugins:
            if not p.restarting and any(name.endswith(":" + p.spec.resource) for name in failed):
                p.restarting = True
                self.at(self.rng.choice([0.0, 1.0, 10.0]), partial(self._restarted, p))

    def _restarted(self, p: PluginWorld) -> None:
        p.restarting = False
        self.plugin_restart(p)

    def plugin_stops(self, p: PluginWorld) -> None:
        """The plugin crashes (its file gone), or someone removes its file while it serves."""
        rng = self.rng
        if p.ident is None:
            return
        self._stop(p, rng.choice([False, False, True, None]))
        if rng.random() < 0.6:
            self.at(rng.choice([0.0, 0.05, 0.3, 5.0, 40.0]), lambda: self._serve_anew(p))

    def device_health(self, p: PluginWorld) -> None:
        """The plugin reports a device unhealthy (an XID), or one back; the kubelet records it."""
        rng = self.rng
        if rng.random() < 0.7:
            p.unhealthy.add(rng.choice(p.devices))
        elif p.unhealthy:
            p.unhealthy.discard(rng.choice(sorted(p.unhealthy)))
        if p.recorded is not None and p.recorded == p.ident and rng.random() < 0.8:
            self._write_checkpoint(p)

    def records_fault(self) -> None:
        """The kubelet's records: pod-resources or the checkpoint unreadable, or read again."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            self.pr_error = "" if self.pr_error else "pod-resources: UNAVAILABLE: connection refused"
        elif roll < 0.5:
            self.cp_error = (
                ""
                if self.cp_error
                else rng.choice(
                    ["the checkpoint is not valid JSON (truncated or corrupt)", "no checkpoint: x"]
                )
            )
        elif roll < 0.6:
            self.checkpoint = None  # no file (yet)
        elif roll < 0.8:
            p = rng.choice(self.plugins)
            self._drop(p)
        else:
            self._write_checkpoint()  # rewritten for another resource

    def reader_change(self) -> None:
        self.conn_mode = self.rng.choice(self.config.conn_modes)

    def host_change(self) -> None:
        rng = self.rng
        self.host = rng.choice([0, 1, 2, 3, 4])
        self.expectation = rng.choice(
            [
                None,
                Expectation(2, 3, ("a", "b"), (Filtered("index 2, GPU-x, /dev/nvidia2", "filterdevices"),)),
                Expectation(1, 0, notes=("no device node",)),
                Expectation(3, 3),
            ]
        )
        held = {f"{d}-0": "default/train" for p in self.plugins for d in sorted(p.unhealthy)[:1]}
        self.pods = rng.choice([None, {}, {}, {"nvidia.com/gpu": held}])
        self.driver = rng.choice([None, frozenset(GPU_UUIDS), frozenset(GPU_UUIDS[1:]), frozenset()])
        self.nodes = rng.choice([None, 3, 1])

    def stranger(self) -> None:
        rng = self.rng
        if self.strangers and rng.random() < 0.5:
            self.strangers.pop(rng.choice(sorted(self.strangers)))
        else:
            self.strangers[rng.choice(["nvidia-mig.sock", "other.sock"])] = SocketId(40, self._tick())

    def touch_checkpoint(self) -> None:
        """The checkpoint's time moves without a write of the kubelet's: a touch, or a clock step back."""
        self.cp_mtime = self._tick() if self.rng.random() < 0.5 else self.cp_mtime - 5_000_000

    # -- what the judge is shown ------------------------------------------------------------------------
    def kubelet_probe(self) -> ProbeResult:
        if self.kubelet is None:
            return ProbeResult("absent", "kubelet.sock does not exist", 0.0)
        s = self.kubelet_state
        if s == "alive":
            return ProbeResult("alive", "serving v1beta1.Registration", 0.002, self.kubelet, self.verified)
        if s == "error" and self.rng.random() < 0.3:
            why = "kubelet.sock was replaced while probed: the kubelet restarts"
            return ProbeResult("error", why, 0.001, self.kubelet)
        return ProbeResult(s, f"{s} on kubelet.sock", 0.5, self.kubelet)  # type: ignore[arg-type]

    def plugin_draw(self, p: PluginWorld) -> PluginDraw:
        rng = self.rng
        sock = p.spec.socket
        if p.ident is None:
            probe = ProbeResult("absent", f"{sock} does not exist: the plugin is not serving", 0.0)
        elif p.state == "alive":
            probe = ProbeResult("alive", "GetDevicePluginOptions answered", 0.003, p.ident)
        else:
            probe = ProbeResult(p.state, f"{p.state} on {sock}", 0.5, p.ident)  # type: ignore[arg-type]
        after = p.ident
        if p.ident is not None and rng.random() < 0.03:
            self._serve_anew(p)  # replaced while probed
            after = p.ident
        mode = self.conn_mode
        n = len(p.conns)
        ids: frozenset[int] | None = None
        if mode == "unreadable" or (mode == "zero-only" and n > 0):
            conns = Reading[int].failed(
                "the kernel's socket table could not be read within 2s"
                if mode == "unreadable"
                else "a count above 0 cannot be trusted without CAP_SYS_PTRACE"
            )
        else:
            conns = Reading(n)
            ids = frozenset(p.conns) if mode == "ids" else None
        owner = p.owner if probe.ok else "unknown"
        reason = "another device plugin (pid 4242) listens on it" if owner == "elsewhere" else ""
        return PluginDraw(probe, after, conns, owner, reason, ids)

    def round_draw(self, generation: int) -> RoundDraw:
        rng = self.rng
        plugins = tuple((p.spec.resource, self.plugin_draw(p)) for p in self.plugins)
        if self.cp_error:
            checkpoint = Reading[Checkpoint].failed(self.cp_error)
        elif self.checkpoint is None:
            checkpoint = Reading[Checkpoint].failed(
                "no checkpoint: the kubelet has not recorded any device plugin"
            )
        else:
            checkpoint = Reading(Checkpoint(dict(self.checkpoint), self.cp_mtime))
        if self.pr_error or self.kubelet_state in ("absent", "refused"):
            pod_resources = Reading[dict[str, frozenset[str]]].failed(
                self.pr_error or "pod-resources: UNAVAILABLE: connection refused"
            )
        else:
            listed = {
                p.spec.resource: frozenset(() if p.marked else p.ids())
                for p in self.plugins
                if p.recorded is not None or p.marked
            }
            pod_resources = Reading(listed)
        others = dict(self.strangers)
        for p in self.plugins:
            if p.alias and p.alias_ident is not None:
                others[p.alias] = p.alias_ident
        shown = () if all(d.probe.state != "absent" for _, d in plugins) else tuple(sorted(others.items()))
        # The checkpoint's time read before the connections: now's, or an older one where the kubelet
        # wrote it while the round read (or none, where there was no file then).
        before = self.cp_mtime if self.checkpoint is not None else None
        if rng.random() < 0.1:
            before = rng.choice([None, self.cp_mtime - 1, self.last_cp])
        self.last_cp = self.cp_mtime
        gen: int | None = generation
        if self.stale is not None and rng.random() < 0.5:
            gen, self.stale = self.stale, None  # begun before the restart the judge has since seen
        elif rng.random() < 0.3:
            gen = None
        expect = self.config.settings["expect_devices"].kind
        recovery = None
        if self.config.settings["recover_unhealthy_after"] > 0:
            pods = Reading(self.pods) if self.pods is not None else Reading.failed("pod-resources List: down")
            driver = (
                Reading(self.driver)
                if self.driver is not None
                else Reading.failed("no /proc/driver/nvidia/gpus")
            )
            recovery = RecoveryEvidence(pods, driver, self.nodes)
        return RoundDraw(
            self.kubelet_probe(),
            plugins,
            checkpoint,
            pod_resources,
            self.host if expect is Expect.AUTO else None,
            gen,
            self.expectation if expect is Expect.AUTO else None,
            shown,
            before,
            self.rules,
            recovery,
        )

    def after_draw(self, p: PluginWorld) -> AfterDraw:
        listening = p.listening if self.rng.random() < 0.85 else None
        return AfterDraw(
            p.ident, self.kubelet, self.kubelet is not None and self.kubelet_state == "refused", listening
        )


def advance(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.6:
        return float(rng.choice(SHORT))
    if roll < 0.9:
        return float(rng.choice(AROUND))
    return float(rng.choice(LONG))


def run_seed(
    seed: int,
    steps: int,
    logs: LogTaker,
    *,
    plant: Plant | None = None,
    seen: Callable[[Any, dict[str, Any]], None] | None = None,
) -> int:
    """Drive both judges through `steps` steps of seed `seed`'s node; the steps taken."""
    rng = random.Random(seed)
    world = World(rng, draw_config(rng))
    pair = Lockstep(seed, world.config.settings, world.mono, world.wall, logs, plant=plant)
    resources = {p.spec.resource: p for p in world.plugins}
    while pair.steps < steps:
        judge = pair.judge
        roll = rng.random()
        # The clock: a random advance, or the moment the wiring would wake up for (wake_at, the grace),
        # as the last step left them.
        if roll < 0.08 and (t := pair.last["wake_at"]) is not None and t > world.mono:
            dt = t - world.mono + rng.choice([0.0, 0.001, 0.001])
        elif roll < 0.12 and (t := pair.last["refresh"]) is not None and t > world.mono:
            dt = t - world.mono + rng.choice([0.0, 0.001])
        else:
            dt = advance(rng)
        world.mono += dt
        world.wall += dt if rng.random() > 0.01 else rng.choice([-3600.0, 0.5])
        world.due()
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            world.move(judge)
        if world.follow_ups and rng.random() < 0.6:
            # watch.py's look at a deleted socket: a first look, a second once the restart window is
            # over if the first says so (other steps may come between: it awaits), then at once the end.
            stage, r = world.follow_ups.pop(0)
            after = world.after_draw(resources[r])
            event = Event("vanished", world.mono, world.wall, r, after, window_over=stage == "second")
            if pair.step(event) and stage == "first":
                world.follow_ups.append(("second", r))
            else:
                pair.step(Event("end", world.mono, world.wall, r))
        elif world.events and rng.random() < 0.7:
            kind, r = world.events.pop(0)
            if rng.random() < 0.03:
                continue  # lost (an overflow)
            if kind == "created":
                pair.step(Event("created", world.mono, world.wall, r, resources[r].ident))
            elif kind == "deleted":
                if pair.step(Event("deleted", world.mono, world.wall, r)):
                    world.follow_ups.append(("first", r))
            elif kind == "folder-gone":
                pair.step(Event("folder-gone", world.mono, world.wall))
            else:
                if rng.random() < 0.3:
                    world.stale = judge.generation  # a round was under way
                pair.step(Event(kind, world.mono, world.wall, arg=world.kubelet))
        elif rng.random() < 0.9:
            draw = world.round_draw(judge.generation)
            for r in pair.step(Event("round", world.mono, world.wall, arg=draw)):
                world.follow_ups.append(("first", r))
        else:
            pair.step(Event("tick", world.mono, world.wall))
        if seen is not None:
            seen(pair.judge, pair.last)
    return pair.steps


def run_seeds(seeds: range, steps: int, **kwargs: Any) -> int:
    with taking_logs() as logs:
        return sum(run_seed(seed, steps, logs, **kwargs) for seed in seeds)


# -- the tests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_the_judge_says_what_it_said_before(chunk: int) -> None:
    per = SEEDS // CHUNKS
    assert run_seeds(range(chunk * per, (chunk + 1) * per), STEPS) > 0


PLANTED_SEEDS = 40  # each planted change is caught well within these (most on the first seed)


def caught(plant: Plant) -> Divergence:
    """The divergence a planted change makes."""
    with pytest.raises(Divergence) as info:
        run_seeds(range(PLANTED_SEEDS), STEPS, plant=plant)
    return info.value


def test_a_changed_drop_confirmation_is_caught() -> None:
    d = caught(Plant(settings={"drop_confirm": 0.25}))
    assert d.key.startswith(("wake_at", "checks", "listener", "answer", "registration")), d


def test_a_changed_restart_budget_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(new_budget, "RESTART_BUDGET", 4)
    caught(Plant())


class DropsConnected:
    """A listener that loses the `connected` calls and passes on the rest."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "connected":
            return lambda resource, count: None
        return getattr(self.inner, name)


def test_a_lost_listener_call_is_caught() -> None:
    d = caught(Plant(wrap=DropsConnected))
    assert d.key.startswith("listener"), d
    assert (d.seed, d.step) == (0, 0), d  # the first round says it


def test_a_changed_time_format_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    iso = new_evidence.iso
    monkeypatch.setattr(new_evidence, "iso", lambda ts: iso(ts).replace("T", " "))
    caught(Plant())


def reworded(judge: Any) -> None:
    """One token changed in the reasons of a drop, a verdict only deep states reach."""
    report = judge.state.report

    def changed(name: str, ok: bool, reason: str = "", *args: Any, **kwargs: Any) -> None:
        report(name, ok, reason.replace("dropped the plugin", "lost the plugin"), *args, **kwargs)

    judge.state.report = changed


def test_a_changed_word_in_a_reason_is_caught() -> None:
    d = caught(Plant(alter=reworded))
    assert d.key.startswith(("checks", "listener")), d
    assert "lost the plugin" in str(d), d


def test_a_divergence_names_the_seed_the_step_the_event_and_both_outputs() -> None:
    d = caught(Plant(settings={"grace": 1234.0}))
    text = str(d)
    assert f"seed {d.seed}, step {d.step}" in text
    assert "event: " in text and "old: " in text and "new: " in text and "replay: " in text


# -- what the generator reaches -----------------------------------------------------------------------
_NUMBERS = re.compile(r"\d[\d.:TZ-]*")


def template(reason: str) -> str:
    """A reason with its numbers, times and device names folded."""
    return _NUMBERS.sub("N", re.sub(r"GPU-[0-9a-f-]+|fpga-\d(::\d)?", "D", reason))


def reach(seeds: int, steps: int) -> None:
    """Print the checks' reason templates by kind and status, the listener's calls and the log lines."""
    reasons: Counter[tuple[str, str, str]] = Counter()
    calls: Counter[str] = Counter()
    lines: Counter[str] = Counter()

    def seen(judge: Any, out: dict[str, Any]) -> None:
        for check in judge.state.checks.values():
            reasons[(check.key.kind.value, check.status.value, template(check.reason))] += 1
        calls.update(c[0] if c[0] != "recovery" else f"recovery:{c[2]}" for c in out["listener"])
        lines.update(f"{level} {template(text)}" for level, text in out["logs"])

    started = time.perf_counter()
    with taking_logs() as logs:
        for seed in range(seeds):
            run_seed(seed, steps, logs, seen=seen)
    print(f"{seeds} seeds x {steps} steps in {time.perf_counter() - started:.1f}s")
    for (kind, status, text), n in sorted(reasons.items()):
        print(f"{n:8d}  {kind:15s} {status:8s} {text[:220]}")
    print("listener:", dict(sorted(calls.items())))
    print("logs:")
    for text, n in sorted(lines.items()):
        print(f"{n:8d}  {text[:200]}")


if __name__ == "__main__":
    reach(int(sys.argv[1]) if len(sys.argv) > 1 else SEEDS, int(sys.argv[2]) if len(sys.argv) > 2 else STEPS)
