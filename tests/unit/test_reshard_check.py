"""The reshard checkers catch what they are for (tests/support/reshard_check.py), and the routing rules
(libs/ingest/routing.py) say which old shards a new one waits for."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from libs.domain.shard import shard_for_key
from libs.ingest.routing import Routing, may_consume, routing_key, source_shards
from tests.support.reshard_check import Applied, order_breaks, overlaps

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def row(key: str, n: int, epoch: int, shard: int, start_ms: int, end_ms: int) -> Applied:
    return Applied(key, f"r{n}", n, epoch, shard, T0 + timedelta(milliseconds=start_ms),
                   T0 + timedelta(milliseconds=end_ms))


def test_sequential_epochs_are_no_overlap() -> None:
    rows = [row("k", 1, 0, 1, 0, 5), row("k", 2, 0, 1, 10, 15), row("k", 3, 1, 5, 20, 25), row("k", 4, 2, 1, 30, 31)]
    assert overlaps(rows) == []


def test_two_shards_applying_one_key_at_once_are_caught() -> None:
    rows = [row("k", 1, 0, 1, 0, 50), row("k", 2, 1, 5, 20, 25)]
    assert overlaps(rows) and "(0, 1) applied until" in overlaps(rows)[0]
    assert overlaps([row("k", 1, 0, 1, 0, 5), row("k", 2, 0, 2, 10, 15)])  # two shards in one epoch


def test_going_back_to_an_old_epoch_after_the_new_one_applied_is_caught() -> None:
    assert overlaps([row("k", 1, 1, 5, 0, 5), row("k", 2, 0, 1, 10, 15)])


def test_order_breaks() -> None:
    rows = [row("k", 1, 0, 1, 0, 5), row("k", 3, 0, 1, 6, 7), row("j", 2, 0, 1, 6, 7)]
    assert order_breaks(rows, {"k": ["r1", "r3"], "j": ["r2"]}) == []
    assert order_breaks(rows, {"k": ["r3", "r1"], "j": ["r2"]}) == ["k"]


def test_a_new_shard_waits_for_every_old_shard_its_keys_can_come_from() -> None:
    assert source_shards(5, 4, 8) == {1}
    assert source_shards(1, 8, 4) == {1, 5}
    assert source_shards(0, 4, 6) == {0, 2}
    assert source_shards(2, 3, 5) == {0, 1, 2}
    # Exhaustive over real keys: a key's old shard is always among its new shard's sources.
    for old, new in ((4, 8), (8, 4), (4, 6), (16, 12), (3, 5)):
        for n in range(2000):
            key = f"7:{n}:2026-03-01"
            assert shard_for_key(key, old) in source_shards(shard_for_key(key, new), old, new)


def test_may_consume_only_once_its_sources_are_drained() -> None:
    old = Routing(0, 8)
    assert not may_consume(1, old, 4, drained={1})
    assert may_consume(1, old, 4, drained={1, 5})
    assert may_consume(3, None, 4, drained=set())


def test_routing_keys_keep_the_original_names_in_epoch_0() -> None:
    assert routing_key(0, 3) == "shard.3"
    assert routing_key(2, 3) == "e2.shard.3"
