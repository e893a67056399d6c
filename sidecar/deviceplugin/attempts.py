"""Registration cycles: rule A1 of docs/design.md#rule-families.

A1 a cycle opens at a new plugin socket or a kubelet restart (an open one absorbs what follows: a
restart and the new socket are one attempt) and closes when the kubelet holds the plugin and has
recorded its device list, or when `registered:` fails: the registration latency SLI.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from sidecar.deviceplugin.evidence import Attempt, Listener


class Attempts:
    """Each plugin's open registration cycle, and the last 50 cycles of all."""

    def __init__(
        self,
        resources: Iterable[str],
        listener: Listener,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.listener = listener
        self.clock = clock
        self.wall = wall
        self.history: deque[Attempt] = deque(maxlen=50)
        self._open: dict[str, Attempt | None] = dict.fromkeys(resources)

    def current(self, resource: str) -> Attempt | None:
        """The plugin's open cycle, if any."""
        return self._open[resource]

    def open(self, resource: str, cause: str) -> None:
        """A1: a cycle opens, unless one is open already."""
        if self._open[resource] is not None:
            return  # an open cycle absorbs what follows: restart + new socket is one attempt
        attempt = self._open[resource] = Attempt(resource, cause, self.wall(), self.clock())
        self.history.append(attempt)
        self.listener.attempt_opened(resource)

    def close(self, resource: str, registered: bool) -> None:
        """A1: the open cycle, if any, closes registered (with its latency) or not."""
        attempt, self._open[resource] = self._open[resource], None
        if attempt is None:
            return
        if registered:
            attempt.outcome = "registered"
            attempt.latency = max(0.0, self.clock() - attempt.opened)
            self.listener.attempt_closed(resource, attempt.latency)
        else:
            attempt.outcome = "not registered within the grace"
            self.listener.attempt_closed(resource, None)
