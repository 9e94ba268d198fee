"""Which ingest failures hold the shard (transient) and which dead-letter a result, the retry pacing, and how a
broker-side dead letter is told from a consumer's own copy."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors
from psycopg_pool import PoolTimeout

from libs.mq.dead_letter import REASON_HEADER, broker_dead_letter_reason
from libs.mq.poison import is_transient
from services.ingest_shard_workers.consumer import DB_RETRY_MAX_DELAY_S, db_retry_delay


@pytest.mark.parametrize("sqlstate", [
    "08000", "08003", "08006", "08001", "57P01", "57P02", "57P03", "40001", "40P01", "55P03", "53300", "42501"])
def test_database_away_or_busy_is_transient(sqlstate: str) -> None:
    assert is_transient(errors.lookup(sqlstate)("x"))


@pytest.mark.parametrize("sqlstate", ["23505", "23503", "23502", "22P02", "22001", "P0001", "42703"])
def test_errors_of_the_data_are_not(sqlstate: str) -> None:
    assert not is_transient(errors.lookup(sqlstate)("x"))


def test_lost_connections_and_pool_timeouts_are_transient() -> None:
    assert is_transient(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert is_transient(PoolTimeout("couldn't get a connection after 1.00 sec"))
    assert is_transient(ConnectionRefusedError())
    assert not is_transient(ValueError("a bug on one input"))


def test_retries_are_paced_by_a_capped_delay_not_an_exponential_one() -> None:
    delays = [db_retry_delay(n) for n in range(1, 400)]
    assert delays[:4] == [0.2, 0.4, 0.8, 1.0]
    assert max(delays) == DB_RETRY_MAX_DELAY_S == 1.0
    # 6 minutes of outage are ~360 attempts, one a second at the end.
    assert sum(delays) < 400


def test_broker_dead_letters_are_told_from_the_consumers_copies() -> None:
    assert broker_dead_letter_reason({"x-death": [{"reason": "delivery_limit", "count": 1}]}) == "delivery_limit"
    assert broker_dead_letter_reason({"x-death": [{"reason": b"rejected"}]}) == "rejected"
    assert broker_dead_letter_reason({}) is None
    assert broker_dead_letter_reason(None) is None
    # A consumer's copy keeps the original's headers (x-death of an earlier broker dead letter, too), and was
    # counted when it was published.
    assert broker_dead_letter_reason({REASON_HEADER: "malformed_json: x",
                                      "x-death": [{"reason": "delivery_limit"}]}) is None
    assert broker_dead_letter_reason({"x-death": "garbled"}) == "broker_unknown"
