"""Which of several candidate resources this node's plugin serves (`--plugin-candidates`), learnt before
anything is judged.

One DaemonSet may run a vendor's plugin on nodes of different devices, each node's plugin serving the
resource of its own (HAMi's Ascend plugin serves the `vnpus.configs` entry whose chipName is the node's
chip: `huawei.com/<commonWord>` on `<commonWord>.sock`). A sidecar told one resource judges, on the other
nodes, a resource that never appears there, and restarts their plugins for nothing. Told the candidates,
it first learns which one this pod's plugin serves, then judges that one as if `--plugin` had named it.

The evidence is the kernel's, in this pod's network namespace: a candidate is served here when its socket
file (the file itself, never through a symbolic link) is bound by a socket that listens in this namespace,
under that candidate's own path. sock_diag lists the caller's namespace only, which the pod's containers
share and no process outside the pod is in, so a socket file of a candidate's name that another process
of the node bound (another pod's plugin, a look-alike) is not chosen: its listener is elsewhere. That
holds while this namespace is not the host's: with hostNetwork every process of the node listens in it,
so where the kubelet's listener on kubelet.sock is in this namespace nothing is chosen, and neither is
anything while the kubelet's listener cannot be seen to be elsewhere (kubelet.sock missing or not
served). Several candidates served at once are not guessed between either. Both of those want
`--plugin`: readiness fails saying so; liveness never does (a plugin restart tells nothing more).

The same answer at two looks in a row (one polling interval apart) chooses: a plugin caught between
serving one socket and the next is not taken for one that serves one. The choice is made once: a node's
device does not change under a running pod.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from hami_guard.flags import PluginSpec
from hami_guard.node.netunix import LISTEN, normalise
from hami_guard.node.sockets import try_connect
from hami_guard.node.unixdiag import KUBELET_BOUND_PATH, DiagUnavailable, UnixSocket, diag_dump
from sidecar.deviceplugin.evidence import iso
from sidecar.health import Check, CheckKey, HealthState, Kind, Status

logger = logging.getLogger(__name__)

# The wait's one check, `plugin` (no resource: none is known yet). Not one the plugin's readinessProbe
# leaves out (manifests/hami-patch/patch.yaml): the pod is not ready while it waits.
CHECK = CheckKey(Kind.PLUGIN)
# Where the plugin binds its socket when the sidecar mounts the folder elsewhere: the kubelet's folder.
BOUND_DIR = os.path.dirname(KUBELET_BOUND_PATH)
CONNECT_TIMEOUT = 0.2  # kubelet.sock answers a connect at once when the kubelet serves it
LOOK_DEADLINE = 2.0  # a look takes milliseconds (its connect at most CONNECT_TIMEOUT): past this it hangs
NAME_IT = "name this node's resource with --plugin (HAMI_GUARD_PLUGIN; the post-renderer's plugin=)"

Outcome = Literal["serves", "waiting", "undecided"]


@dataclass(frozen=True)
class Look:
    """What one look at the folder and this namespace's listeners found."""

    outcome: Outcome  # serves: exactly one candidate; waiting: none yet; undecided: cannot be told here
    reason: str
    served: PluginSpec | None = None
    listener: int = 0  # the served socket's listening socket (its inode), in this namespace


def shown(candidates: Sequence[PluginSpec]) -> str:
    return ", ".join(f"{c.resource} ({c.socket})" for c in candidates)


def socket_file(path: str) -> tuple[tuple[int, int] | None, str]:
    """The socket file at `path` as (st_dev, st_ino), never through a symbolic link; else None and what
    is there instead ("" for nothing)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None, ""
    if stat.S_ISLNK(st.st_mode):
        return None, "a symbolic link, not followed"
    if not stat.S_ISSOCK(st.st_mode):
        return None, "not a socket"
    return (st.st_dev, st.st_ino), ""


def listener(sockets: Sequence[UnixSocket], bound: tuple[int, int], names: set[str]) -> int:
    """The inode of the socket listening on the file `bound` under one of `names` (the paths as bound),
    0 for none: a file's inode number is free for another file once its listener closes, so the file
    alone does not name a listener."""
    for u in sockets:
        if u.state == LISTEN and u.vfs == bound and u.path in names:
            return u.ino
    return 0


def look(folder: str, kubelet_socket: str, candidates: Sequence[PluginSpec]) -> Look:
    """Which candidate this namespace serves, read from the node now (blocking: files, sock_diag and, once
    one candidate is served here, a connect to kubelet.sock)."""
    kubelet_path = os.path.join(folder, kubelet_socket)
    kubelet, _ = socket_file(kubelet_path)
    files = {c: socket_file(os.path.join(folder, c.socket)) for c in candidates}
    waiting = f"waiting for this node's plugin to serve one of {shown(candidates)}"
    try:
        sockets = diag_dump({f for f in (kubelet, *(f for f, _ in files.values())) if f is not None})
    except DiagUnavailable as e:
        return Look(
            "undecided",
            f"this network namespace's listeners cannot be read ({e}), so which of {shown(candidates)} this "
            f"node's plugin serves cannot be told: {NAME_IT}",
        )
    if kubelet is not None and any(u.state == LISTEN and u.vfs == kubelet for u in sockets):
        return Look(
            "undecided",
            f"this pod's network namespace is the host's (hostNetwork: the kubelet's listener on "
            f"{kubelet_socket} is in it), where any process of the node may listen on a candidate's socket, "
            f"so which of {shown(candidates)} this node's plugin serves cannot be told: {NAME_IT}",
        )
    served, notes = _served(folder, files, sockets)
    if not served:
        return Look("waiting", waiting + "".join(f"; {n}" for n in notes))
    if len(served) > 1:
        return Look(
            "undecided",
            f"this pod serves several candidates at once ({shown([c for c, _ in served])}), so which one "
            f"this node's plugin registers cannot be told: {NAME_IT}",
        )
    # One served here: it is this pod's only where this namespace is known not to be the host's, the
    # kubelet's listener answering from elsewhere.
    if kubelet is None:
        return Look(
            "waiting",
            f"{waiting}: {kubelet_socket} is not a socket file there, so whether this pod's network "
            "namespace is the host's cannot be told yet",
        )
    if try_connect(kubelet_path, CONNECT_TIMEOUT) is not None:
        return Look(
            "waiting",
            f"{waiting}: nothing listens on {kubelet_socket}, so whether this pod's network namespace is the "
            "host's cannot be told until the kubelet serves it",
        )
    (c, ino), *_ = served
    return Look(
        "serves",
        f"{c.socket}'s listener (socket {ino}) is in this pod's network namespace, and no other candidate's",
        c,
        ino,
    )


def _served(
    folder: str,
    files: Mapping[PluginSpec, tuple[tuple[int, int] | None, str]],
    sockets: Sequence[UnixSocket],
) -> tuple[list[tuple[PluginSpec, int]], list[str]]:
    """The candidates served in this namespace (each with its listener's inode), and why each other one
    with something at its path is not."""
    served, notes = [], []
    for c, (bound, other) in files.items():
        names = {normalise(os.path.join(folder, c.socket)), os.path.join(BOUND_DIR, c.socket)}
        ino = listener(sockets, bound, names) if bound is not None else 0
        if ino:
            served.append((c, ino))
        elif bound is not None:
            notes.append(f"{c.socket}: no listener in this pod's network namespace (not this pod's plugin)")
        elif other:
            notes.append(f"{c.socket}: {other}")
    return served, notes


@dataclass(frozen=True)
class Where:
    """Where to look, how often, and how long a wait may last before it is a failure (readiness only)."""

    folder: str  # the device-plugins folder
    kubelet_socket: str  # kubelet.sock's name in it
    interval: float  # seconds between looks
    grace: float  # the registration grace


class CandidateWait:
    """The wait for this node's plugin to serve one of the candidates: its check (`plugin`, never
    failing liveness), told to `publish` as it changes, and the choice once made."""

    def __init__(
        self,
        where: Where,
        candidates: Sequence[PluginSpec],
        publish: Callable[[Check], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.where = where
        self.candidates = tuple(candidates)
        self.clock = clock
        self.started = clock()
        self._publish = publish
        self.state = HealthState(where.grace, clock, wall)
        self.state.add(CHECK, restarts=False)
        self.looks = 0
        self.last: Look | None = None
        self._reason = ""  # the check's reason for `last`
        self.chosen: PluginSpec | None = None
        self.evidence = ""  # why `chosen` was chosen
        self.chosen_at = 0.0  # wall clock
        self._wall = wall
        self._show(Look("waiting", "waiting for the first look at the device-plugins folder"))

    def look(self) -> Look:
        """One look (blocking); a look that fails unexpectedly is no answer, never the end of the wait."""
        w = self.where
        try:
            return look(w.folder, w.kubelet_socket, self.candidates)
        except Exception as e:  # anything the node's files throw is a reason (logged as it changes)
            logger.debug("looking for the plugin's socket failed", exc_info=True)
            return Look("undecided", f"looking for the plugin's socket failed: {e!r}")

    async def wait(self) -> PluginSpec:
        """Look every polling interval until the same one candidate is served at two looks in a row."""
        loop = asyncio.get_running_loop()
        reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hami-sidecar-candidates")
        logger.info(
            "learning which of %s this node's plugin serves before judging it", shown(self.candidates)
        )
        try:
            before: PluginSpec | None = None
            pending: asyncio.Future[Look] | None = None
            while True:
                # A look that hangs (a stuck hostPath mount) is waited for, never stacked on, and its
                # wait is a reason of its own, judged late once the grace runs out like any other.
                if pending is None:
                    pending = loop.run_in_executor(reader, self.look)
                done, _ = await asyncio.wait({pending}, timeout=max(self.where.interval, LOOK_DEADLINE))
                if not done:
                    self._show(
                        Look("waiting", f"a look at {self.where.folder} has not finished: a stuck mount?")
                    )
                    continue
                seen, pending = pending.result(), None
                self.looks += 1
                if seen.served is not None and seen.served == before:
                    return self._choose(seen)
                before = seen.served
                if seen.served is not None:
                    seen = Look("waiting", f"{seen.reason}: confirming at the next look", seen.served)
                self._show(seen)
                await asyncio.sleep(self.where.interval)
        finally:
            reader.shutdown(wait=False, cancel_futures=True)

    def broken(self, reason: str) -> None:
        """Judging the candidate chosen could not start (the sidecar's fault): the check fails with
        `reason`, readiness only, for good."""
        self.state.assign(CHECK.name, Status.FAILED, reason, restarts=False)
        self._publish(self.state.checks[CHECK.name])

    def _choose(self, seen: Look) -> PluginSpec:
        assert seen.served is not None
        self.chosen, self.evidence, self.chosen_at, self.last = seen.served, seen.reason, self._wall(), seen
        logger.info(
            "this node's plugin serves %s on %s (%s): judging it",
            seen.served.resource,
            seen.served.socket,
            seen.reason,
        )
        return seen.served

    def _show(self, seen: Look) -> None:
        """The look as the check: waiting is pending, then (past the registration grace) a failure that
        restarts nothing; undecided is that failure at once."""
        grace = self.where.grace
        # One served, to be confirmed at the next look, is never late.
        late = seen.outcome == "waiting" and seen.served is None and self.clock() - self.started >= grace
        status = Status.PENDING if seen.outcome == "waiting" and not late else Status.FAILED
        reason = seen.reason
        if late:
            reason += (
                f" (none within the {grace:g}s grace: is this node's device one of the candidates? else "
                f"{NAME_IT})"
            )
        if self.last is None or (seen.outcome, reason) != (self.last.outcome, self._reason):
            log = logger.warning if status is Status.FAILED else logger.info
            log("plugin candidates: %s", reason)
        self.last, self._reason = seen, reason
        self.state.assign(CHECK.name, status, reason, restarts=False)
        self._publish(self.state.checks[CHECK.name])

    def document(self) -> dict[str, Any]:
        """The wait, or the choice, for /status."""
        doc: dict[str, Any] = {
            "candidates": {c.resource: c.socket for c in self.candidates},
            "looks": self.looks,
        }
        if self.chosen is not None:
            doc.update(chosen=self.chosen.resource, since=iso(self.chosen_at), evidence=self.evidence)
        elif self.last is not None:
            doc.update(chosen=None, outcome=self.last.outcome, reason=self._reason)
        return doc
