"""A call that lost to concurrent work on the same rows (deadlock, lock or statement timeout), or whose database
connection was lost, is a 503 the client can retry, with Retry-After, never a 500."""

from __future__ import annotations

import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from libs.http import make_app


@pytest.mark.parametrize("error", [pg_errors.DeadlockDetected, pg_errors.SerializationFailure,
                                   pg_errors.LockNotAvailable, pg_errors.QueryCanceled])
async def test_contention_is_a_retryable_503(error: type[Exception]) -> None:
    async def handler(_: web.Request) -> web.Response:
        raise error("deadlock detected")

    app = make_app(max_body_bytes=1024)
    app.router.add_post("/x", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/x", json={})
        body = await resp.json()
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert body["error"] == "busy" and "retry" in body["message"]


@pytest.mark.parametrize("error", [psycopg.OperationalError("server closed the connection unexpectedly"),
                                   PoolTimeout("couldn't get a connection after 5.00 sec")])
async def test_a_lost_database_is_a_retryable_503(error: Exception) -> None:
    async def handler(_: web.Request) -> web.Response:
        raise error

    app = make_app(max_body_bytes=1024)
    app.router.add_post("/x", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/x", json={})
        body = await resp.json()
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert body["error"] == "database_unavailable" and "closed" not in body["message"]


async def test_other_errors_stay_internal() -> None:
    async def handler(_: web.Request) -> web.Response:
        raise RuntimeError("boom")

    app = make_app(max_body_bytes=1024)
    app.router.add_get("/x", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/x")
        body = await resp.json()
    assert resp.status == 500 and body["error"] == "internal_error" and "boom" not in body["message"]
