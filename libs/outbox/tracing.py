"""W3C trace context for outbox rows and AMQP headers."""

from __future__ import annotations

import re
import secrets

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def current_traceparent() -> str:
    """The active span's traceparent, or a fresh root one so every event can be followed."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    value = carrier.get("traceparent")
    if value and TRACEPARENT.match(value):
        return value
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def context_from_traceparent(traceparent: str | None) -> trace.Span:
    """A non-recording span carrying the remote context, for continuing a trace in a consumer."""
    if not traceparent:
        return trace.INVALID_SPAN
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return trace.get_current_span(ctx)
