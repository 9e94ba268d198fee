"""Spans name the execution path of their task (`monitoring.execution_owner`, docs/legacy-path.md): the hub's
lease, extend, cancel and result spans on a legacy lease and on a desktop_tasks execution, against the running hub
with tracing into memory; and the coordinator's per-click dispatch span."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace import ReadableSpan
from psycopg_pool import AsyncConnectionPool

from libs.db.pool import Conn
from libs.telemetry import tracing
from services.dispatch_coordinator.dispatcher import _click_spans
from tests.integration.test_hub_api import http, hub, lease, post, seed
from tests.integration.test_hub_legacy_leases import offer_legacy
from tests.support.desktop import dispatch_execution
from tests.support.tracing import finished, memory_tracing

__all__ = ["http", "hub", "seed"]  # the fixtures of test_hub_api, shared


def _owner(span: ReadableSpan) -> Any:
    assert span.attributes is not None
    return span.attributes.get(tracing.EXECUTION_OWNER)


async def test_hub_spans_carry_the_execution_owner_on_both_paths(
        hub: TestServer, http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    with memory_tracing(monkeypatch, "dispatch-hub") as exporter:
        # The legacy path: lease, extend, result; a second lease cancelled.
        await offer_legacy(pool, tenant, client["client_id"], question_index=0)
        (task,) = await lease(http, hub, client["token"])
        assert task["execution_owner"] == "legacy"
        path = f"/api/desktop/tasks/{task['task_id']}"
        status, _ = await post(http, hub, f"{path}/extend", client["token"], {"lease_token": task["lease_token"]})
        assert status == 200
        status, _ = await post(http, hub, f"{path}/result", client["token"], {
            "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "ok"})
        assert status == 202
        await offer_legacy(pool, tenant, client["client_id"], question_index=1)
        (cancelled,) = await lease(http, hub, client["token"])
        status, _ = await post(http, hub, f"/api/desktop/tasks/{cancelled['task_id']}/cancel", client["token"], {
            "lease_token": cancelled["lease_token"], "reason": "browser crashed", "interrupt_generation": 0})
        assert status == 200
        legacy_spans = {name: finished(exporter, name) for name in ("hub.lease", "hub.extend", "hub.result",
                                                                      "hub.cancel")}
        assert {name: [_owner(s) for s in spans] for name, spans in legacy_spans.items()} == {
            "hub.lease": ["legacy", "legacy"], "hub.extend": ["legacy"], "hub.result": ["legacy"],
            "hub.cancel": ["legacy"]}
        exporter.clear()

        # The desktop_tasks path: the same calls.
        async with pool.connection() as conn:
            await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                     client_id=client["client_id"], question_index=2)
        (task,) = await lease(http, hub, client["token"])
        assert task["execution_owner"] == "desktop_tasks"
        path = f"/api/desktop/tasks/{task['task_id']}"
        status, _ = await post(http, hub, f"{path}/extend", client["token"], {"lease_token": task["lease_token"]})
        assert status == 200
        status, _ = await post(http, hub, f"{path}/cancel", client["token"], {
            "lease_token": task["lease_token"], "reason": "browser crashed", "interrupt_generation": 0})
        assert status == 200
        assert {name: [_owner(s) for s in finished(exporter, name)] for name in ("hub.lease", "hub.extend",
                                                                                 "hub.cancel")} == {
            "hub.lease": ["desktop_tasks"], "hub.extend": ["desktop_tasks"], "hub.cancel": ["desktop_tasks"]}
        # A forged token on extend: the span names no path it did not find.
        exporter.clear()
        status, _ = await post(http, hub, f"{path}/extend", client["token"], {"lease_token": "lt.1.forged"})
        assert status == 409
        (refused,) = finished(exporter, "hub.extend")
        assert _owner(refused) is None


def test_the_coordinators_click_span_names_the_path_of_the_tasks_it_dispatched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def row(owner: str, traceparent: str) -> dict[str, Any]:
        return {"collect_traceparent": traceparent, "collect_request_id": uuid.uuid4(), "tenant_id": 7,
                "target_client_id": uuid.uuid4(), "id": uuid.uuid4(), "execution_owner": owner}

    legacy_click = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    mixed_click = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    with memory_tracing(monkeypatch, "dispatch-coordinator") as exporter, tracing.span("dispatch.high_pass"):
        spans = _click_spans([row("legacy", legacy_click), row("legacy", legacy_click),
                              row("desktop_tasks", mixed_click), row("legacy", mixed_click), row("legacy", "")])
        for span in spans.values():
            span.end()
    owners = {format(s.parent.trace_id, "032x"): _owner(s) for s in finished(exporter, "dispatch.collect_request")
              if s.parent is not None}
    assert owners == {legacy_click.split("-")[1]: "legacy", mixed_click.split("-")[1]: "desktop_tasks/legacy"}
