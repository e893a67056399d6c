"""The socket table's thread: the rounds' reads, and its own looks between them (`TableThread`).

A look runs on that thread every interval and says only whether the kubelet's connections moved; the
event loop hears of it once, and no more until the next round sets a look again.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from sidecar.deviceplugin.table import Look, TableThread


@pytest.fixture
def table() -> Iterator[TableThread]:
    t = TableThread(every=0.05)
    t.start()
    yield t
    t.close(wait=5)


def test_a_look_runs_every_interval_until_it_sees_a_move(table: TableThread) -> None:
    calls: list[float] = []
    woke = threading.Event()

    def moved() -> bool:
        calls.append(time.monotonic())
        return len(calls) == 3

    table.watch(Look(moved, False, woke.set))
    assert woke.wait(5)
    time.sleep(0.3)
    assert len(calls) == 3, "a look that saw a move ends: the round it asks for sets the next one"
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(calls)), calls  # never faster
    table.watch(Look(moved, False, woke.set))
    time.sleep(0.3)
    assert len(calls) > 3, "a new look runs"


def test_a_look_that_raises_keeps_looking(table: TableThread) -> None:
    calls: list[int] = []

    def moved() -> bool:
        calls.append(1)
        raise OSError("the table cannot be read")

    table.watch(Look(moved, False, lambda: None))
    time.sleep(0.4)
    assert len(calls) >= 2
    assert table._thread.is_alive()


def test_no_word_from_a_look_after_close() -> None:
    t = TableThread(every=0.01)
    t.start()
    looking, release, woke = threading.Event(), threading.Event(), threading.Event()

    def moved() -> bool:
        looking.set()
        release.wait(5)
        return True

    t.watch(Look(moved, False, woke.set))
    assert looking.wait(5)
    closer = threading.Thread(target=t.close, kwargs={"wait": 5})
    closer.start()
    time.sleep(0.05)
    release.set()
    closer.join(10)
    assert not t._thread.is_alive()
    assert not woke.is_set(), "the sidecar stops: a look under way says nothing"


async def test_a_round_waits_for_a_look_under_way_not_within_its_own_timeout(table: TableThread) -> None:
    """The round's timeout counts from when the thread takes its read: a look of 0.3 s and a read of
    0.3 s both fit a timeout of 0.45 s."""
    looking = threading.Event()

    def moved() -> bool:
        looking.set()
        time.sleep(0.3)
        return False

    table.watch(Look(moved, False, lambda: None))
    assert await asyncio.to_thread(looking.wait, 5)
    table.watch(None)

    def read() -> str:
        time.sleep(0.3)
        return "the table"

    assert await table.read(read, timeout=0.45) == "the table"
