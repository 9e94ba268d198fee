"""RED metrics of the HTTP APIs on the real dispatch-hub app: requests by route template, method and status
(error answers and unknown paths included, one series for every unmatched path), durations, WebSocket
sessions counted once as their upgrade."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.telemetry import metrics
from tests.support.desktop import running_hub


def count(route: str, method: str, status: int) -> float:
    return metrics.http_requests_total.value(service="dispatch-hub", route=route, method=method, status=status)


async def test_requests_are_counted_by_route_template_method_and_status(settings: Settings,
                                                                        pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed: dict[str, Any] = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, due=False)
    token = seed["tenants"][0]["clients"][0]["token"]
    lease, extend = "/api/desktop/monitor/lease", "/api/desktop/tasks/{task_id}/extend"
    before = {k: count(*k) for k in [(lease, "POST", 200), (lease, "POST", 401), (extend, "POST", 404),
                                     ("unmatched", "GET", 404), ("/api/desktop/ws", "GET", 101)]}
    metrics.set_service_name("dispatch-hub")  # what the hub's entry point does (libs/runtime.serve)
    async with running_hub(settings) as hub:
        async with aiohttp.ClientSession(str(hub.make_url(""))) as http:
            auth = {"Authorization": f"Bearer {token}"}
            for _ in range(3):
                async with http.post(lease, json={}, headers=auth) as resp:
                    assert resp.status == 200
            async with http.post(lease, json={}) as resp:
                assert resp.status == 401
            async with http.post("/api/desktop/tasks/not-a-uuid/extend", json={}, headers=auth) as resp:
                assert resp.status == 404
            for path in ("/nope", "/wp-admin", "/.env"):
                async with http.get(path) as resp:
                    assert resp.status == 404
            ws = await http.ws_connect("/api/desktop/ws", headers=auth)
            assert (await ws.receive_json(timeout=5))["type"] == "hello"
            await ws.close()
    metrics.set_service_name("unknown")
    after = {k: count(*k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {
        (lease, "POST", 200): 3, (lease, "POST", 401): 1, (extend, "POST", 404): 1, ("unmatched", "GET", 404): 3,
        ("/api/desktop/ws", "GET", 101): 1}
    text = metrics.exposition().decode()
    assert 'http_request_duration_seconds_count{method="POST",route="/api/desktop/monitor/lease",' \
           'service="dispatch-hub"}' in text
    ws_durations = REGISTRY.get_sample_value("http_request_duration_seconds_count", {
        "service": "dispatch-hub", "route": "/api/desktop/ws", "method": "GET"})
    assert ws_durations is None  # a session's lifetime is not a request duration
    assert metrics.websocket_messages_total.value(direction="out", kind="text") >= 1
