"""collect-now-api: composition root (pool, routes, OpenAPI document)."""

from __future__ import annotations

from aiohttp import web

from libs.config import Settings
from libs.db.pool import PREPARE_ON_FIRST_USE
from libs.dispatch_settings import SettingsCache
from libs.http import json_response, make_app
from libs.runtime import Lifetime, Service
from services.collect_now_api import queries as q
from services.collect_now_api.handlers import (
    POOL,
    SETTINGS_CACHE,
    get_collect_request,
    install_tenant_gate,
    post_collect_now,
)
from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH, openapi_document

SERVICE = Service("collect-now-api")


async def get_openapi(_: web.Request) -> web.Response:
    return json_response(openapi_document())


def build(settings: Settings) -> web.Application:
    settings.jwt_key()  # fail closed: no real gateway key (outside DEV_MODE), no service
    app = SERVICE.app(settings, start, http=make_app(max_body_bytes=settings.max_body_bytes))
    install_tenant_gate(app, settings)
    app.router.add_post(COLLECT_NOW_PATH, post_collect_now)
    app.router.add_get(REQUEST_STATUS_PATH, get_collect_request)
    app.router.add_get("/openapi.json", get_openapi)
    return app


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
