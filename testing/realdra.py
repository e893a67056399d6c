"""The kubelet's real plugin manager and DRA manager, and DRA drivers on the kubelet plugin helper.

Each runs a process of the Go fixture in `tests/realdra` (docs/real-kubelet.md#dra) at a release
whose DRA kubelet plugin API (dra/v1) is GA, 1.34 on: "new" (v1.37.2) and "old" (v1.36.5) as in
`tests/realkubelet`, built by `make dra-fixtures`, or v1.34.4 and v1.35.4, built by
`make dra-fixtures-all` (REALDRA_RELEASES selects them). The processes speak the same JSON lines as
the device-manager fixture (`testing.realkubelet.FixtureProcess`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

from testing import realkubelet
from testing.realkubelet import Event, FixtureError, FixtureProcess

# Every release the DRA fixture is built at (the Makefile's DRA_RELEASES), oldest first.
VERSIONS = ("v1.34.4", "v1.35.4", "v1.36.5", "v1.37.2")
Release = Literal["new", "old", "v1.34.4", "v1.35.4", "v1.36.5", "v1.37.2"]
RELEASES: Mapping[str, str] = {
    **{name: realkubelet.RELEASES[name] for name in ("new", "old")},
    **{v: v for v in VERSIONS},
}
# Built by `make dra-fixtures` (and so by `make test`); the others by `make dra-fixtures-all`.
QUICK_VERSIONS = ("v1.37.2", "v1.36.5")
RELEASES_ENV = "REALDRA_RELEASES"

BIN_ENV = "HAMI_GUARD_REALDRA_BIN"
_REPO = Path(__file__).resolve().parents[1]

__all__ = [
    "RELEASES",
    "FixtureError",
    "RealDraDriver",
    "RealDraKubelet",
    "Release",
    "minor",
    "missing_reason",
    "selected_releases",
]


def minor(release: str) -> int:
    """The minor version of a release: 36 for "old" and "v1.36.5"."""
    return int(RELEASES.get(release, release).split(".")[1])


def selected_releases(default: Iterable[Release] = ("new", "old")) -> list[Release]:
    """The releases a DRA test parametrized over releases runs at: $REALDRA_RELEASES (comma-separated
    names or versions, or "all") or `default`. A release whose binary is missing is still listed: the
    test skips it with the reason (fails under CI=true)."""
    raw = os.environ.get(RELEASES_ENV, "").strip()
    if not raw:
        return list(default)
    names = list(VERSIONS) if raw == "all" else [r.strip() for r in raw.split(",") if r.strip()]
    unknown = [n for n in names if n not in RELEASES]
    if unknown:
        raise ValueError(f"{RELEASES_ENV}: unknown releases {unknown}; known: {sorted(RELEASES)}")
    return cast("list[Release]", names)


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or _REPO / "tests" / "realdra" / "bin")


def fixture_binary(release: str) -> Path | None:
    version = RELEASES.get(release, release)
    path = bin_dir() / f"realdra-{version}"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_reason(release: str) -> str | None:
    """Why the DRA fixture of a release cannot run here, or None when it can."""
    if fixture_binary(release) is not None:
        return None
    version = RELEASES.get(release, release)
    target = "dra-fixtures" if version in QUICK_VERSIONS else "dra-fixtures-all"
    hint = f"the DRA fixture for kubernetes {version} is not built: run `make {target}` (needs Go >= 1.26)"
    return hint if shutil.which("go") else f"Go is not installed; {hint}"


def _binary(release: str) -> str:
    path = fixture_binary(release)
    if path is None:
        raise FixtureError(missing_reason(release) or "the DRA fixture is missing")
    return str(path)


class RealDraKubelet:
    """`pluginmanager.NewPluginManager(registry)` with the DRA manager's handler, a fake API client."""

    def __init__(
        self,
        registry: str,
        state: str,
        kubelet_socket: str,
        *,
        release: Release = "new",
        kubeconfig: str = "",
    ) -> None:
        self.registry = registry
        self.state_dir = state
        self.socket_path = kubelet_socket
        self.release = release
        self.version = RELEASES[release]
        self.restarts = 0
        argv = [_binary(release), "kubelet", "--registry", registry, "--state", state]
        argv += ["--kubelet-socket", kubelet_socket]
        if kubeconfig:  # a real API server: the DRA manager's wipes are real
            argv += ["--kubeconfig", kubeconfig]
        self.proc = FixtureProcess(argv, f"dra-kubelet-{self.version}")

    async def start(self) -> Event:
        await self.proc.spawn()
        return await self.proc.wait_event("ready", timeout=30)

    async def stop(self) -> None:
        """An orderly stop: the DRA manager closes its connections, the socket goes."""
        await self.proc.finish("stop")

    async def crash(self) -> None:
        """SIGKILL: connections close with the process, the kubelet socket file stays."""
        await self.proc.kill()

    async def restart(self, crash: bool = False) -> Event:
        await (self.crash() if crash else self.stop())
        self.restarts += 1
        return await self.start()

    async def state(self) -> dict[str, Any]:
        return await self.proc.call("state")

    async def endpoints(self, driver: str) -> list[dict[str, Any]]:
        drivers = (await self.state()).get("drivers") or {}
        found = drivers.get(driver) or []
        return list(found) if isinstance(found, list) else []

    async def usable(self, driver: str) -> bool:
        """The kubelet's own truth: the DRA plugin manager has an endpoint of the driver that gRPC
        reports connected (the `usable` test that decides the ResourceSlice wipe)."""
        return any(e.get("connected") for e in await self.endpoints(driver))

    async def call(self, driver: str) -> Event:
        """The kubelet's own empty NodePrepareResources through its own connection."""
        return await self.proc.ask("call", driver, timeout=10)

    def wipes(self, driver: str, after: int = 0) -> list[Event]:
        return self.proc.find("wipe", lambda e: f"driver={driver}" in str(e.get("selector")), after)

    async def close(self) -> None:
        if self.proc.alive:
            await self.proc.kill()
        self.proc.cleanup()

    async def __aenter__(self) -> RealDraKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RealDraDriver:
    """A DRA driver on `kubeletplugin.Start`: its registration socket in the registry, its DRA service
    in a folder of its own."""

    def __init__(
        self,
        name: str,
        registry: str,
        plugin_dir: str,
        *,
        release: Release = "new",
        reg_socket: str = "",
        rolling_uid: str = "",
        health: str = "off",
        kubeconfig: str = "",
        refuse: bool = False,
    ) -> None:
        self.name = name
        self.registry = registry
        self.plugin_dir = plugin_dir
        self.release = release
        argv = [
            _binary(release),
            "driver",
            "--name",
            name,
            "--registry",
            registry,
            "--plugin-dir",
            plugin_dir,
        ]
        if reg_socket:
            argv += ["--reg-socket", reg_socket]
        if rolling_uid:
            argv += ["--rolling-uid", rolling_uid]
        argv += ["--health", health]
        if kubeconfig:  # a real API server: `publish` makes ResourceSlices there
            argv += ["--kubeconfig", kubeconfig]
        if refuse:  # NotifyRegistrationStatus refused from the kubelet's first call
            argv.append("--refuse")
        self.proc = FixtureProcess(argv, f"dra-driver-{name}-{RELEASES[release]}")
        self.registration = ""
        self.service = ""

    async def start(self) -> Event:
        await self.proc.spawn()
        ready = await self.proc.wait_event("ready", timeout=30)
        self.registration, self.service = str(ready["registration"]), str(ready["service"])
        return ready

    async def stop(self) -> None:
        """An orderly stop: the helper closes both listeners and removes both socket files."""
        await self.proc.finish("stop")

    async def crash(self) -> None:
        """SIGKILL: both socket files stay, nothing listens on them."""
        await self.proc.kill()

    async def set(self, switch: str, on: bool) -> None:
        """refuse (NotifyRegistrationStatus fails), getinfo-error, hang (every call blocks),
        hang-service (the DRA service's calls block; registration answers)."""
        await self.proc.call(switch, "on" if on else "off")

    async def stall(self, on: bool) -> int:
        """The DRA service's listener stops accepting (its connections end; new ones wait unread in
        the backlog) or accepts again; registration answers. The connections ended."""
        return int((await self.proc.call("stall-service", "on" if on else "off")).get("dropped") or 0)

    async def drop(self) -> int:
        """End the kubelet's connections to the DRA service (the listener stays): their number."""
        return int((await self.proc.call("drop")).get("dropped") or 0)

    async def service_off(self) -> bool:
        """Close the DRA service's listener and its connections; registration keeps answering. True
        when the gRPC server had closed the listener already (its Serve ended)."""
        return bool((await self.proc.call("service-off")).get("already_closed"))

    async def publish(self, devices: int) -> None:
        """Publish one ResourceSlice of `devices` devices for the node (needs a kubeconfig)."""
        await self.proc.call("publish", str(devices))

    async def status(self) -> dict[str, Any]:
        return await self.proc.call("status")

    def calls(self, method: str, after: int = 0) -> int:
        return len(self.proc.find("call", lambda e: e.get("method") == method, after))

    async def close(self) -> None:
        if self.proc.alive:
            await self.proc.kill()
        self.proc.cleanup()

    async def __aenter__(self) -> RealDraDriver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
