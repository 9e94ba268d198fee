"""Tracing: configuration from OTEL_*, the helpers off (no-ops) and on (parents, links, traceparents), trace ids
in the JSON logs, the trace sink's OTLP decoding and `monitorctl trace`'s tree."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from libs.config import ConfigError
from libs.telemetry import tracing
from libs.telemetry.logging import JsonFormatter
from tests.support.tracing import memory_tracing
from tools.monitorctl.cmd_trace import traces_of_request, tree_lines
from tools.trace_sink import records_from_request

ROOT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": " Console "}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_the_environment_decides_whether_tracing_is_on(env: dict[str, str], expected: list[str]) -> None:
    assert tracing.exporter_names(env) == expected


def test_unknown_exporters_and_protocols_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="jaeger"):
        tracing.exporter_names({"OTEL_TRACES_EXPORTER": "jaeger"})
    assert tracing.otlp_protocol({}) == "http/protobuf"
    assert tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    with pytest.raises(ConfigError, match="http/json"):
        tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_off_by_default_and_every_helper_is_a_no_op() -> None:
    assert tracing.configure_tracing("collect-now-api", environ={}) is False
    assert not tracing.enabled()
    with tracing.span("anything", parent=tracing.context_from_traceparent(ROOT)) as span:
        assert not span.get_span_context().is_valid
        assert tracing.current_traceparent() is None
    assert tracing.start_span("anything") is None
    headers: dict[str, object] = {}
    tracing.inject(headers)
    assert headers == {}
    assert tracing.client_trace_configs() == []
    with tracing.consume_batch("batch", "one", [{"traceparent": ROOT}]) as batch:
        assert not batch.get_span_context().is_valid


def test_traceparents_are_parsed_strictly() -> None:
    assert tracing.context_from_traceparent(None) is None
    assert tracing.context_from_traceparent("00-zz-yy-01") is None
    assert tracing.context_from_headers({"traceparent": ROOT.encode()}) is not None
    assert tracing.context_from_headers({"tenant_id": 3}) is None
    ctx = tracing.context_from_traceparent(ROOT)
    assert ctx is not None
    assert tracing.traceparent_of(trace.get_current_span(ctx)) == ROOT


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    with memory_tracing(monkeypatch, "unit") as exporter:
        yield exporter


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_span_continues_a_remote_traceparent(spans: InMemorySpanExporter) -> None:
    with tracing.span("child", parent=tracing.context_from_traceparent(ROOT), attributes={
            tracing.TENANT_ID: 7, "monitoring.none": None}) as span:
        own = tracing.current_traceparent()
        tracing.set_attributes(collect_request_id="r-1")
    child = _by_name(spans)["child"]
    assert child.context is not None and child.parent is not None
    assert format(child.context.trace_id, "032x") == ROOT.split("-")[1]
    assert format(child.parent.span_id, "016x") == ROOT.split("-")[2]
    assert own == tracing.traceparent_of(span) and own != ROOT
    assert child.attributes is not None
    assert dict(child.attributes) == {tracing.TENANT_ID: 7, tracing.COLLECT_REQUEST_ID: "r-1"}


async def test_traced_coroutines_and_root_spans(spans: InMemorySpanExporter) -> None:
    @tracing.traced("pass", root=True)
    async def a_pass() -> str | None:
        return tracing.current_traceparent()

    with tracing.span("outer"):
        inner = await a_pass()
    found = _by_name(spans)
    assert found["pass"].parent is None, "a root span ignores the current one"
    assert inner is not None and inner.split("-")[1] != format(found["outer"].context.trace_id, "032x")


def test_a_batch_span_links_every_message_and_each_message_gets_its_own(spans: InMemorySpanExporter) -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    with tracing.consume_batch("ingest.batch", "ingest.result", [{"traceparent": ROOT}, None, {"traceparent": other}],
                               attributes={tracing.SHARD: 3},
                               message_attributes=[{"messaging.message.id": "a"}, {}, {"messaging.message.id": "c"}]):
        pass
    finished = spans.get_finished_spans()
    batch = next(s for s in finished if s.name == "ingest.batch")
    singles = [s for s in finished if s.name == "ingest.result"]
    assert batch.parent is not None and format(batch.parent.span_id, "016x") == ROOT.split("-")[2]
    assert {format(lk.context.trace_id, "032x") for lk in batch.links} == {ROOT.split("-")[1], "1" * 32}
    assert sorted(format(s.context.trace_id, "032x") for s in singles if s.context) == sorted(
        [ROOT.split("-")[1], "1" * 32])
    for single in singles:
        assert [lk.context.span_id for lk in single.links] == [batch.context.span_id if batch.context else 0]
        assert single.attributes is not None and single.attributes[tracing.SHARD] == 3


def test_log_lines_carry_the_current_trace_and_span() -> None:
    formatter = JsonFormatter("unit")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    assert "trace_id" not in json.loads(formatter.format(record))
    context = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=False, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(context)):
        line = json.loads(formatter.format(record))
    assert line["trace_id"] == format(0xABC, "032x") and line["span_id"] == format(0xDEF, "016x")


def test_the_sink_decodes_otlp_and_monitorctl_draws_the_tree(spans: InMemorySpanExporter) -> None:
    with tracing.span("POST /collect-now", kind=tracing.SpanKind.SERVER, parent=tracing.context_from_traceparent(ROOT)):
        with tracing.span("collect_now", attributes={tracing.COLLECT_REQUEST_ID: "req-1"}):
            with tracing.span("outbox.publish", kind=tracing.SpanKind.PRODUCER):
                pass
    with tracing.span("unrelated"):
        pass
    body = encode_spans(spans.get_finished_spans()).SerializeToString()
    records = records_from_request(body)
    assert {r["name"]: r["kind"] for r in records}["outbox.publish"] == "producer"
    assert all(r["service"] == "unit" for r in records)
    [found] = traces_of_request(records, "req-1")
    assert {s["name"] for s in found} == {"POST /collect-now", "collect_now", "outbox.publish"}
    lines = tree_lines(found)
    assert lines[1].startswith("  unit  POST /collect-now")
    assert lines[2].startswith("    unit  collect_now") and "collect_request_id=req-1" in lines[2]
    assert lines[3].startswith("      unit  outbox.publish")
