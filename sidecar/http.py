"""HTTP views: they read the health state and never wait on a probe.

`/healthz` (and `/livez`) is the plugin's livenessProbe: it fails only where a plugin restart is
the remedy. `/readyz` is its readinessProbe: every check must pass.
"""

from __future__ import annotations

import json

from aiohttp import web

from sidecar.app import Sidecar
from sidecar.health import Check, HealthState, Status
from sidecar.metrics import CONTENT_TYPE

SIDECAR_KEY = web.AppKey("sidecar", Sidecar)


def build_app(sidecar: Sidecar) -> web.Application:
    app = web.Application(handler_args={"max_field_size": 8190})
    app[SIDECAR_KEY] = sidecar
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/healthz/{check:.+}", healthz_one)
    app.router.add_get("/sidecarz", sidecarz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/readyz/{check:.+}", healthz_one)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


async def healthz(request: web.Request) -> web.Response:
    """Liveness: would restarting the plugin help? 503 only for a failure whose remedy is a restart."""
    return _answer(request, live=True)


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the whole truth. 200 only when the first round ran and every check passes."""
    return _answer(request, live=False)


def _answer(request: web.Request, live: bool) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    state = sidecar.state
    query = request.query
    exclude = query.getall("exclude", [])
    ok = state.healthy(exclude) if live else sidecar.ready and state.all_ok(exclude)
    if ok and "verbose" not in query:
        # The hot path of every probe: one set difference, no probe.
        return web.Response(text="ok")
    kind = "healthz" if live else "readyz"
    if "verbose" in query:
        checks = [c for name, c in state.checks.items() if name not in exclude]
    else:
        names = state.failed if live else state.not_ok
        checks = [state.checks[n] for n in sorted(names - set(exclude))]
    head = [] if live or sidecar.ready else ["[~]probes pending: the first probe round has not finished"]
    return _verbose(state, checks, ok, kind, head)


async def sidecarz(request: web.Request) -> web.Response:
    """The sidecar itself, for its own container's probes: 200 once its first probe round has run."""
    if request.app[SIDECAR_KEY].ready:
        return web.Response(text="ok")
    return web.Response(status=503, text="the first probe round has not finished\n")


async def healthz_one(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    check = sidecar.state.checks.get(request.match_info["check"])
    if check is None:
        known = ", ".join(sidecar.state.checks)
        raise web.HTTPNotFound(text=f"no check named {request.match_info['check']!r}; checks: {known}\n")
    live = request.path.startswith("/healthz")
    ok = not check.live_failed if live else check.status is Status.OK
    if ok and "verbose" not in request.query:
        return web.Response(text="ok")
    return _verbose(sidecar.state, [check], ok, "healthz" if live else "readyz")


async def status(request: web.Request) -> web.Response:
    doc = request.app[SIDECAR_KEY].status_document()
    return web.Response(text=json.dumps(doc, indent=2) + "\n", content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SIDECAR_KEY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _line(state: HealthState, check: Check) -> str:
    if check.status is Status.OK:
        return f"[+]{check.name} ok"
    if check.status is Status.FAILED and not check.restarts:
        return f"[!]{check.name} failed (no restart: {check.no_restart}): {check.reason}"
    line = f"[{check.mark}]{check.name} {check.status.value}: {check.reason}"
    if check.status is Status.PENDING:
        line += f" (grace: {state.grace_left(check):.0f}s left)"
    return line


def _verbose(
    state: HealthState, checks: list[Check], ok: bool, kind: str, head: list[str] | None = None
) -> web.Response:
    """kube-apiserver's format: `[+]name ok`, `[-]name failed: reason`, `[~]name pending: reason`;
    `[!]` marks a failure that restarts nothing (it fails readiness only)."""
    lines = [*(head or []), *(_line(state, c) for c in checks)]
    lines.append(f"{kind} check {'passed' if ok else 'failed'}")
    return web.Response(status=200 if ok else 503, text="\n".join(lines) + "\n")
