"""Grace and transitions with an injected clock: no sleeping."""

from __future__ import annotations

from sidecar.health import NO_RESTART, Check, HealthState, Status


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(state: HealthState) -> Status:
    return state.checks["registered:x"].status


def make(grace: float = 60.0) -> tuple[HealthState, FakeClock, list[tuple[str, Status, Status]]]:
    clock = FakeClock()
    seen: list[tuple[str, Status, Status]] = []
    state = HealthState(grace, clock, clock, lambda c, old: seen.append((c.name, old, c.status)))
    state.add("registered:x")
    return state, clock, seen


def test_a_check_that_never_passed_is_pending_until_the_grace_runs_out() -> None:
    state, clock, seen = make()
    state.report("registered:x", False, "no evidence")
    assert status(state) is Status.PENDING
    assert state.healthy()
    clock.now += 59.9
    assert state.refresh() == 1060.0
    assert status(state) is Status.PENDING
    clock.now += 0.2
    assert state.refresh() is None
    check: Check = state.checks["registered:x"]
    assert check.status is Status.FAILED
    assert check.reason == "no evidence"
    assert check.since == clock.now
    assert not state.healthy()
    assert state.healthy(exclude=["registered:x"])
    assert seen == [("registered:x", Status.PENDING, Status.FAILED)]


def test_a_check_that_passed_fails_at_once() -> None:
    state, _, seen = make()
    state.report("registered:x", True, "ok")
    state.report("registered:x", False, "gone")
    assert status(state) is Status.FAILED
    assert seen == [("registered:x", Status.PENDING, Status.OK), ("registered:x", Status.OK, Status.FAILED)]


def test_a_reset_turns_a_failure_pending_and_restarts_the_grace() -> None:
    state, clock, _ = make(grace=10)
    state.report("registered:x", True)
    state.report("registered:x", False, "kubelet restarted")
    clock.now += 100
    state.reset(["registered:x"])
    assert status(state) is Status.PENDING
    assert state.grace_left(state.checks["registered:x"]) == 10
    clock.now += 10
    state.refresh()
    assert status(state) is Status.FAILED


def test_check_up_values_and_marks() -> None:
    assert [s.up for s in Status] == [1.0, 0.0, 0.5]
    assert [s.mark for s in Status] == ["+", "-", "~"]


def test_never_probed_check_fails_after_the_grace_with_a_reason() -> None:
    state, clock, _ = make(grace=1)
    clock.now += 2
    state.refresh()
    assert status(state) is Status.FAILED
    assert "no probe answered" in state.checks["registered:x"].reason


def test_a_failure_that_restarts_nothing_says_why_and_only_while_it_restarts_nothing() -> None:
    state, _, _ = make()
    check = state.checks["registered:x"]
    state.report("registered:x", False, "gone", definitive=True, restarts=False)
    assert (check.mark, check.no_restart) == ("!", NO_RESTART)
    state.report("registered:x", False, "gone", definitive=True, restarts=False, quiet="plugin:x asks for it")
    assert check.no_restart == "plugin:x asks for it"
    state.report("registered:x", False, "gone", definitive=True, quiet="ignored: this one restarts")
    assert (check.mark, check.quiet, state.healthy()) == ("-", "", False)
