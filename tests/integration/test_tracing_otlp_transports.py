"""OTLP over both transports the services support (libs/telemetry/tracing.py): a process configured only by the
standard `OTEL_*` variables exports its spans to a real OTLP receiver over gRPC and over HTTP/protobuf, with the
service's resource and our attributes. The receivers are the OTLP collector services from opentelemetry-proto, in
this test's process."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

# The exporting process: configured by the environment alone, one span, flushed at shutdown.
PROBE = """
from libs.telemetry import tracing
assert tracing.configure_tracing("otlp-probe", instrument_http=False), "tracing stayed off"
with tracing.span("probe.work", attributes={"monitoring.tenant_id": 7}):
    pass
tracing.shutdown()
"""

Received = list[trace_service_pb2.ExportTraceServiceRequest]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # the gRPC method's name
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@asynccontextmanager
async def grpc_receiver(received: Received) -> AsyncIterator[dict[str, str]]:
    port = _free_port()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Collector(received), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    finally:
        await server.stop(grace=None)


@asynccontextmanager
async def http_receiver(received: Received) -> AsyncIterator[dict[str, str]]:
    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("receiver", [grpc_receiver, http_receiver], ids=["grpc", "http/protobuf"])
async def test_a_process_exports_its_spans_over_the_configured_otlp_transport(
        receiver: Callable[[Received], AbstractAsyncContextManager[dict[str, str]]]) -> None:
    received: Received = []
    async with receiver(received) as otel_env:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(otel_env, PYTHONPATH=str(ROOT), OTEL_SERVICE_NAME="otlp-probe", OTEL_BSP_SCHEDULE_DELAY="100")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PROBE, env=env, cwd=ROOT,
                                                    stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stderr.decode()[-2000:]
    spans = [(resource_spans, span) for request in received for resource_spans in request.resource_spans
             for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
    assert [span.name for _, span in spans] == ["probe.work"], received
    resource_spans, span = spans[0]
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "otlp-probe"
    assert {a.key: a.value.int_value for a in span.attributes}["monitoring.tenant_id"] == 7
    assert len(span.trace_id) == 16 and len(span.span_id) == 8
