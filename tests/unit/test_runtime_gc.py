"""libs.runtime.freeze_after_startup: what a service allocated while starting is out of the collector's reach."""

from __future__ import annotations

import gc

from aiohttp import web
from aiohttp.test_utils import TestServer

from libs.runtime import freeze_after_startup


async def test_objects_allocated_by_startup_hooks_are_frozen_once_the_app_started() -> None:
    allocated: list[object] = []

    async def start_pools(_: web.Application) -> None:  # registered before, as a service's build() does
        allocated.append({"a connection pool's state": list(range(100))})

    app = web.Application()
    app.on_startup.append(start_pools)
    freeze_after_startup(app)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    server = TestServer(app)
    await server.start_server()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert allocated  # the earlier hook ran first, so its objects are among the frozen ones
        assert all(not gc.is_tracked(x) or x not in gc.get_objects() for x in allocated)
    finally:
        await server.close()
        gc.unfreeze()
