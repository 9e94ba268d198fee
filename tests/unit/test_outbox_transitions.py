"""Pure outbox rules behind the transition logs and the replay: failure classes, error summaries, log fields, and
which dead letters a replay resets."""

from __future__ import annotations

import msgspec
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed, DeliveryError
from aiormq.exceptions import PublishError as ReturnedMessage
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from libs.contracts.amqp import LifecycleEvent
from libs.outbox.relay import PublishError
from libs.outbox.state import (
    SOURCE_FIELDS,
    ReplaySkip,
    after_failure,
    broker_failure_kind,
    error_summary,
    plan_replay,
    transition_fields,
)


def test_a_dead_letter_records_why_it_failed() -> None:
    permanent = after_failure(attempts=1, max_attempts=10, kind="permanent", error="payload does not match lifecycle",
                              base_ms=1, max_ms=2)
    assert (permanent.status, permanent.error_class) == ("dead_letter", "permanent")
    exhausted = after_failure(attempts=5, max_attempts=5, kind="transient", error="no publisher confirm", base_ms=1,
                              max_ms=2)
    assert (exhausted.status, exhausted.error_class) == ("dead_letter", "transient")
    retry = after_failure(attempts=2, max_attempts=5, kind="transient", error="no publisher confirm", base_ms=1,
                          max_ms=2)
    assert (retry.status, retry.error_class) == ("retryable", "transient")


def _returned() -> ReturnedMessage:
    frame = Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="monitor.lifecycle", routing_key="x")
    message = DeliveredMessage(delivery=frame, header=ContentHeader(), body=b'{"secret": "body"}',
                               channel=None)  # type: ignore[arg-type]
    return ReturnedMessage(message, frame)


def test_only_a_message_the_broker_returned_is_a_permanent_broker_failure() -> None:
    assert broker_failure_kind(_returned()) == "permanent"
    assert broker_failure_kind(DeliveryError(None, Basic.Nack(delivery_tag=7))) == "transient"
    assert broker_failure_kind(TimeoutError()) == "transient"
    assert broker_failure_kind(ConnectionResetError("reset by peer")) == "transient"
    # A channel the broker closed fails every publish in flight on it, not only the culprit's: retried, not
    # dead-lettered for good.
    assert broker_failure_kind(ChannelPreconditionFailed(None, None)) == "transient"
    assert broker_failure_kind(ChannelNotFoundEntity(None, None)) == "transient"


def test_an_error_summary_is_the_cause_type_and_a_bounded_first_line() -> None:
    try:
        try:
            raise TimeoutError
        except TimeoutError as cause:
            raise PublishError("transient", "no publisher confirm before the timeout\nsecond line") from cause
    except PublishError as exc:
        assert error_summary(exc) == ("TimeoutError", "no publisher confirm before the timeout")
    kind, text = error_summary(PublishError("permanent", "x" * 1000))
    assert kind == "PublishError" and text == "x" * 200
    assert error_summary(ValueError()) == ("ValueError", "")
    # What the broker's own errors say names the frame, never the body.
    assert "secret" not in error_summary(_returned())[1]
    # A contract error quotes values from the payload: blanked out, the field path kept.
    try:
        msgspec.json.decode(b'{"type": "lifecycle", "event": "secret-value"}', type=LifecycleEvent)
    except msgspec.ValidationError as cause:
        wrapped = PublishError("permanent", f"payload does not match lifecycle: {cause}")
        wrapped.__cause__ = cause
    assert error_summary(wrapped) == ("ValidationError",
                                      "payload does not match lifecycle: Invalid enum value '...' - at `$.event`")


def test_transition_fields_carry_the_source_and_leave_out_what_does_not_apply() -> None:
    source = {"outbox_id": 5, "event_id": "e", "tenant_id": 3, "exchange": "monitor.lifecycle",
              "routing_key": "client.online", "ordering_key": None, "message_type": "lifecycle", "attempt": 2,
              "max_attempts": 10, "payload": b"never logged"}
    fields = transition_fields("retry_scheduled", "running", "retryable", owner="pump-a", source=source,
                               next_retry_at="2026-03-15T08:00:00+00:00", error=None)
    assert fields == {"transition": "retry_scheduled", "from_status": "running", "to_status": "retryable",
                      "owner": "pump-a", **{k: source[k] for k in SOURCE_FIELDS},
                      "next_retry_at": "2026-03-15T08:00:00+00:00"}
    assert "payload" not in fields and "error" not in fields


def _row(outbox_id: int, status: str, error_class: str | None, error: str = "boom") -> dict[str, object]:
    return {"id": outbox_id, "status": status, "last_error_class": error_class, "last_error": error}


def test_a_replay_resets_transient_dead_letters_only_and_fails_closed_on_unclassified_ones() -> None:
    rows = [_row(4, "dead_letter", "permanent", "permanent: payload does not match lifecycle\ndetail"),
            _row(1, "dead_letter", "transient"), _row(7, "dead_letter", None, "gave up after 10 attempts"),
            _row(3, "published", None)]
    plan = plan_replay(rows, requested=[1, 3, 4, 7, 99], include_permanent=False)
    assert plan.reset == [1]
    assert plan.skipped == [ReplaySkip(4, "permanent", "permanent: payload does not match lifecycle"),
                            ReplaySkip(7, None, "gave up after 10 attempts")]
    assert plan.not_dead == {3: "published"}
    assert plan.not_found == [99]

    everything = plan_replay(rows, requested=None, include_permanent=True)  # --all --include-permanent
    assert (everything.reset, everything.skipped, everything.not_found) == ([1, 4, 7], [], [])
    # An unknown class string is no licence either.
    odd = plan_replay([_row(8, "dead_letter", "maybe")], requested=None, include_permanent=False)
    assert odd.reset == [] and odd.skipped == [ReplaySkip(8, None, "boom")]
