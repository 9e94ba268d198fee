"""aiohttp plumbing shared by every service: JSON errors, typed bodies, health and metrics routes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import msgspec
import psycopg
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from psycopg import errors as pg_errors

from libs.contracts.common import ContractError, decode_json
from libs.contracts.http import ErrorBody
from libs.telemetry import metrics
from libs.telemetry.metrics import exposition

log = logging.getLogger("http")
T = TypeVar("T")

ReadinessCheck = Callable[[], Awaitable[None]]
READINESS_CHECKS = web.AppKey("readiness_checks", dict[str, ReadinessCheck])


class ApiError(Exception):
    """Raised by handlers; rendered as `{"error", "message", "field"}` with the given status."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.extra = extra


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), status=status, content_type="application/json",
                        headers=headers)


def error_response(status: int, code: str, message: str, field: str | None = None, **extra: Any) -> web.Response:
    body = ErrorBody(error=code, message=message, field=field, **extra)
    # A 429 or 503 that says when to come back says it in the standard header too (HTTP clients honour it).
    retry_after = extra.get("retry_after_s")
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return json_response(body, status=status, headers=headers)


# Errors of a transaction that lost to concurrent work and changed nothing: the caller may simply retry.
CONTENTION_ERRORS: tuple[type[Exception], ...] = (
    pg_errors.DeadlockDetected, pg_errors.SerializationFailure, pg_errors.LockNotAvailable, pg_errors.QueryCanceled)


@web.middleware
async def json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> (
    web.StreamResponse
):
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.field, **exc.extra)
    except ContractError as exc:
        status = 413 if exc.code == "payload_too_large" else 400
        return error_response(status, exc.code, exc.message, exc.field)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
                410: "gone"}.get(exc.status, "http_error")
        response = error_response(exc.status, code, exc.reason or code)
        # A 405 names the methods the resource does take, in its Allow header; keep it on the JSON answer.
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except asyncio.CancelledError:
        raise
    except CONTENTION_ERRORS as exc:
        # Two writers met on the same rows (a deadlock Postgres broke, a lock or statement timeout): nothing was
        # written by this call, and the same call a moment later succeeds. A 503 that says so, not a 500.
        log.warning("database contention; answered 503", extra={"path": request.path, "method": request.method,
                                                                 "error_type": type(exc).__name__})
        return error_response(503, "busy", "the request met concurrent work on the same data and was not applied; "
                              "retry it", retry_after_s=1)
    except psycopg.OperationalError as exc:
        # The database connection was lost mid-call or none could be had in time (psycopg_pool.PoolTimeout): a
        # restart, a failover, terminated backends. What the call wrote is rolled back or, if its COMMIT got
        # through, what a retry finds (a click's replay, a result's idempotency key) or the reconciler repairs (a
        # lease nobody heard of expires): a 503 to come back to, not a 500.
        log.warning("database unavailable; answered 503", extra={"path": request.path, "method": request.method,
                                                                 "error_type": type(exc).__name__})
        return error_response(503, "database_unavailable", "the database could not be reached; retry it",
                              retry_after_s=1)
    except Exception:
        log.exception("unhandled error", extra={"path": request.path, "method": request.method})
        return error_response(500, "internal_error", "an unexpected error occurred; it has been logged")


async def read_whole_body(request: web.Request, *, max_bytes: int) -> bytes:
    """The entire request body, however the client segmented it, refusing more than `max_bytes`.

    `StreamReader.read(n)` returns what is buffered so far, so a body that arrives in pieces (any client on a
    real network) would be cut at its first segment; this reads to the end of the body. A declared
    `Content-Length` over the limit is refused before reading; a chunked body is counted as it arrives and
    refused (413) as soon as it passes the limit.
    """
    if request.content_length is not None and request.content_length > max_bytes:
        raise ContractError("payload_too_large", f"body is {request.content_length} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise ContractError("payload_too_large", f"body is over the limit of {max_bytes} bytes")
    return b"".join(chunks)


async def read_body(request: web.Request, type_: type[T], *, max_bytes: int,
                    decoder: msgspec.json.Decoder[Any] | None = None, allow_empty: bool = False) -> T:
    raw = await read_whole_body(request, max_bytes=max_bytes)
    if request.content_type not in ("application/json", "") and raw.strip():
        raise ApiError(415, "unsupported_media_type", "send the body as application/json")
    if allow_empty and not raw.strip():
        raw = b"{}"
    return decode_json(raw, type_, max_bytes=max_bytes, decoder=decoder)


async def healthz(_: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks = request.app.get(READINESS_CHECKS, {})
    results: dict[str, str] = {}
    ok = True
    for name, check in checks.items():
        try:
            await asyncio.wait_for(check(), timeout=2.0)
            results[name] = "ok"
        except Exception as exc:
            ok = False
            # The answer is public (kubelet, load balancers): an exception's text can name hosts, DSNs or SQL,
            # so it goes to the log only.
            results[name] = "failing"
            log.warning("readiness check failing", extra={
                "check": name, "error_type": type(exc).__name__, "error": str(exc)[:500]})
    return json_response({"status": "ok" if ok else "unavailable", "checks": results}, status=200 if ok else 503)


async def metrics_handler(_: web.Request) -> web.Response:
    return web.Response(body=exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_ops_routes(app: web.Application) -> None:
    """`/healthz` (alive), `/readyz` (dependencies reachable), `/metrics` (Prometheus)."""
    app.setdefault(READINESS_CHECKS, {})  # type: ignore[arg-type]
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)


def add_readiness_check(app: web.Application, name: str, check: ReadinessCheck) -> None:
    if READINESS_CHECKS not in app:
        app[READINESS_CHECKS] = {}
    app[READINESS_CHECKS][name] = check


# A WebSocket handler marks its request upgraded (the handler runs in the middleware's task, so the middleware
# sees the mark; a started request's own mapping must not change).
_UPGRADED: ContextVar[bool] = ContextVar("upgraded", default=False)


def mark_upgraded() -> None:
    _UPGRADED.set(True)
_UNMATCHED = "unmatched"  # 404s are one route: a scanner's made-up paths must not create a series each


def _route_of(request: web.Request) -> str:
    info = request.match_info
    if info.http_exception is not None or info.route.resource is None:
        return _UNMATCHED
    return info.route.resource.canonical


@web.middleware
async def red_metrics(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> (
    web.StreamResponse
):
    """Rate, errors and duration per route template (outside `json_errors`, so error answers count too). A
    WebSocket session counts once, as its upgrade (101), and not in the duration histogram."""
    started = time.perf_counter()
    status = 500
    _UPGRADED.set(False)
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        # aiohttp cancels a handler whose client went away: a WebSocket session ending, or 499 (as nginx says).
        status = 101 if _UPGRADED.get() else 499
        raise
    finally:
        service = metrics.service_name()
        route = _route_of(request)
        metrics.http_requests_total.inc(service=service, route=route, method=request.method, status=status)
        if status != 101:
            metrics.http_request_duration_seconds.labels(service=service, route=route, method=request.method) \
                .observe(time.perf_counter() - started)


def make_app(*, max_body_bytes: int = 256 * 1024) -> web.Application:
    app = web.Application(middlewares=[red_metrics, json_errors], client_max_size=max_body_bytes)
    app[READINESS_CHECKS] = {}
    add_ops_routes(app)
    return app
