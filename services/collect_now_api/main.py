"""collect-now-api: composition root (pool, routes, OpenAPI document)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from libs.config import Settings
from libs.db.pool import PREPARE_ON_FIRST_USE
from libs.dispatch_settings import SettingsCache
from libs.http import json_response, make_app
from libs.runtime import SETTINGS, Lifetime, Service, background
from services.collect_now_api import queries as q
from services.collect_now_api.handlers import (
    POOL,
    SETTINGS_CACHE,
    get_collect_request,
    install_tenant_gate,
    install_verifier,
    post_collect_now,
)
from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH, openapi_document
from services.collect_now_api.service import purge_idempotency_keys

SERVICE = Service("collect-now-api")
log = logging.getLogger("collect_now")


async def get_openapi(_: web.Request) -> web.Response:
    return json_response(openapi_document())


def build(settings: Settings) -> web.Application:
    app = SERVICE.app(settings, start, http=make_app(max_body_bytes=settings.max_body_bytes))
    install_verifier(app, settings)  # fail closed: no real gateway key, aud and iss (outside DEV_MODE), no service
    install_tenant_gate(app, settings)
    app.router.add_post(COLLECT_NOW_PATH, post_collect_now)
    app.router.add_get(REQUEST_STATUS_PATH, get_collect_request)
    app.router.add_get("/openapi.json", get_openapi)
    background(app, "idempotency-key-purge", _purge_loop(app))
    return app


def _purge_loop(app: web.Application) -> Callable[[asyncio.Event], Awaitable[None]]:
    """Every COLLECT_NOW_IDEMPOTENCY_PURGE_S, the expired Idempotency-Key rows are deleted (each replica purges;
    they skip each other's rows). A database that is away is waited out, not a reason to stop."""
    async def loop(stop: asyncio.Event) -> None:
        interval = app[SETTINGS].collect_now_idempotency_purge_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set() or POOL not in app:
                continue
            try:
                deleted = await purge_idempotency_keys(app[POOL])
            except Exception as exc:
                log.warning("idempotency key purge failed; trying again later",
                            extra={"error_type": type(exc).__name__})
                continue
            if deleted:
                log.info("idempotency keys purged", extra={"deleted": deleted})
    return loop


async def start(life: Lifetime) -> None:
    settings = life.settings
    # Sized so requests never queue for a connection: one per in-flight click plus status polls.
    pool = await life.pool(min_size=2, max_size=max(4, min(settings.db_pool_max, 6)),
                           prepare_threshold=PREPARE_ON_FIRST_USE,  # clicks are rare: prepare on first use
                           warm_up=q.WARM_UP)
    life.app[POOL] = pool
    life.app[SETTINGS_CACHE] = SettingsCache(pool)


def main() -> None:
    SERVICE.serve(build)
