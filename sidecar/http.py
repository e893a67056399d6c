"""HTTP views: they read the health state and never wait on a probe."""

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
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


async def healthz(request: web.Request) -> web.Response:
    state = request.app[SIDECAR_KEY].state
    query = request.query
    exclude = query.getall("exclude", [])
    if "verbose" not in query:
        # The hot path of every livenessProbe: one set difference, no probe.
        if state.healthy(exclude):
            return web.Response(text="ok")
        failed = [state.checks[n] for n in sorted(state.failed - set(exclude))]
        return _verbose(state, failed, ok=False)
    checks = [c for name, c in state.checks.items() if name not in exclude]
    return _verbose(state, checks, state.healthy(exclude))


async def healthz_one(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    check = sidecar.state.checks.get(request.match_info["check"])
    if check is None:
        known = ", ".join(sidecar.state.checks)
        raise web.HTTPNotFound(text=f"no check named {request.match_info['check']!r}; checks: {known}\n")
    ok = check.status is not Status.FAILED
    if ok and "verbose" not in request.query:
        return web.Response(text="ok")
    return _verbose(sidecar.state, [check], ok)


async def readyz(request: web.Request) -> web.Response:
    if request.app[SIDECAR_KEY].ready:
        return web.Response(text="ok")
    return web.Response(status=503, text="the first probe round has not finished\n")


async def status(request: web.Request) -> web.Response:
    doc = request.app[SIDECAR_KEY].status_document()
    return web.Response(text=json.dumps(doc, indent=2) + "\n", content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SIDECAR_KEY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _line(state: HealthState, check: Check) -> str:
    if check.status is Status.OK:
        return f"[+]{check.name} ok"
    line = f"[{check.status.mark}]{check.name} {check.status.value}: {check.reason}"
    if check.status is Status.PENDING:
        line += f" (grace: {state.grace_left(check):.0f}s left)"
    return line


def _verbose(state: HealthState, checks: list[Check], ok: bool) -> web.Response:
    """kube-apiserver's format: `[+]name ok`, `[-]name failed: reason`, `[~]name pending: reason`."""
    lines = [_line(state, c) for c in checks]
    lines.append(f"healthz check {'passed' if ok else 'failed'}")
    return web.Response(status=200 if ok else 503, text="\n".join(lines) + "\n")
