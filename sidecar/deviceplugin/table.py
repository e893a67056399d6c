"""The kernel's socket table, read on a thread of its own, and the cheap look between rounds.

The rounds' reads of the table (`sidecar.deviceplugin.watch`) go through `TableThread` one at a time;
between them the thread looks at the kubelet's connections itself (`Look`): by inode where the last
round could tell them apart (`gone_by_diag`, `gone_from`), else the whole table, spaced by its cost
(docs/design.md#between-rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from hami_guard.node.netunix import listed_inodes
from hami_guard.node.unixdiag import DiagUnavailable, diag_alive

T = TypeVar("T")
logger = logging.getLogger(__name__)
SWITCH = 0.0002  # seconds: the GIL's switch interval while the socket table is read
# Between rounds, where the last round's connections cannot be asked for one by one, the whole socket
# table (a /proc file of the whole namespace) is read at most this share of a core's time: every
# connection interval where a read costs 1 ms or less (a node's few hundred sockets), less often where
# it costs more (100,000 sockets: a few hundred ms, every few minutes).
FULL_READ_SHARE = 0.001
# A look by inode is spaced at least this many times the last whole read's duration.
LOOK_SPACING = 20


@dataclass(frozen=True)
class Look:
    """What the table's thread checks between rounds: `moved()` says whether the kubelet's connections to
    the plugins it holds differ from the last round's; `whole`: it reads the whole table (spaced by
    that read's cost), not the last round's connections by inode."""

    moved: Callable[[], bool]
    whole: bool
    then: Callable[[], object]  # called (on the thread) once `moved()` said so; the look then ends


_WAKE = "wake"  # a look was set: the thread's wait is cut short to take it


class TableThread:
    """The kernel's socket table, read on a thread of its own, one read at a time.

    A host's namespace may hold 100,000 sockets: a read then takes a few hundred ms, which on the
    event loop would hold every /healthz answer that long. A read that does not end (a stuck file
    read) holds this thread only: a round waits for it within its timeout, the next rounds start
    none while it runs, and shutdown does not wait for it (a daemon thread).

    Between the rounds' reads the thread looks at the kubelet's connections itself (`watch`) every
    `every` seconds: the event loop hears of it only when they moved, so a look costs the read alone,
    not a hand-over to the loop and back each second.
    """

    def __init__(self, name: str = "hami-sidecar-socket-table", every: float = 1.0) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], object], Future[object], Future[None]] | str | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running: Future[object] | None = None
        self._since = 0.0
        self.last_read = 0.0  # seconds the last read that ended took
        self.every = every
        self._lock = threading.Lock()  # the look and when it is due, set by the loop and by this thread
        self._look: Look | None = None
        self._look_at = 0.0  # monotonic: when the look is due

    def watch(self, look: Look | None) -> None:
        """Look with `look` from now on (None: no look), the first time `every` seconds from now."""
        with self._lock:
            self._look, self._look_at = look, time.monotonic() + self._spacing(look)
        self._jobs.put(_WAKE)

    def _spacing(self, look: Look | None) -> float:
        if look is None:
            return self.every
        if look.whole:
            return max(self.every, self.last_read / FULL_READ_SHARE)
        return max(self.every, LOOK_SPACING * self.last_read)

    def start(self) -> None:
        self._thread.start()

    def close(self, wait: float = 0.5) -> None:
        """End the thread once its read (if any) is over; wait for that `wait` seconds at most. A look
        under way says nothing after this."""
        with self._lock:
            self._look = None
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(wait)
            if self._thread.is_alive():
                logger.warning("the socket table's read has not ended: the sidecar stops without it")

    async def read(self, read: Callable[[], T], timeout: float) -> T | str:
        """`read()` on the thread, within `timeout`; or why it gave nothing (never an older read's answer:
        while one runs past its round, later rounds read nothing)."""
        if self._running is not None and not self._running.done():
            return (
                f"the kernel's socket table is still being read (for {time.monotonic() - self._since:.1f}s): "
                "the kubelet's connections are not known this round"
            )
        if not self._thread.is_alive():
            return "the socket table's reader is not running"
        job: Future[object] = Future()
        taken: Future[None] = Future()  # the thread took the job (after a look under way, if any)
        self._running, self._since = job, time.monotonic()
        self._jobs.put((read, job, taken))
        try:
            # The timeout counts from then: a look's read is waited for, not taken from the round's.
            async with asyncio.timeout(timeout):
                await asyncio.shield(asyncio.wrap_future(taken))
            async with asyncio.timeout(timeout):
                result = await asyncio.shield(asyncio.wrap_future(job))
        except TimeoutError:
            return f"the kernel's socket table could not be read within {timeout:g}s"
        return result  # type: ignore[return-value]  # what `read` returned

    def _run(self) -> None:
        while True:
            with self._lock:
                look, due = self._look, self._look_at
            try:
                wait = None if look is None else max(0.0, due - time.monotonic())
                job = self._jobs.get(timeout=wait)
            except queue.Empty:
                self._take_look(look)
                continue
            if job is None:
                return
            if isinstance(job, str):  # _WAKE
                continue
            read, done, taken = job
            taken.set_result(None)
            started = time.monotonic()
            try:
                with short_switch():
                    done.set_result(read())
            except BaseException as e:  # handed to the round, which logs it
                done.set_exception(e)
            finally:
                self.last_read = time.monotonic() - started

    def _take_look(self, look: Look | None) -> None:
        if look is None or look is not self._look:
            return
        started = time.monotonic()
        moved = False
        try:
            with short_switch():
                moved = look.moved()
        except Exception:  # a look never ends the thread: the next round reads again
            logger.exception("looking at the kubelet's connections between rounds failed")
        if look.whole:
            self.last_read = time.monotonic() - started
        with self._lock:
            if look is not self._look:
                return  # another look was set meanwhile (or none, at close): it stands
            if moved:
                self._look = None  # the round it asks for sets the next look
            else:
                self._look_at = time.monotonic() + self._spacing(look)
        if moved:
            look.then()


@contextlib.contextmanager
def short_switch() -> Iterator[None]:
    """While the table is read, the loop thread waits for the GIL at most SWITCH seconds at a time, not
    the default 5 ms: an HTTP answer takes the GIL a few times, and a table read holds it for hundreds
    of ms in all."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, SWITCH))
    try:
        yield
    finally:
        sys.setswitchinterval(switch)


def gone_from(tables: tuple[str, ...], ids: frozenset[int]) -> bool:
    """Is one of `ids` missing from the socket inodes these /proc tables list? False where one cannot be
    read."""
    try:
        listed = frozenset[int]().union(*(listed_inodes(t) for t in tables))
    except OSError:
        return False
    return not ids <= listed


def gone_by_diag(ids: frozenset[int]) -> bool:
    """Is one of the connections `ids` closed (sock_diag, one request each)? False where it cannot be
    told."""
    try:
        return frozenset(diag_alive(ids)) != ids
    except DiagUnavailable:
        return False
