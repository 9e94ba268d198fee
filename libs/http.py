"""aiohttp plumbing shared by every service: RFC 9457 problem answers, request ids, typed bodies, health and metrics
routes."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
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
from libs.telemetry import metrics, tracing
from libs.telemetry.logging import REQUEST_ID
from libs.telemetry.metrics import exposition

log = logging.getLogger("http")
T = TypeVar("T")

ReadinessCheck = Callable[[], Awaitable[None]]
READINESS_CHECKS = web.AppKey("readiness_checks", dict[str, ReadinessCheck])


class ApiError(Exception):
    """Raised by handlers; rendered as an RFC 9457 problem (`error_response`) with the given status."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.extra = extra


PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:monitoring-dispatch:problem:"
PROBLEM_INSTANCE_PREFIX = "urn:monitoring-dispatch:request:"
REQUEST_ID_HEADER = "X-Request-Id"
# An incoming request id is kept when it is this (a UUID, a ULID, a gateway's hex or dotted id); anything else
# (too long, spaces, control or non-ASCII characters: log injection) is replaced by a fresh one.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=-]{0,127}")
_REQUEST_ID_KEY: web.RequestKey[str] = web.RequestKey("request_id", str)
# The request an error answer is for (its id, the problem's instance, a trace id it sent), set by `request_ids`:
# an answer made outside a handler's `raise` (`error_response` called directly) still names them.
_CURRENT: ContextVar[tuple[str, str, str | None] | None] = ContextVar("current_request", default=None)
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), status=status, content_type="application/json",
                        headers=headers)


def problem_title(code: str) -> str:
    """The problem type's title: its code in words (`scope_too_large` -> "Scope too large"), the same for every
    occurrence of the type, as RFC 9457 asks."""
    return code.replace("_", " ").capitalize()


def problem(status: int, code: str, message: str, field: str | None = None, **extra: Any) -> ErrorBody:
    """The problem body for an error: the RFC's members, the request's id and trace id, and the extensions."""
    current = _CURRENT.get()
    request_id, instance, sent_trace_id = current if current is not None else (None, None, None)
    return ErrorBody(type=PROBLEM_TYPE_PREFIX + code, title=problem_title(code), status=status, detail=message,
                     instance=instance, request_id=request_id, trace_id=tracing.current_trace_id() or sent_trace_id,
                     error=code, message=message, field=field, **extra)


def error_response(status: int, code: str, message: str, field: str | None = None, **extra: Any) -> web.Response:
    body = problem(status, code, message, field, **extra)
    # A 429 or 503 that says when to come back says it in the standard header too (HTTP clients honour it).
    retry_after = extra.get("retry_after_s")
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(body=msgspec.json.encode(body), status=status, content_type=PROBLEM_CONTENT_TYPE,
                        headers=headers)


def request_id_of(request: web.Request) -> str | None:
    """The id `request_ids` gave this request (None before that middleware ran)."""
    return request.get(_REQUEST_ID_KEY)


@web.middleware
async def request_ids(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> (
    web.StreamResponse
):
    """Every answer carries `X-Request-Id`: the caller's when it sent a well-formed one (a gateway's), else a new
    UUID. The id is in every log line written while the request is handled, and in every problem body."""
    incoming = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = incoming if REQUEST_ID_PATTERN.fullmatch(incoming) else str(uuid.uuid4())
    request[_REQUEST_ID_KEY] = request_id
    log_token = REQUEST_ID.set(request_id)
    # With tracing off there is no span, but a caller's `traceparent` still names the trace it is part of.
    sent = _TRACEPARENT.fullmatch(request.headers.get("traceparent", "").strip().lower())
    sent_trace_id = sent.group(1) if sent and sent.group(1) != "0" * 32 else None
    # The problem's `instance` names this occurrence by its request id (not the path: that can echo what the caller
    # probed, and a path decoded by the router need not be a valid URI reference).
    current_token = _CURRENT.set((request_id, PROBLEM_INSTANCE_PREFIX + request_id, sent_trace_id))
    try:
        response = await handler(request)
        if response.status >= 400:
            log.info("http.problem", extra={"status": response.status, "method": request.method,
                                            "path": request.path})
        return response
    finally:
        _CURRENT.reset(current_token)
        REQUEST_ID.reset(log_token)


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the header goes on every answer, a WebSocket handshake's and a streamed one's too
    (their headers are sent inside the handler, before the middleware sees the response)."""
    request_id = request_id_of(request)
    if request_id is not None and REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = request_id


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


# One rendering at a time. Rendering is Python over every series (the leader's per-client and per-tenant gauges:
# 10,000+ series with a fleet of 10,000), which on the event loop held a click's NOTIFY and high pass for
# 250-950 ms a scrape (docs/benchmarks.md, "What held the coordinator's event loop, and the hub's"). In a worker
# thread the loop gets the interpreter back every switch interval (5 ms) while a scrape renders.
_METRICS_RENDERING = web.AppKey("metrics_rendering", asyncio.Lock)


async def metrics_handler(request: web.Request) -> web.Response:
    async with request.app[_METRICS_RENDERING]:
        body = await asyncio.to_thread(exposition)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_ops_routes(app: web.Application) -> None:
    """`/healthz` (alive), `/readyz` (dependencies reachable), `/metrics` (Prometheus)."""
    app.setdefault(READINESS_CHECKS, {})  # type: ignore[arg-type]
    app[_METRICS_RENDERING] = asyncio.Lock()
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
    app = web.Application(middlewares=[request_ids, red_metrics, json_errors], client_max_size=max_body_bytes)
    app.on_response_prepare.append(_stamp_request_id)
    app[READINESS_CHECKS] = {}
    add_ops_routes(app)
    return app
