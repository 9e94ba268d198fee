"""HTTP handlers: gateway JWT auth, body decoding at the edge, JSON errors (DESIGN.md §6)."""

from __future__ import annotations

import uuid

from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from libs.auth import AuthError, TenantPrincipal, verify_gateway_jwt
from libs.contracts.http import CollectNowRequest
from libs.db.pool import Conn
from libs.dispatch_settings import SettingsCache
from libs.http import ApiError, json_response, read_body
from libs.runtime import SETTINGS
from services.collect_now_api.service import collect_now, request_status

POOL = web.AppKey("pool", AsyncConnectionPool[Conn])

MAX_COLLECT_NOW_BODY_BYTES = 64 * 1024


# Dispatch settings re-read at most once a second, in the background: hot reload, no query per click.
SETTINGS_CACHE = web.AppKey("dispatch_settings_cache", SettingsCache)


def authenticate(request: web.Request) -> TenantPrincipal:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "send the gateway token as `Authorization: Bearer <jwt>`")
    settings = request.app[SETTINGS]
    key, algorithm = settings.jwt_key()
    try:
        return verify_gateway_jwt(token.strip(), key, algorithm, audience=settings.gateway_jwt_audience or None,
                                  issuer=settings.gateway_jwt_issuer or None,
                                  leeway_s=settings.gateway_jwt_leeway_seconds)
    except AuthError as exc:
        raise ApiError(401, exc.code, exc.message) from exc


def _int_path(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0 or value > 2**63 - 1:
        raise ApiError(400, "invalid_field", f"{name} must be a positive integer, got {raw!r}", name)
    return value


async def post_collect_now(request: web.Request) -> web.Response:
    principal = authenticate(request)
    brand_id = _int_path(request, "brand_id")
    body = await read_body(request, CollectNowRequest, max_bytes=MAX_COLLECT_NOW_BODY_BYTES, allow_empty=True)
    pool = request.app[POOL]
    settings = await request.app[SETTINGS_CACHE].get()
    accepted = await collect_now(pool, principal, brand_id, body, settings)
    return json_response(accepted.response, status=200 if accepted.replay else 202)


async def get_collect_request(request: web.Request) -> web.Response:
    principal = authenticate(request)
    raw = request.match_info["request_id"]
    try:
        request_id = uuid.UUID(raw)
    except ValueError:
        raise ApiError(400, "invalid_field", f"request_id must be a UUID, got {raw!r}", "request_id") from None
    async with request.app[POOL].connection() as conn:
        status = await request_status(conn, principal, request_id)
    return json_response(status)
