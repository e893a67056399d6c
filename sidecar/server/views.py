"""HTTP views: they read the health state and never wait on a probe.

`/healthz` (and `/livez`) is the plugin's livenessProbe: it fails only where a plugin restart is
the remedy. `/readyz` is its readinessProbe: every check must pass. Both take `exclude=`, a check's
name or a kind of check (`exclude=devices`: every `devices:<resource>`), repeatable. `/sidecarz` is the
sidecar's own readiness, `/sidecarz/live` its own liveness (docs/design.md#sidecar-probes).

With a bad configuration the sidecar judges nothing and serves that (build_error_app): `/healthz`
200 (a plugin restart never mends the sidecar's flags), everything that tells the truth 503.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from aiohttp import web
from multidict import MultiMapping

from sidecar import __version__
from sidecar.app import Sidecar
from sidecar.config import BadConfig
from sidecar.health import Check, HealthState, Status
from sidecar.server.metrics import CONTENT_TYPE, Metrics
from sidecar.server.serving import text_body
from sidecar.server.status import status_document

SIDECAR_KEY = web.AppKey("sidecar", Sidecar)


def build_app(sidecar: Sidecar) -> web.Application:
    app = web.Application(handler_args={"max_field_size": 8190})
    app[SIDECAR_KEY] = sidecar
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/healthz/{check:.+}", healthz_one)
    app.router.add_get("/sidecarz", sidecarz)
    app.router.add_get("/sidecarz/live", sidecarz_live)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/readyz/{check:.+}", healthz_one)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


Answer = tuple[int, str]  # a status and its text/plain body


def probe_answers(sidecar: Sidecar) -> Callable[[str, MultiMapping[str]], Answer | None]:
    """The probe paths' answers for the server to send itself (BoundedServer's `answer`): the same
    as their views below, given a path and its query; None for any other path."""

    def answer(path: str, query: MultiMapping[str]) -> Answer | None:
        if path in ("/healthz", "/livez"):
            return _judged(sidecar, query, live=True)
        if path == "/readyz":
            return _judged(sidecar, query, live=False)
        if path == "/sidecarz":
            return _sidecar_ready(sidecar)
        if path == "/sidecarz/live":
            return 200, "ok"
        return None

    return answer


def _response(answer: Answer) -> web.Response:
    return web.Response(
        status=answer[0], body=text_body(answer[1]), content_type="text/plain", charset="utf-8"
    )


async def healthz(request: web.Request) -> web.Response:
    """Liveness: would restarting the plugin help? 503 only for a failure whose remedy is a restart."""
    return _response(_judged(request.app[SIDECAR_KEY], request.query, live=True))


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the whole truth. 200 only when the first round ran and every check passes."""
    return _response(_judged(request.app[SIDECAR_KEY], request.query, live=False))


def excluded(checks: Iterable[str], given: Iterable[str]) -> set[str]:
    """The checks `exclude=` leaves out: each named (`devices:vendor.example/gpu`), and every check of a kind
    named without its subject (`devices`: each `devices:<resource>`), so that a probe's path need not
    name the resource."""
    out = set(given)
    kinds = {e for e in out if ":" not in e}
    if kinds:
        out.update(name for name in checks if name.partition(":")[0] in kinds)
    return out


def _judged(sidecar: Sidecar, query: MultiMapping[str], live: bool) -> Answer:
    state = sidecar.state
    exclude = excluded(state.checks, query.getall("exclude", []))
    ok = state.healthy(exclude) if live else sidecar.ready and state.all_ok(exclude)
    if ok and "verbose" not in query:
        # The hot path of every probe: one set difference, no probe.
        return 200, "ok"
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
    return _response(_sidecar_ready(request.app[SIDECAR_KEY]))


def _sidecar_ready(sidecar: Sidecar) -> Answer:
    return (200, "ok") if sidecar.ready else (503, "the first probe round has not finished\n")


async def sidecarz_live(request: web.Request) -> web.Response:
    """The sidecar's own liveness: 200 whenever its loop answers, whatever its configuration or the
    plugin's state. What a restart of the sidecar container mends is a loop that does not answer."""
    return web.Response(text="ok")


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
    return _response(_verbose(sidecar.state, [check], ok, "healthz" if live else "readyz"))


async def status(request: web.Request) -> web.Response:
    doc = status_document(request.app[SIDECAR_KEY])
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
    if check.status is Status.PENDING and not check.judged_elsewhere:  # a DRA reason says its own grace
        line += f" (grace: {state.grace_left(check):.0f}s left)"
    return line


def _verbose(
    state: HealthState, checks: list[Check], ok: bool, kind: str, head: list[str] | None = None
) -> Answer:
    """kube-apiserver's format: `[+]name ok`, `[-]name failed: reason`, `[~]name pending: reason`;
    `[!]` marks a failure that restarts nothing (it fails readiness only)."""
    lines = [*(head or []), *(_line(state, c) for c in checks)]
    lines.append(f"{kind} check {'passed' if ok else 'failed'}")
    return 200 if ok else 503, "\n".join(lines) + "\n"


# -- a bad configuration, served -------------------------------------------------------------------
CONFIG_KEY = web.AppKey("config_error", BadConfig)
METRICS_KEY = web.AppKey("metrics", Metrics)


def build_error_app(problem: BadConfig, metrics: Metrics) -> web.Application:
    """The sidecar with flags or variables it cannot run with: it says so, and restarts nothing."""
    app = web.Application()
    app[CONFIG_KEY] = problem
    app[METRICS_KEY] = metrics
    metrics.config_error.set(1)
    for path in ("/healthz", "/livez", "/healthz/{check:.+}"):
        app.router.add_get(path, _error_healthz)
    for path in ("/readyz", "/readyz/{check:.+}"):
        app.router.add_get(path, _error_readyz)
    app.router.add_get("/sidecarz", _error_sidecarz)
    app.router.add_get("/sidecarz/live", sidecarz_live)
    app.router.add_get("/status", _error_status)
    app.router.add_get("/metrics", _error_metrics)
    return app


def _config_line(request: web.Request) -> str:
    return f"the sidecar's configuration is invalid: {request.app[CONFIG_KEY].error}"


async def _error_healthz(request: web.Request) -> web.Response:
    """200: the plugin is not judged, and restarting it would not mend the sidecar's configuration."""
    if "verbose" not in request.query:
        return web.Response(text="ok")
    text = f"[~]config not judged: {_config_line(request)}\nhealthz check passed\n"
    return _response((200, text))


async def _error_readyz(request: web.Request) -> web.Response:
    return _response((503, f"[-]config failed: {_config_line(request)}\nreadyz check failed\n"))


async def _error_sidecarz(request: web.Request) -> web.Response:
    return _response((503, _config_line(request) + "\n"))


async def _error_status(request: web.Request) -> web.Response:
    problem = request.app[CONFIG_KEY]
    doc = {
        "version": __version__,
        "live": True,
        "ready": False,
        "config_error": problem.error,
        "listen": f"{problem.host}:{problem.port}",
        **({"listen_note": problem.listen_note} if problem.listen_note else {}),
        "checks": {},
    }
    return web.Response(status=503, text=json.dumps(doc, indent=2) + "\n", content_type="application/json")


async def _error_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
