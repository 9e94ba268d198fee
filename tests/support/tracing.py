"""Tracing on in the test process, into memory, without installing a global tracer provider (which a process
can set only once): `libs.telemetry.tracing` is pointed at a private provider for the test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.telemetry import tracing


@contextmanager
def memory_tracing(monkeypatch: pytest.MonkeyPatch, service: str = "tests") -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing._state, "enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer(service))
    try:
        yield exporter
    finally:
        provider.shutdown()


def finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    """(trace id, span id) as a traceparent spells them."""
    assert span.context is not None
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")
