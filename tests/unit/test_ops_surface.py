"""The operational surface: the coordinator's ops token rule, /readyz that tells nothing of its failures, and JSON
405s that keep their Allow header. No network: handlers run on mocked requests."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from prometheus_client import REGISTRY, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.config import ConfigError, Settings
from libs.http import ApiError, add_readiness_check, json_errors, make_app, readyz
from services.dispatch_coordinator.main import build, check_ops_token

TOKEN = "ops-token-0123456789abcdefghijklmnopqrstuvwxyz"


@pytest.mark.parametrize(("authorization", "allowed"), [
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),
    (f"Bearer  {TOKEN} ", True),
    ("", False),
    ("Bearer", False),
    ("Bearer ", False),
    (f"Basic {TOKEN}", False),
    (f"Bearer {TOKEN[:-1]}", False),
    (f"Bearer {TOKEN}x", False),
    (TOKEN, False),
])
def test_with_a_token_configured_only_that_bearer_token_passes(authorization: str, allowed: bool) -> None:
    for dev_mode in (False, True):  # DEV_MODE never weakens a configured token
        settings = Settings(ops_api_token=TOKEN, dev_mode=dev_mode)
        if allowed:
            check_ops_token(settings, authorization)
            continue
        with pytest.raises(ApiError) as refused:
            check_ops_token(settings, authorization)
        assert (refused.value.status, refused.value.code) == (401, "unauthorized")
        assert TOKEN not in refused.value.message


def test_the_coordinator_app_is_not_built_with_a_short_or_placeholder_token() -> None:
    for token in ("x", "REPLACE_ME_WITH_OUTPUT_OF_OPENSSL_RAND_HEX_32"):
        with pytest.raises(ConfigError, match="OPS_API_TOKEN"):
            build(Settings(ops_api_token=token))
    assert isinstance(build(Settings(ops_api_token="x", dev_mode=True)), web.Application)
    assert isinstance(build(Settings(ops_api_token=TOKEN)), web.Application)


def test_without_a_token_the_ops_api_is_disabled_unless_dev_mode() -> None:
    with pytest.raises(ApiError) as refused:
        check_ops_token(Settings(ops_api_token=""), f"Bearer {TOKEN}")
    assert (refused.value.status, refused.value.code) == (403, "ops_api_disabled")
    assert "OPS_API_TOKEN" in refused.value.message
    check_ops_token(Settings(ops_api_token="", dev_mode=True), "")


async def test_readyz_answers_ok_or_failing_and_logs_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app()

    async def fine() -> None:
        return None

    async def broken() -> None:
        raise ConnectionError('connection to "db.internal.example" failed: postgresql://svc:hunter2@db/monitoring; '
                              "SELECT secret FROM tenants")

    add_readiness_check(app, "postgres", broken)
    add_readiness_check(app, "rabbitmq", fine)
    with caplog.at_level(logging.WARNING, logger="http"):
        resp = await readyz(make_mocked_request("GET", "/readyz", app=app))
    assert isinstance(resp, web.Response) and resp.status == 503 and isinstance(resp.body, bytes)
    body = json.loads(resp.body)
    assert body == {"status": "unavailable", "checks": {"postgres": "failing", "rabbitmq": "ok"}}
    for leak in ("db.internal", "hunter2", "SELECT", "ConnectionError"):
        assert leak not in resp.body.decode()
    (record,) = [r for r in caplog.records if r.getMessage() == "readiness check failing"]
    assert record.__dict__["check"] == "postgres" and record.__dict__["error_type"] == "ConnectionError"
    assert "db.internal.example" in record.__dict__["error"]


async def test_a_json_405_keeps_the_allow_header() -> None:
    async def handler(_: web.Request) -> web.StreamResponse:
        raise web.HTTPMethodNotAllowed("DELETE", ["GET", "HEAD"])

    resp = await json_errors(make_mocked_request("DELETE", "/readyz"), handler)
    assert isinstance(resp, web.Response) and resp.status == 405 and isinstance(resp.body, bytes)
    assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD"}
    assert resp.content_type == "application/problem+json" and json.loads(resp.body)["error"] == "method_not_allowed"


class _ThreadRecorder(Collector):
    """A collector that notes which thread collects it and how many collections overlap (a scrape renders every
    registered collector); each collection takes a while, as 10,000 series do."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.active = self.most_active = 0
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.threads.append(threading.current_thread())
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        time.sleep(0.05)  # the rendering's work, during which another scrape could start
        with self._lock:
            self.active -= 1
        yield GaugeMetricFamily("ops_surface_render_probe", "A test gauge.", value=1.0)


async def test_metrics_are_rendered_off_the_event_loop_one_scrape_at_a_time() -> None:
    """A scrape renders in a worker thread: rendering the leader's 10,000+ series on the event loop held a click's
    NOTIFY and high pass (docs/benchmarks.md, "What held the coordinator's event loop, and the hub's")."""
    recorder = _ThreadRecorder()
    REGISTRY.register(recorder)
    recorder.threads.clear()  # registering described it, on this thread
    try:
        async with TestClient(TestServer(make_app())) as client:
            answers = await asyncio.gather(*(client.get("/metrics") for _ in range(3)))
            bodies = [await answer.text() for answer in answers]
    finally:
        REGISTRY.unregister(recorder)
    assert all("ops_surface_render_probe 1.0" in body for body in bodies)
    assert len(recorder.threads) == 3
    assert threading.main_thread() not in recorder.threads
    assert recorder.most_active == 1
