"""A call that lost to concurrent work on the same rows (deadlock, lock or statement timeout), or whose database
connection was lost, is a 503 the client can retry, with Retry-After, never a 500."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from libs.http import make_app


async def _answer_to(error: Exception) -> tuple[int, str | None, dict[str, Any]]:
    """What the HTTP error handling answers a POST whose handler raises `error`: status, Retry-After, body."""
    async def handler(_: web.Request) -> web.Response:
        raise error

    app = make_app(max_body_bytes=1024)
    app.router.add_post("/x", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/x", json={})
        return resp.status, resp.headers.get("Retry-After"), await resp.json()


@pytest.mark.parametrize("error", [pg_errors.DeadlockDetected, pg_errors.SerializationFailure,
                                   pg_errors.LockNotAvailable, pg_errors.QueryCanceled])
async def test_contention_is_a_retryable_503(error: type[Exception]) -> None:
    status, retry_after, body = await _answer_to(error("deadlock detected"))
    assert status == 503 and retry_after == "1"
    assert body["error"] == "busy" and "retry" in body["message"]


@pytest.mark.parametrize("error", [psycopg.OperationalError("server closed the connection unexpectedly"),
                                   PoolTimeout("couldn't get a connection after 5.00 sec")])
async def test_a_lost_database_is_a_retryable_503(error: Exception) -> None:
    status, retry_after, body = await _answer_to(error)
    assert status == 503 and retry_after == "1"
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
