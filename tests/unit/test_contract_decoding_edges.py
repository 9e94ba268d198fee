"""decode_json at the edges the contract fuzzers probe: integers spelled as whole floats (JSON Schema's `integer`
admits `2.0`, as every OpenAPI document here says `integer`), and nesting deeper than msgspec's guard."""

from __future__ import annotations

import pytest

from libs.contracts.common import ContractError, decode_json
from libs.contracts.http import CancelRequest, CollectNowRequest, LeaseRequest
from libs.contracts.wire import Heartbeat, client_message_decoder


def test_a_whole_float_is_the_integer_it_spells() -> None:
    assert decode_json(b'{"max_tasks": 10.0}', LeaseRequest).max_tasks == 10
    assert decode_json(b'{"max_tasks": 1e1}', LeaseRequest).max_tasks == 10
    body = decode_json(b'{"keyword_id": 7.0, "question_ids": [1.0, 2, 3e0]}', CollectNowRequest)
    assert (body.keyword_id, body.question_ids) == (7, [1, 2, 3])
    assert all(type(i) is int for i in body.question_ids or [])
    beat = decode_json(b'{"type": "heartbeat", "local_queue_depth": 4.0}', Heartbeat, decoder=client_message_decoder)
    assert beat.local_queue_depth == 4
    cancel = decode_json(b'{"lease_token": "t", "reason": "user", "interrupt_generation": 0.0}', CancelRequest)
    assert cancel.interrupt_generation == 0


@pytest.mark.parametrize(("body", "message"), [
    (b'{"max_tasks": 1.5}', "Expected `int`, got `float`"),
    (b'{"max_tasks": 11.0}', "<= 10"),  # the bounds hold for the respelled value
    (b'{"max_tasks": 0.0}', ">= 1"),
    (b'{"max_tasks": 1e300}', "got `float`"),  # past 2**53 a float spells no integer exactly
    (b'{"max_tasks": true}', "got `bool`"),
    (b'{"max_tasks": "2"}', "got `str`"),
])
def test_anything_else_is_still_refused_naming_the_field(body: bytes, message: str) -> None:
    with pytest.raises(ContractError) as refused:
        decode_json(body, LeaseRequest)
    assert refused.value.field == "max_tasks" and message in refused.value.message


@pytest.mark.parametrize("body", [
    b'{"type": "heartbeat", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep in a field that is skipped
    b'{"type": "heartbeat", "platform_health": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
    b'{"max_tasks": 2.0, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep and respelled
])
def test_nesting_past_the_guard_is_invalid_json_not_a_crash(body: bytes) -> None:
    with pytest.raises(ContractError) as refused:
        decode_json(body, Heartbeat, decoder=client_message_decoder)
    assert refused.value.code in ("invalid_json", "invalid_field")
