"""The coordinator's /api/ops/* answer only to OPS_API_TOKEN (403 when none is configured, open in DEV_MODE);
/metrics, /healthz and /readyz stay open. The real app, on real Postgres and RabbitMQ."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from libs.config import Settings

TOKEN = "coordinator-ops-token-0123456789abcdef"
OPS_PATHS = ("/api/ops/dispatch/status", "/api/ops/tasks/1/explain", "/api/ops/no-such-route", "/api/ops")


@contextlib.asynccontextmanager
async def coordinator(settings: Settings) -> AsyncIterator[TestClient[Any, Any]]:
    from services.dispatch_coordinator.main import build

    client: TestClient[Any, Any] = TestClient(TestServer(build(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def test_ops_routes_answer_only_to_the_token_and_probes_stay_open(settings: Settings) -> None:
    async with coordinator(replace(settings, ops_api_token=TOKEN)) as http:
        for path in OPS_PATHS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                            {"Authorization": TOKEN}):
                resp = await http.get(path, headers=headers)
                body = await resp.json()
                assert (resp.status, body.get("error")) == (401, "unauthorized"), (path, headers, body)
                assert TOKEN not in await resp.text()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status = await http.get("/api/ops/dispatch/status", headers=auth)
        assert status.status == 200 and "this_instance" in await status.json()
        missing = await http.get("/api/ops/tasks/999999/explain", headers=auth)
        assert (missing.status, (await missing.json())["error"]) == (404, "not_found")
        unknown = await http.get("/api/ops/no-such-route", headers=auth)
        assert unknown.status == 404
        for path in ("/metrics", "/healthz", "/readyz"):
            assert (await http.get(path)).status == 200, path


async def test_without_a_token_ops_routes_are_disabled_except_in_dev_mode(settings: Settings) -> None:
    async with coordinator(replace(settings, ops_api_token="", dev_mode=False)) as http:
        for path in OPS_PATHS:
            resp = await http.get(path, headers={"Authorization": "Bearer anything"})
            body = await resp.json()
            assert (resp.status, body.get("error")) == (403, "ops_api_disabled") and "OPS_API_TOKEN" in body["message"]
        assert (await http.get("/healthz")).status == 200
    async with coordinator(replace(settings, ops_api_token="", dev_mode=True)) as http:
        resp = await http.get("/api/ops/dispatch/status")
        assert resp.status == 200 and "this_instance" in await resp.json()
