"""Structured logs: JSON per line, ids as fields, secrets redacted, clashing fields never crash."""

from __future__ import annotations

import io
import json
import logging

from libs.telemetry.logging import JsonFormatter, SafeExtraLogger


def _logger() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("svc"))
    logger = SafeExtraLogger("test.logging")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, stream


def test_fields_become_json_and_secrets_are_redacted() -> None:
    logger, stream = _logger()
    logger.info("task leased", extra={"tenant_id": 7, "task_id": "t-1", "lease_token": "secret",
                                      "answer_text": "the whole answer"})
    event = json.loads(stream.getvalue())
    assert event["event"] == "task leased" and event["service"] == "svc" and event["level"] == "info"
    assert event["tenant_id"] == 7 and event["task_id"] == "t-1"
    assert event["lease_token"] == "[redacted]" and event["answer_text"] == "[redacted]"


def test_a_field_named_like_a_record_attribute_does_not_crash() -> None:
    logger, stream = _logger()
    logger.info("scheduled tasks created", extra={"created": 12, "name": "x"})
    event = json.loads(stream.getvalue())
    assert event["field_created"] == 12 and event["field_name"] == "x"


def test_every_module_logger_is_safe() -> None:
    assert isinstance(logging.getLogger("libs.some.new.module"), SafeExtraLogger)
