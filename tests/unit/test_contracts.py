"""Contracts decode the example bodies of docs/architecture.md §13 unchanged and reject bad input precisely."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from libs.contracts.amqp import MESSAGE_TYPES, LifecycleEvent, MonitorResult, any_message_decoder, message_type
from libs.contracts.common import ContractError, decode_json
from libs.contracts.http import (
    CancelRequest,
    CollectNowRequest,
    CollectNowResponse,
    ExtendRequest,
    LeaseRequest,
    ResultRequest,
)
from libs.contracts.wire import Heartbeat, ServerEvent, TaskAvailable, TaskControl, client_message_decoder

# The example bodies of docs/architecture.md §13, kept as test vectors.
EXAMPLES = Path(__file__).resolve().parents[1] / "vectors"

VECTORS = [
    ("task_available.json", ServerEvent, TaskAvailable),
    ("task_control.json", ServerEvent, TaskControl),
    ("collect_now_request.json", CollectNowRequest, CollectNowRequest),
    ("collect_now_response.json", CollectNowResponse, CollectNowResponse),
    ("cancel_request.json", CancelRequest, CancelRequest),
]


@pytest.mark.parametrize(("name", "decode_as", "expected"), VECTORS)
def test_seed_examples_round_trip_with_the_same_field_names(name: str, decode_as: object, expected: type) -> None:
    raw = (EXAMPLES / name).read_bytes()
    value = decode_json(raw, decode_as)  # type: ignore[arg-type]
    assert isinstance(value, expected)
    original = json.loads(raw)
    encoded = json.loads(msgspec.json.encode(value))
    for key, item in original.items():
        assert key in encoded, f"{name}: field {key} lost"
        if key.endswith("_at") and isinstance(item, str):
            assert encoded[key].replace("+00:00", "Z") == item
        else:
            assert encoded[key] == item, f"{name}: {key} changed"


def test_unknown_event_type_is_rejected_naming_type() -> None:
    with pytest.raises(ContractError) as info:
        decode_json(b'{"type": "task_exploded", "kind": "monitor"}', ServerEvent)
    assert info.value.code == "unknown_type"
    assert info.value.field == "type"


def test_missing_field_is_named() -> None:
    body = {"type": "task_control", "kind": "monitor", "task_id": "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
            "target_client_id": "3f1c2a8e-9b7d-4c55-8a21-6d0e5b4f7a10", "control": "interrupt_requested",
            "reason": "collect_now_preempt", "updated_at": "2026-04-20T10:00:05Z"}
    with pytest.raises(ContractError) as info:
        decode_json(json.dumps(body), ServerEvent)
    assert info.value.code == "missing_field"
    assert info.value.field == "interrupt_generation"


@pytest.mark.parametrize(("body", "field"), [
    (b'{"keyword_id": "123"}', "keyword_id"),
    (b'{"keyword_id": -1}', "keyword_id"),
    (b'{"target_client_id": "not-a-uuid"}', "target_client_id"),
    (b'{"preempt": "yes"}', "preempt"),
    (b'{"question_ids": [1, "x"]}', "question_ids[1]"),
])
def test_wrong_types_name_the_field(body: bytes, field: str) -> None:
    with pytest.raises(ContractError) as info:
        decode_json(body, CollectNowRequest)
    assert info.value.code == "invalid_field"
    assert info.value.field == field


def test_nested_field_path_is_reported() -> None:
    body = {"lease_token": "t", "status": "succeeded", "citations": [{"url": "https://a"}, {"title": "x"}]}
    with pytest.raises(ContractError) as info:
        decode_json(json.dumps(body), ResultRequest)
    assert info.value.field == "citations[1].url"


def test_oversize_payload_is_rejected_before_decoding() -> None:
    big = b'{"lease_token": "' + b"x" * 300_000 + b'"}'
    with pytest.raises(ContractError) as info:
        decode_json(big, ExtendRequest)
    assert info.value.code == "payload_too_large"


def test_string_limits_are_enforced() -> None:
    with pytest.raises(ContractError) as info:
        decode_json(json.dumps({"lease_token": "t", "reason": "r" * 500, "interrupt_generation": 1}), CancelRequest)
    assert info.value.field == "reason"


def test_invalid_json_and_empty_body() -> None:
    with pytest.raises(ContractError) as info:
        decode_json(b"{not json", LeaseRequest)
    assert info.value.code == "invalid_json"
    with pytest.raises(ContractError) as info:
        decode_json(b"  ", LeaseRequest)
    assert info.value.code == "invalid_body"


def test_lease_request_bounds() -> None:
    assert decode_json(b"{}", LeaseRequest).max_tasks == 1
    with pytest.raises(ContractError):
        decode_json(b'{"max_tasks": 0}', LeaseRequest)
    with pytest.raises(ContractError):
        decode_json(b'{"max_tasks": 11}', LeaseRequest)


def test_execution_phase_must_be_a_seed_phase() -> None:
    extend = decode_json(b'{"lease_token": "t", "execution_phase": "WAITING"}', ExtendRequest)
    assert extend.execution_phase == "WAITING"
    with pytest.raises(ContractError) as info:
        decode_json(b'{"lease_token": "t", "execution_phase": "DANCING"}', ExtendRequest)
    assert info.value.field == "execution_phase"


def test_unknown_fields_are_tolerated_for_forward_compatibility() -> None:
    value = decode_json(b'{"keyword_id": 5, "added_in_a_later_version": true}', CollectNowRequest)
    assert value.keyword_id == 5


def test_heartbeat_and_amqp_decoders() -> None:
    hb = client_message_decoder.decode(b'{"type": "heartbeat", "local_queue_depth": 3}')
    assert isinstance(hb, Heartbeat) and hb.local_queue_depth == 3
    event = LifecycleEvent(event="task.completed", tenant_id=1, occurred_at="2026-04-20T10:00:00Z")  # type: ignore[arg-type]
    assert message_type(event) == "lifecycle"
    assert set(MESSAGE_TYPES) == {"task_available", "task_control", "monitor_result", "projection_rebuild",
                                  "lifecycle"}
    with pytest.raises(msgspec.ValidationError):
        any_message_decoder.decode(b'{"type": "monitor_result", "task_id": "x"}')
    assert MonitorResult.__struct_config__.tag == "monitor_result"
