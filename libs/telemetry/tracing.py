"""OpenTelemetry tracing, configured from the standard `OTEL_*` environment variables, off unless asked for.

On when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; a comma list) or, left unset, when an OTLP
endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `none`, or
`OTEL_SDK_DISABLED=true`, keeps it off. Off, no SDK tracer provider is installed, nothing is instrumented and
the helpers here return at their first line, so a service pays one boolean test per helper call.

What the SDK and the exporters read themselves: `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (the
resource; the service's own name when neither names it), `OTEL_TRACES_SAMPLER` / `_ARG` (default
`parentbased_always_on`), `OTEL_EXPORTER_OTLP_*` (endpoint, headers, timeout, compression), `OTEL_BSP_*`
(batch export delay and sizes), `OTEL_SPAN_*_LIMIT`. `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` /
`OTEL_EXPORTER_OTLP_PROTOCOL` pick the OTLP transport: `http/protobuf` (the default) or `grpc`.

Context crosses process boundaries as a W3C `traceparent`: HTTP headers (the aiohttp server and client
instrumentations), outbox rows and AMQP headers (by hand, with `opentelemetry.propagate`), and the
`traceparent` field of the events a hub pushes down a WebSocket.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span
from opentelemetry.trace import SpanKind as SpanKind  # re-exported: callers name kinds as tracing.SpanKind

from libs.config import ConfigError

TRACER_NAME = "monitoring-dispatch"

# Span attributes of our own (bounded values only: ids, counts, names; never answer text or tokens).
TENANT_ID = "monitoring.tenant_id"
COLLECT_REQUEST_ID = "monitoring.collect_request_id"
TASK_ID = "monitoring.task_id"
CLIENT_ID = "monitoring.client_id"
SHARD = "monitoring.shard"
LANE = "monitoring.lane"
# The execution path of a span's tasks (docs/legacy-path.md): desktop_tasks, legacy, or both (execution_owners).
EXECUTION_OWNER = "monitoring.execution_owner"

# HTTP routes that get no server span: probes and scrapes every few seconds, and a WebSocket session (a span
# as long as the connection). Used when OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS is not set.
DEFAULT_EXCLUDED_URLS = "/healthz$,/readyz$,/metrics$,/api/desktop/ws$"
EXPORTERS = ("otlp", "console")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
# The SDK's default limit of links per span.
MAX_LINKS = 128

P = ParamSpec("P")
R = TypeVar("R")
_NOOP: contextlib.nullcontext[Span] = contextlib.nullcontext(trace.INVALID_SPAN)


class _State:
    enabled = False
    service = ""


_state = _State()


def enabled() -> bool:
    """Is tracing on in this process?"""
    return _state.enabled


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the environment asks for (empty: tracing stays off)."""
    if _true(environ.get("OTEL_SDK_DISABLED")):
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if "none" in names:
        return []
    unknown = sorted(set(names) - set(EXPORTERS))
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={raw!r}: unknown exporter(s) {unknown}; expected "
                          f"{' | '.join((*EXPORTERS, 'none'))}")
    return list(dict.fromkeys(names))


def otlp_protocol(environ: Mapping[str, str]) -> str:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol not in OTLP_PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported here; expected {' | '.join(OTLP_PROTOCOLS)}")
    return protocol


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    # Imported only when asked for: the gRPC exporter alone loads grpcio.
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        # One JSON object per line on stderr: stdout carries the JSON logs.
        return ConsoleSpanExporter(out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + os.linesep)
    if otlp_protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def configure_tracing(service: str, *, instance_id: str | None = None,
                      environ: Mapping[str, str] | None = None, instrument_http: bool = True) -> bool:
    """Install the SDK tracer provider (batch export to the configured exporters) when the environment turns
    tracing on, and instrument aiohttp servers (`instrument_http`): apps created afterwards get a server span
    per request, its parent taken from the `traceparent` header. Returns whether tracing is on. Once per
    process (a second call changes nothing); raises ConfigError for an exporter or protocol it does not know."""
    env = os.environ if environ is None else environ
    if _state.enabled:
        return True
    names = exporter_names(env)
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name, env) for name in names]
    # Attributes passed to Resource.create win over the environment's: add ours only where it says nothing.
    declared = OTELResourceDetector().detect().attributes
    ours: dict[str, str] = {}
    if not declared.get(SERVICE_NAME):
        ours[SERVICE_NAME] = service
    if instance_id and not declared.get(SERVICE_INSTANCE_ID):
        ours[SERVICE_INSTANCE_ID] = instance_id
    provider = TracerProvider(resource=Resource.create(ours))  # the sampler comes from OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if instrument_http:
        _instrument_aiohttp_server()
    _state.enabled = True
    _state.service = service
    return True


def _instrument_aiohttp_server() -> None:
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    # The instrumentation reads its exclusions from the environment when it instruments.
    os.environ.setdefault("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS", DEFAULT_EXCLUDED_URLS)
    AioHttpServerInstrumentor().instrument()  # type: ignore[no-untyped-call]


def shutdown() -> None:
    """Export what is still buffered (the provider also does this at interpreter exit)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "shutdown", None)
    if _state.enabled and callable(flush):
        flush()


def client_trace_configs() -> list[Any]:
    """`trace_configs` for an aiohttp ClientSession: a client span per request, its `traceparent` sent in the
    request's headers (the aiohttp client instrumentation); none while tracing is off."""
    if not _state.enabled:
        return []
    from opentelemetry.instrumentation.aiohttp_client import create_trace_config

    return [create_trace_config()]


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# ---- context in and out ----------------------------------------------------------------------------------


def context_from_traceparent(traceparent: str | None) -> Context | None:
    """The remote context a `traceparent` names, or None (absent or malformed)."""
    if not traceparent:
        return None
    ctx = propagate.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def context_from_headers(headers: Mapping[str, Any] | None) -> Context | None:
    """The remote context in message headers (AMQP), or None."""
    if not headers:
        return None
    value = headers.get("traceparent")
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    return context_from_traceparent(value) if isinstance(value, str) else None


def traceparent_of(span: Span | None) -> str | None:
    """The `traceparent` that makes a receiver's spans children of `span` (None for no valid span)."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def current_traceparent() -> str | None:
    """The current span's `traceparent`, or None when no span is current."""
    return traceparent_of(trace.get_current_span())


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits), or None when no span is current."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


def inject(headers: dict[str, Any]) -> None:
    """Add the current span's `traceparent` to outgoing headers (nothing while tracing is off)."""
    if _state.enabled:
        propagate.inject(headers)


def link(ctx: Context | None) -> Link | None:
    """A link to the span of a context (None for none)."""
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def current_link() -> Link | None:
    """A link to the current span (None when there is none)."""
    span_context = trace.get_current_span().get_span_context()
    return Link(span_context) if span_context.is_valid else None


def add_link(ctx: Context | None) -> None:
    """Link the current span to the span of `ctx` (a span serving several traces names each)."""
    if not _state.enabled or ctx is None:
        return
    span_context = trace.get_current_span(ctx).get_span_context()
    current = trace.get_current_span()
    if span_context.is_valid and current.is_recording():
        current.add_link(span_context)


@contextlib.contextmanager
def attached(traceparent: str | None) -> Iterator[None]:
    """Make a remote `traceparent` the current context for the block (so spans started in it, such as the
    aiohttp client's, become its children); nothing while tracing is off or without a valid one."""
    ctx = context_from_traceparent(traceparent) if _state.enabled else None
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


# ---- spans ---------------------------------------------------------------------------------------------


def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, parent: Context | None = None,
         links: Sequence[Link | None] = (), attributes: Mapping[str, Any] | None = None,
         root: bool = False) -> contextlib.AbstractContextManager[Span]:
    """A span current for the block: a child of `parent`, else of the current span (`root`: of none).

    Off, a shared no-op context (yielding an invalid span) and nothing else."""
    if not _state.enabled:
        return _NOOP
    if root and parent is None:
        parent = Context()
    return tracer().start_as_current_span(name, context=parent, kind=kind, attributes=clean(attributes),
                                          links=[lk for lk in links if lk is not None][:MAX_LINKS])


def start_span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, parent: Context | None = None,
               links: Sequence[Link | None] = (), attributes: Mapping[str, Any] | None = None) -> Span | None:
    """A span that is not made current, for the caller to end (None while tracing is off)."""
    if not _state.enabled:
        return None
    return tracer().start_span(name, context=parent, kind=kind, attributes=clean(attributes),
                               links=[lk for lk in links if lk is not None][:MAX_LINKS])


def traced(name: str, *, kind: SpanKind = SpanKind.INTERNAL,
           root: bool = False) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate a coroutine function: each call runs in a span `name` (`root`: the first span of a trace).
    Attributes known only inside go on with `set_attributes`."""

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not _state.enabled:
                return await fn(*args, **kwargs)
            with span(name, kind=kind, root=root):
                return await fn(*args, **kwargs)

        return wrapper

    return decorate


def set_attributes(**attributes: Any) -> None:
    """Set attributes (`monitoring.<name>`) on the current span; None values are left out."""
    if not _state.enabled:
        return
    current = trace.get_current_span()
    values = clean({f"monitoring.{k}": v for k, v in attributes.items()})
    if values and current.is_recording():
        current.set_attributes(values)


def execution_owners(owners: Iterable[str]) -> str | None:
    """The `execution_owner` attribute of a span over tasks on these paths: the one path, or `desktop_tasks/legacy`
    when they are on both; None without tasks."""
    return "/".join(sorted(set(owners))) or None


def clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attribute values OpenTelemetry takes (str, bool, int, float; UUIDs, dates as text); None dropped."""
    if not attributes:
        return None
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        out[key] = value if isinstance(value, str | bool | int | float) else str(value)
    return out


@contextlib.contextmanager
def consume_batch(name: str, message_name: str, headers: Sequence[Mapping[str, Any] | None], *,
                  attributes: Mapping[str, Any] | None = None,
                  message_attributes: Sequence[Mapping[str, Any] | None] = ()) -> Iterator[Span]:
    """Spans for a batch of consumed messages handled together: a batch span, current for the block, that is
    a child of the first message's context and links to every message's; and for each message with a context
    a span `message_name` that is a child of it (so each sender's trace shows its message consumed) and links
    to the batch span. All end with the block."""
    if not _state.enabled:
        with _NOOP as invalid:
            yield invalid
        return
    contexts = [context_from_headers(h) for h in headers]
    parent = next((c for c in contexts if c is not None), None)
    with span(name, kind=SpanKind.CONSUMER, parent=parent, root=parent is None,
              links=[link(c) for c in contexts], attributes=attributes) as batch:
        batch_link = Link(batch.get_span_context())
        singles = []
        for index, ctx in enumerate(contexts):
            if ctx is None:
                continue
            extra = message_attributes[index] if index < len(message_attributes) else None
            singles.append(tracer().start_span(message_name, context=ctx, kind=SpanKind.CONSUMER,
                                               links=[batch_link], attributes=clean({**(attributes or {}),
                                                                                     **(extra or {})})))
        try:
            yield batch
        finally:
            for single in singles:
                single.end()
