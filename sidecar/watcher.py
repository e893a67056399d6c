"""Folder watching: watchdog's observer thread hands filtered events to the asyncio loop.

Only creations, deletions, moves and finished writes are asked for. Opens and
read-only closes are left out on purpose: the sidecar reads the checkpoint in
this folder, and reacting to its own reads would make it spin (docs/design.md#events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from watchdog import events as we
from watchdog.observers.inotify import InotifyObserver
from watchdog.observers.polling import PollingObserver

logger = logging.getLogger(__name__)

Kind = Literal["created", "deleted", "written", "folder-gone"]
WatchMode = Literal["auto", "inotify", "polling"]


class InotifyUnavailable(OSError):
    """`--watch-mode inotify`, and no inotify instance or watch to be had (the per-user limits)."""


@dataclass(frozen=True)
class FsEvent:
    kind: Kind
    name: str  # a name inside the folder; "" for folder-gone


_INOTIFY_EVENTS: list[type[we.FileSystemEvent]] = [
    we.FileCreatedEvent,
    we.FileDeletedEvent,
    we.FileMovedEvent,
    we.FileClosedEvent,  # IN_CLOSE_WRITE: a write is complete
    we.DirCreatedEvent,
    we.DirDeletedEvent,
    we.DirMovedEvent,
]
# The polling observer compares stat snapshots: it reports writes as modifications.
_POLLING_EVENTS = [*_INOTIFY_EVENTS, we.FileModifiedEvent]


class FolderWatcher:
    """Watches one folder, not recursively; `on_event` runs on the loop."""

    def __init__(
        self,
        folder: str,
        on_event: Callable[[FsEvent], None],
        loop: asyncio.AbstractEventLoop,
        mode: WatchMode = "auto",
        polling_interval: float = 1.0,
    ) -> None:
        self.folder = os.path.abspath(folder)
        self._on_event = on_event
        self._loop = loop
        self._mode = mode
        self._polling_interval = polling_interval
        self._observer: Any = None
        self.active_mode: Literal["inotify", "polling", "none"] = "none"

    def start(self) -> bool:
        """Start watching; False when the folder cannot be watched now (missing, not a folder)."""
        self.stop()
        if not os.path.isdir(self.folder):
            return False
        handler = _Forwarder(self)
        if self._mode in ("auto", "inotify"):
            observer: Any = None
            try:
                observer = InotifyObserver()  # opens the inotify instance: may fail here
                observer.schedule(handler, self.folder, recursive=False, event_filter=_INOTIFY_EVENTS)
                observer.start()
            except OSError as e:
                if observer is not None:
                    _stop_quietly(observer)
                if self._mode == "inotify":
                    raise InotifyUnavailable(e.errno, f"inotify: {e.strerror or e}") from e
                logger.warning(
                    "inotify unavailable (%s); polling the folder every %gs", e, self._polling_interval
                )
            else:
                self._observer, self.active_mode = observer, "inotify"
                return True
        observer = PollingObserver(timeout=self._polling_interval)
        try:
            observer.schedule(handler, self.folder, recursive=False, event_filter=_POLLING_EVENTS)
            observer.start()
        except OSError as e:
            _stop_quietly(observer)
            logger.warning("cannot watch %s: %s", self.folder, e)
            return False
        self._observer, self.active_mode = observer, "polling"
        return True

    def stop(self) -> None:
        if self._observer is not None:
            _stop_quietly(self._observer)
            self._observer = None
        self.active_mode = "none"

    def _emit(self, event: FsEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
            self._loop.call_soon_threadsafe(self._on_event, event)


def _stop_quietly(observer: Any) -> None:
    try:
        observer.stop()
        if observer.is_alive():
            observer.join(timeout=2)
    except (OSError, RuntimeError):
        pass


class _Forwarder(we.FileSystemEventHandler):
    def __init__(self, watcher: FolderWatcher) -> None:
        self._w = watcher

    def dispatch(self, event: we.FileSystemEvent) -> None:
        folder = self._w.folder
        src = os.fsdecode(event.src_path)
        if src == folder:
            if event.event_type in (we.EVENT_TYPE_DELETED, we.EVENT_TYPE_MOVED):
                self._w._emit(FsEvent("folder-gone", ""))
            return
        if os.path.dirname(src) == folder:
            kind = _KINDS.get(event.event_type)
            if kind is not None:
                self._w._emit(FsEvent(kind, os.path.basename(src)))
        if event.event_type == we.EVENT_TYPE_MOVED:
            dest = os.fsdecode(event.dest_path)
            if os.path.dirname(dest) == folder:
                self._w._emit(FsEvent("created", os.path.basename(dest)))


_KINDS: dict[str, Kind] = {
    we.EVENT_TYPE_CREATED: "created",
    we.EVENT_TYPE_DELETED: "deleted",
    we.EVENT_TYPE_MOVED: "deleted",  # the source name is gone; the destination is reported apart
    we.EVENT_TYPE_CLOSED: "written",
    we.EVENT_TYPE_MODIFIED: "written",
}
