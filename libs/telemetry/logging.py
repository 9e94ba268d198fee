"""Structured JSON logs: one event per line, ids as fields, never secrets or answer bodies."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

# Attributes a LogRecord always has; anything else passed through `extra=` becomes a field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
# The id of the HTTP request being handled (libs.http.request_ids; its `X-Request-Id`): every line logged while it
# is handled names it, as `http_request_id` (`request_id` names a collect-now request in this code base).
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
_REDACT = {"token", "lease_token", "authorization", "answer_text", "password", "secret"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD or key.startswith("_"):
                continue
            event[key] = "[redacted]" if key in _REDACT else value
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:  # the log line of a traced step names its trace and span
            event.setdefault("trace_id", format(span_context.trace_id, "032x"))
            event.setdefault("span_id", format(span_context.span_id, "016x"))
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str, ensure_ascii=False)


class SafeExtraLogger(logging.Logger):
    """A Logger whose `extra=` can never crash a call site: a field that clashes with a LogRecord
    attribute (`created`, `name`, `msg`, ...) is kept under `field_<name>` instead of raising."""

    def makeRecord(self, name: str, level: int, fn: str, lno: int, msg: object, args: Any, exc_info: Any,
                   func: str | None = None, extra: Mapping[str, object] | None = None,
                   sinfo: str | None = None) -> logging.LogRecord:
        if extra:
            extra = {(f"field_{k}" if k in _STANDARD else k): v for k, v in extra.items()}
        return super().makeRecord(name, level, fn, lno, msg, args, exc_info, func, extra, sinfo)


logging.setLoggerClass(SafeExtraLogger)

_make_record = logging.getLogRecordFactory()


def _record_with_request_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
    """Every record made while an HTTP request is handled carries its id (at creation: a handler that formats
    later, or in another thread, still sees it)."""
    record = _make_record(*args, **kwargs)
    request_id = REQUEST_ID.get()
    if request_id is not None:
        record.http_request_id = request_id
    return record


logging.setLogRecordFactory(_record_with_request_id)


def configure_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiormq", "aio_pika", "psycopg.pool", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
