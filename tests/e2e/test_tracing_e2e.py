"""One click, one trace: real collect-now-api, dispatch-coordinator, outbox-pump, dispatch-hub,
ingest-shard-workers and projection-worker processes export spans (OTLP/HTTP) to a trace sink run by the test;
a simulated desktop client takes the task. The click carries a traceparent the test chose; every service's
spans must join that trace, each a child of a span in it (or of the test's own root)."""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import one
from tests.support.stack import DISPATCH_SERVICES, running_stack
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions
from tools.monitorctl.cmd_trace import traces_of_request, tree_lines
from tools.trace_sink import TraceSink, read_spans

pytestmark = pytest.mark.timeout(120)

SERVICES = (*DISPATCH_SERVICES, "projection-worker")
# (service, span name) every click's trace must hold.
EXPECTED = {
    ("collect-now-api", "POST /api/tenant/monitoring/brands/{brand_id}/collect-now"),
    ("collect-now-api", "collect_now"),
    ("dispatch-coordinator", "dispatch.collect_request"),
    ("dispatch-hub", "hub.deliver"),
    ("dispatch-hub", "hub.lease"),
    ("dispatch-hub", "hub.result"),
    ("dispatch-hub", "hub.result.publish"),
    ("ingest-shard-workers", "ingest.batch"),
    ("ingest-shard-workers", "ingest.result"),
    ("outbox-pump", "outbox.publish"),
    ("projection-worker", "projection.event"),
}
# Not required: the event's `projection.rebuild` child. When the worker's periodic sweep claims the key before the
# event arrives (the pump publishes an event written without NOTIFY at its next poll), the sweep rebuilds it in
# a trace of its own and the event finds nothing left to do.


def tracing_env(endpoint: str) -> dict[str, str | int]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": 100,
            "OTEL_TRACES_SAMPLER": "always_on", "HUB_HEARTBEAT_FLUSH_S": "0.3"}


async def test_a_click_is_one_trace_from_the_gateway_to_the_projection(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, platforms=("openai",), due=False)
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    trace_id, gateway_span = secrets.token_hex(16), secrets.token_hex(8)
    out = tmp_path / "traces.jsonl"
    async with TraceSink(out) as sink, running_stack(settings, tmp_path, services=SERVICES,
                                                     **tracing_env(sink.endpoint)) as stack:
        # No idle polling: the task is leased because its task_available arrived, with that event's traceparent.
        desktop = SimClient(SimOptions(hub_url=stack.hub_url, token=client["token"], timings=TIMING_PROFILES["fast"],
                                       heartbeat_interval_s=1.0, idle_poll_s=None, seed=3))
        async with desktop:
            await eventually(desktop.connected.is_set, timeout=15, message="the desktop client said hello")
            async with aiohttp.ClientSession() as http, http.post(
                    f"{stack.api_url}/api/tenant/monitoring/brands/{tenant['brands'][0]['brand_id']}/collect-now",
                    json={"target_client_id": client["client_id"]},
                    headers={"Authorization": f"Bearer {stack.jwt(tenant)}",
                             "traceparent": f"00-{trace_id}-{gateway_span}-01"}) as resp:
                accepted: dict[str, Any] = await resp.json()
                assert resp.status == 202, accepted
            request_id = accepted["request_id"]

            async def succeeded() -> bool:
                row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s",
                                uuid.UUID(request_id))
                return row["status"] == "succeeded"

            await eventually(succeeded, timeout=40, message=f"the request succeeded\n{stack.logs()}")

            def the_trace() -> list[dict[str, Any]] | None:
                """The trace once every expected span and every parent is in: each process exports in its own
                batches, so a child can reach the sink before its parent (two test files at once make it likelier)."""
                spans = [s for s in read_spans(out) if s["trace_id"] == trace_id]
                ids = {s["span_id"] for s in spans} | {gateway_span}
                complete = all(s["parent_span_id"] in ids for s in spans)
                return spans if complete and EXPECTED <= {(s["service"], s["name"]) for s in spans} else None

            try:
                spans = await eventually(the_trace, timeout=20, interval=0.2, message="every service's spans")
            except AssertionError:
                found = sorted({(s["service"], s["name"]) for s in read_spans(out) if s["trace_id"] == trace_id})
                missing = sorted(EXPECTED - set(found))
                raise AssertionError(f"missing {missing}; found {found}\n{stack.logs()}") from None
            logs = stack.procs["collect-now-api"].logs()

    by_id = {s["span_id"]: s for s in spans}
    for span in spans:  # a tree: every parent is in the trace, or is the gateway's span the test made up
        assert span["parent_span_id"] in by_id or span["parent_span_id"] == gateway_span, span
    server = next(s for s in spans if s["name"].startswith("POST /api/tenant"))
    assert server["parent_span_id"] == gateway_span and server["kind"] == "server"
    click = next(s for s in spans if s["name"] == "collect_now")
    assert click["attributes"]["monitoring.collect_request_id"] == request_id
    assert click["attributes"]["monitoring.tenant_id"] == tenant["tenant_id"]
    dispatch = next(s for s in spans if s["name"] == "dispatch.collect_request")
    assert dispatch["parent_span_id"] == click["span_id"], "the coordinator continues the click (its request row)"
    assert dispatch["links"], "and links to the pass that served it"
    lease = next(s for s in spans if s["name"] == "hub.lease")
    # The tenant is on the desktop_tasks path (rollout 100): the dispatch and the lease name it (the legacy path's
    # spans: tests/integration/test_hub_tracing_owner.py).
    assert dispatch["attributes"]["monitoring.execution_owner"] == "desktop_tasks"
    assert lease["attributes"]["monitoring.execution_owner"] == "desktop_tasks"
    lease_call = by_id[lease["parent_span_id"]]
    assert lease_call["kind"] == "server" and by_id[lease_call["parent_span_id"]]["name"] == "hub.deliver"
    # No answer text or token in any attribute.
    assert not [s for s in spans for v in s["attributes"].values() if "dct_" in str(v) or "bench" in str(v)]
    # The JSON log lines of a traced step name the trace.
    assert f'"trace_id": "{trace_id}"' in logs
    # What `monitorctl trace REQUEST_ID` prints.
    [found] = traces_of_request(read_spans(out), request_id)
    text = "\n".join(tree_lines(found))
    assert "collect-now-api  collect_now" in text and "dispatch-hub  hub.deliver" in text
