"""A local trace sink: an OTLP/HTTP receiver (`POST /v1/traces`, protobuf) that appends every span it gets to a
file as one JSON object per line, for tests, benchmarks and a look at a trace without a tracing backend.

    python -m tools.trace_sink --port 4318 --out .run/traces.jsonl

Point the services at it with `OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318`, then
`monitorctl trace REQUEST_ID` prints a collect-now's trace as a tree. A line (see `span_record`): trace_id,
span_id, parent_span_id (null for a root), name, kind, service, instance, start_unix_nano, end_unix_nano,
duration_ms, status, status_message, attributes, links ([{trace_id, span_id}]), events (their names).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import signal
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
# An exporter's batch (512 spans by default) is well under this.
MAX_REQUEST_BYTES = 32 * 1024 * 1024
SPAN_KINDS = {Span.SPAN_KIND_INTERNAL: "internal", Span.SPAN_KIND_SERVER: "server", Span.SPAN_KIND_CLIENT: "client",
              Span.SPAN_KIND_PRODUCER: "producer", Span.SPAN_KIND_CONSUMER: "consumer"}
STATUSES = {Status.STATUS_CODE_OK: "ok", Status.STATUS_CODE_ERROR: "error"}


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: any_value(pair.value) for pair in pairs}


def span_record(span: Span, resource: dict[str, Any]) -> dict[str, Any]:
    """One span as the JSON object written on its line."""
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "name": span.name,
        "kind": SPAN_KINDS.get(span.kind, "unspecified"),
        "service": resource.get("service.name"),
        "instance": resource.get("service.instance.id"),
        "start_unix_nano": span.start_time_unix_nano,
        "end_unix_nano": span.end_time_unix_nano,
        "duration_ms": round((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, 3),
        "status": STATUSES.get(span.status.code, "unset"),
        "status_message": span.status.message or None,
        "attributes": attributes(span.attributes),
        "links": [{"trace_id": lk.trace_id.hex(), "span_id": lk.span_id.hex()} for lk in span.links],
        "events": [event.name for event in span.events],
    }


def records_from_request(body: bytes) -> list[dict[str, Any]]:
    """The spans of an OTLP `ExportTraceServiceRequest` (protobuf; gzip-compressed or not)."""
    if body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    records = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            records += [span_record(span, resource) for span in scope_spans.spans]
    return records


def read_spans(path: Path) -> list[dict[str, Any]]:
    """Every span in a sink's file (a line still being written is skipped)."""
    if not path.exists():
        return []
    spans = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            spans.append(json.loads(line))
    return spans


class TraceSink:
    """The receiver as an aiohttp app on `host:port` (0: a free port), appending to `out`."""

    def __init__(self, out: Path, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.out = out
        self.host = host
        self.port = port
        self.received = 0
        self._file: IO[str] | None = None
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        """For `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter appends /v1/traces)."""
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post(TRACES_PATH, self._receive)
        return app

    async def start(self) -> TraceSink:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.out.open("a", encoding="utf-8")
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        sock = socket.create_server((self.host, self.port))  # bound here, so port 0 tells its number
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._file is not None:
            self._file.close()

    async def __aenter__(self) -> TraceSink:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def _receive(self, request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            return web.Response(status=415, text=f"send OTLP as {PROTOBUF}")
        try:
            records = records_from_request(await request.read())
        except Exception as exc:  # a malformed body: the exporter should not retry it
            return web.Response(status=400, text=f"not an OTLP ExportTraceServiceRequest: {type(exc).__name__}")
        assert self._file is not None
        self._file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._file.flush()
        self.received += len(records)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)


async def serve(out: Path, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with TraceSink(out, host=host, port=port) as sink:
        print(json.dumps({"event": "trace sink listening", "endpoint": sink.endpoint, "out": str(out)}), flush=True)
        await stop.wait()
        print(json.dumps({"event": "trace sink stopped", "spans": sink.received}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.trace_sink", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318, help="OTLP/HTTP's usual port; 0 for a free one")
    parser.add_argument("--out", type=Path, default=Path(".run/traces.jsonl"), help="JSON lines, appended to")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.out, args.host, args.port))


if __name__ == "__main__":
    main()
