"""HTTP handlers: gateway JWT auth, body decoding at the edge, JSON errors (docs/architecture.md, Interfaces)."""

from __future__ import annotations

import re
import uuid

from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from libs.auth import AuthError, GatewayVerifier, KeyUnavailable, TenantPrincipal
from libs.clock import SYSTEM_CLOCK, Clock
from libs.config import Settings
from libs.contracts.http import CollectNowRequest
from libs.db.pool import Conn
from libs.dispatch_settings import SettingsCache
from libs.http import ApiError, json_response, read_body
from libs.runtime import SETTINGS
from services.collect_now_api.service import IdempotencyKey, TenantGate, collect_now, request_status

POOL = web.AppKey("pool", AsyncConnectionPool[Conn])

MAX_COLLECT_NOW_BODY_BYTES = 64 * 1024
# The request status's task list, a page at a time.
DEFAULT_TASK_PAGE = 100
MAX_TASK_PAGE = 500
# A cursor is the decimal of the previous page's last monitor_task_id; clients pass it back unchanged.
CURSOR_PATTERN = "^[0-9]{1,19}$"
MAX_ID = 2**63 - 1
# `Idempotency-Key`: 1 to 255 visible ASCII characters (a UUID is what we suggest).
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_PATTERN = "^[!-~]{1,255}$"
_IDEMPOTENCY_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN.strip("^$"))
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


# Dispatch settings re-read at most once a second, in the background: hot reload, no query per click.
SETTINGS_CACHE = web.AppKey("dispatch_settings_cache", SettingsCache)
# The clock a click's business dates are reckoned by (libs/clock.py); the system clock when the app has none.
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
# The tenant gate (clicks in flight per tenant, their waits), sized from the settings once, at start-up.
GATE: web.AppKey[TenantGate] = web.AppKey("tenant_gate")


# How gateway tokens are checked (keys, aud, iss, lifetime), built from the settings once, at start-up.
VERIFIER: web.AppKey[GatewayVerifier] = web.AppKey("gateway_verifier")


def install_tenant_gate(app: web.Application, settings: Settings) -> None:
    app[GATE] = TenantGate.from_settings(settings)


def install_verifier(app: web.Application, settings: Settings) -> None:
    """Fail closed: no real gateway key, or (outside DEV_MODE) no audience and issuer to check, and the service does
    not start (ConfigError)."""
    app[VERIFIER] = settings.gateway_verifier()


async def authenticate(request: web.Request) -> TenantPrincipal:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "send the gateway token as `Authorization: Bearer <jwt>`")
    try:
        return await request.app[VERIFIER].verify(token.strip())
    except AuthError as exc:
        raise ApiError(401, exc.code, exc.message) from exc
    except KeyUnavailable as exc:
        raise ApiError(503, "gateway_keys_unavailable", "the gateway's signing keys could not be fetched to check "
                       "the token; retry", retry_after_s=5) from exc


def _int_path(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    value = _digits(raw)
    if value is None or not 0 < value <= MAX_ID:
        raise ApiError(400, "invalid_field", f"{name} must be a positive integer, got {raw[:40]!r}", name)
    return value


def _digits(raw: str) -> int | None:
    """An ASCII decimal of at most 19 digits, else None (no sign, space, `_` or other scripts' digits, which
    `int()` would take)."""
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else None


def _uuid(raw: str) -> uuid.UUID | None:
    """The 8-4-4-4-12 hex form only (`uuid.UUID` also takes braces, `urn:uuid:`, bare hex, `+` and `_`)."""
    return uuid.UUID(raw) if _UUID.fullmatch(raw) else None


def _page(request: web.Request) -> tuple[int, int]:
    """(limit, after_task_id) from `?limit=` (1..500, default 100) and `?cursor=` (a previous `next_cursor`)."""
    query = request.query
    limit = DEFAULT_TASK_PAGE
    if "limit" in query:
        parsed = _digits(query["limit"])
        if parsed is None or not 1 <= parsed <= MAX_TASK_PAGE:
            raise ApiError(400, "invalid_field", f"limit must be an integer from 1 to {MAX_TASK_PAGE}, "
                           f"got {query['limit'][:40]!r}", "limit")
        limit = parsed
    after = 0
    if "cursor" in query:
        parsed = _digits(query["cursor"])
        if parsed is None:
            raise ApiError(400, "invalid_field", "cursor is not one this API issued: pass a response's "
                           "`next_cursor` unchanged", "cursor")
        after = min(parsed, MAX_ID)  # past the largest id: an empty last page
    return limit, after


async def post_collect_now(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    brand_id = _int_path(request, "brand_id")
    body = await read_body(request, CollectNowRequest, max_bytes=MAX_COLLECT_NOW_BODY_BYTES, allow_empty=True)
    idempotency = _idempotency_key(request, brand_id, body)
    pool = request.app[POOL]
    settings = await request.app[SETTINGS_CACHE].get()
    accepted = await collect_now(pool, principal, brand_id, body, settings, gate=request.app.get(GATE),
                                 clock=request.app.get(CLOCK, SYSTEM_CLOCK), idempotency=idempotency)
    answer = accepted.answer()
    # An Idempotency-Key's replay says so in a header: its body is the first answer's, unchanged.
    headers = {"Idempotent-Replayed": "true"} if accepted.stored is not None else None
    return web.Response(body=answer.body, status=answer.status, content_type="application/json", headers=headers)


def _idempotency_key(request: web.Request, brand_id: int, body: CollectNowRequest) -> IdempotencyKey | None:
    raw = request.headers.getall(IDEMPOTENCY_KEY_HEADER, [])
    if not raw:
        return None
    if len(raw) > 1 or not _IDEMPOTENCY_KEY.fullmatch(raw[0]):
        raise ApiError(400, "invalid_field", "Idempotency-Key must be one header of 1 to 255 visible ASCII "
                       "characters (a UUID is a good key)", IDEMPOTENCY_KEY_HEADER)
    ttl_hours = request.app[SETTINGS].collect_now_idempotency_key_ttl_hours
    return IdempotencyKey.of(raw[0], brand_id, body, ttl_hours=ttl_hours)


async def get_collect_request(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    raw = request.match_info["request_id"]
    request_id = _uuid(raw)
    if request_id is None:
        raise ApiError(400, "invalid_field", f"request_id must be a UUID, got {raw[:40]!r}", "request_id")
    limit, after_task_id = _page(request)
    async with request.app[POOL].connection() as conn:
        status = await request_status(conn, principal, request_id, limit=limit, after_task_id=after_task_id)
    return json_response(status)
