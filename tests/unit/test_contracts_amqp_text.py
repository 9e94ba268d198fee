"""The AMQP messages' free text carries the HTTP edge's constraints: a NUL or control character, or text past its
length, is a decode error (dead-lettered with its reason by the consumer), never a database error."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from libs.contracts.amqp import LifecycleEvent, MonitorResult, any_message_decoder, lifecycle_decoder, result_decoder
from libs.contracts.common import ContractError, decode_json
from libs.contracts.http import Citation, ResultRequest
from services.ingest_shard_workers.consumer import _decode

NOW = datetime(2026, 4, 20, 10, 0, tzinfo=UTC)
NUL, ESC, DEL = "\x00", "\x1b", "\x7f"


def _result(**changes: Any) -> dict[str, Any]:
    result = MonitorResult(
        result_id=uuid.uuid4(), task_id=uuid.uuid4(), monitor_task_id=1, lease_epoch=1, tenant_id=1, workspace_id=1,
        brand_id=1, question_id=1, ai_platform_id=1, collector_type="desktop", run_mode="daily",
        business_date=date(2026, 4, 20), client_id=uuid.uuid4(), status="succeeded",
        answer_text="Line one.\n\tLine two.\r\n", citations=[Citation(url="https://example.com/a", title="A\ttitle")],
        error=None, received_at=NOW)
    body: dict[str, Any] = msgspec.to_builtins(result)
    body.update(changes)
    return body


def _lifecycle(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(LifecycleEvent(
        event="task.aborted", tenant_id=1, occurred_at=NOW, task_id=uuid.uuid4(), lane="normal_boosted",
        reason="cancelled: the user closed the window"))
    body.update(changes)
    return body


def test_valid_messages_still_decode() -> None:
    result = result_decoder.decode(msgspec.json.encode(_result()))
    assert result.answer_text == "Line one.\n\tLine two.\r\n" and result.collector_type == "desktop"
    assert isinstance(any_message_decoder.decode(msgspec.json.encode(_result(status="failed", answer_text=None,
                                                                             error="timed out\nafter 30 s"))),
                      MonitorResult)
    event = lifecycle_decoder.decode(msgspec.json.encode(_lifecycle()))
    assert (event.lane, event.reason) == ("normal_boosted", "cancelled: the user closed the window")
    for lane in ("urgent", "high", "normal", "retry"):
        assert lifecycle_decoder.decode(msgspec.json.encode(_lifecycle(lane=lane))).lane == lane
    assert lifecycle_decoder.decode(msgspec.json.encode(_lifecycle(lane=None, reason=None))).reason is None


MULTI_LINE_FIELDS = ["answer_text", "error"]
SINGLE_LINE_RESULT_FIELDS = ["collector_type", "run_mode"]


@pytest.mark.parametrize("field", MULTI_LINE_FIELDS + SINGLE_LINE_RESULT_FIELDS)
@pytest.mark.parametrize("bad", [NUL, ESC, DEL, "\x08"], ids=["nul", "esc", "del", "backspace"])
def test_each_result_text_field_refuses_nul_and_control_characters(field: str, bad: str) -> None:
    body = msgspec.json.encode(_result(**{field: f"x{bad}y"}))
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{field}"):
        result_decoder.decode(body)
    with pytest.raises(ContractError) as refused:
        decode_json(body, MonitorResult, decoder=result_decoder)
    assert (refused.value.code, refused.value.field) == ("invalid_field", field)


@pytest.mark.parametrize("field", ["lane", "reason"])
@pytest.mark.parametrize("bad", [NUL, ESC, DEL, "\n"], ids=["nul", "esc", "del", "newline"])
def test_each_lifecycle_text_field_refuses_nul_and_control_characters(field: str, bad: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=rf"\$\.{field}"):
        lifecycle_decoder.decode(msgspec.json.encode(_lifecycle(**{field: f"x{bad}y"})))


@pytest.mark.parametrize("field", SINGLE_LINE_RESULT_FIELDS)
def test_single_line_result_fields_refuse_line_breaks_empty_and_overlong_values(field: str) -> None:
    for bad in ("desk\ntop", "", "x" * 21):  # collector_type and run_mode are varchar(20)
        with pytest.raises(msgspec.ValidationError):
            result_decoder.decode(msgspec.json.encode(_result(**{field: bad})))
    assert getattr(result_decoder.decode(msgspec.json.encode(_result(**{field: "x" * 20}))), field) == "x" * 20


@pytest.mark.parametrize(("decoder", "body"), [
    (result_decoder, _result(answer_text="x" * 100_001)),
    (result_decoder, _result(error="x" * 2001)),
    (result_decoder, _result(citations=[{"url": "https://example.com/\x00"}])),
    (lifecycle_decoder, _lifecycle(reason="x" * 201)),
    (lifecycle_decoder, _lifecycle(lane="x" * 21)),
])
def test_text_past_its_length_is_refused(decoder: msgspec.json.Decoder[Any], body: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.json.encode(body))


def test_the_ingest_consumer_dead_letters_such_a_result_with_its_reason() -> None:
    reason = _decode(SimpleNamespace(body=msgspec.json.encode(_result(answer_text=f"bad{NUL}byte"))))  # type: ignore[arg-type]
    assert isinstance(reason, str) and reason.startswith("invalid_message: ") and "$.answer_text" in reason


def test_the_hub_edge_refuses_the_same_text_first() -> None:
    """The hub's result endpoint decodes ResultRequest, whose answer and error carry the same constraints: the
    AMQP ones are defence in depth, and everything the edge takes, the AMQP contract takes too."""
    base = {"lease_token": "lt1.1.abc", "status": "succeeded"}
    for field in MULTI_LINE_FIELDS:
        with pytest.raises(ContractError) as refused:
            decode_json(msgspec.json.encode({**base, field: f"bad{NUL}byte"}), ResultRequest)
        assert (refused.value.code, refused.value.field) == ("invalid_field", field)
    edge = {f.name: f.type for f in msgspec.inspect.type_info(ResultRequest).fields}  # type: ignore[attr-defined]
    bus = {f.name: f.type for f in msgspec.inspect.type_info(MonitorResult).fields}  # type: ignore[attr-defined]
    for field in [*MULTI_LINE_FIELDS, "citations"]:
        assert edge[field] == bus[field], field
