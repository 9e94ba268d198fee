"""dispatch-hub pure logic: lease tokens and fencing, generations, routing keys, bearer parsing, p95."""

from __future__ import annotations

import uuid

import pytest

from libs.auth import hash_token
from services.dispatch_hub.logic import (
    REBALANCE_CALM_CHANGES,
    LeaseCheck,
    LeaseState,
    RollingWindow,
    ShedReturns,
    announced_heartbeat_interval,
    bearer_token,
    check_lease,
    client_id_from_routing_key,
    is_stale_generation,
    lease_token_epoch,
    new_lease_token,
    percentile,
    routing_keys_for_client,
    sockets_to_shed,
)

CLIENT = uuid.uuid4()


def state(token: str, epoch: int, status: str = "in_progress", client: uuid.UUID = CLIENT) -> LeaseState:
    return LeaseState(target_client_id=client, status=status, lease_epoch=epoch, lease_token_hash=hash_token(token))


def test_lease_tokens_carry_their_epoch_and_are_unique() -> None:
    token = new_lease_token(7)
    assert lease_token_epoch(token) == 7
    assert new_lease_token(7) != token
    for bad in ("", "lt1", "lt1.x.abc", "lt1.3.", "zz.3.abc", "dct_whatever"):
        assert lease_token_epoch(bad) is None


def test_fencing_requires_owner_status_epoch_and_hash() -> None:
    token = new_lease_token(2)
    assert check_lease(state(token, 2), caller=CLIENT, token=token) is LeaseCheck.OK
    assert check_lease(None, caller=CLIENT, token=token) is LeaseCheck.NOT_FOUND
    # Another client's task is indistinguishable from a missing one.
    assert check_lease(state(token, 2, client=uuid.uuid4()), caller=CLIENT, token=token) is LeaseCheck.NOT_FOUND
    assert check_lease(state(token, 3), caller=CLIENT, token=token) is LeaseCheck.STALE
    assert check_lease(state(token, 2, status="aborted"), caller=CLIENT, token=token) is LeaseCheck.STALE
    forged = token.rsplit(".", 1)[0] + ".forged"
    assert check_lease(state(token, 2), caller=CLIENT, token=forged) is LeaseCheck.STALE
    released = LeaseState(target_client_id=CLIENT, status="in_progress", lease_epoch=2, lease_token_hash=None)
    assert check_lease(released, caller=CLIENT, token=token) is LeaseCheck.STALE


def test_stale_generation_is_strictly_older() -> None:
    assert is_stale_generation(4, 5)
    assert not is_stale_generation(5, 5)
    assert not is_stale_generation(6, 5)


def test_routing_keys_and_back() -> None:
    monitor, publish = routing_keys_for_client(CLIENT)
    assert (monitor, publish) == (f"monitor.*.{CLIENT}", f"publish.{CLIENT}")
    for key in (f"monitor.high.{CLIENT}", f"monitor.control.{CLIENT}", f"publish.{CLIENT}"):
        assert client_id_from_routing_key(key) == CLIENT
    assert client_id_from_routing_key("monitor.high.not-a-uuid") is None


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    for bad in (None, "", "Basic abc", "Bearer", "Bearer  "):
        assert bearer_token(bad) is None


def test_percentile_and_rolling_window() -> None:
    assert percentile([], 95) is None
    assert percentile(range(1, 101), 95) == 95
    window = RollingWindow(size=10)
    for value in range(100):
        window.add(float(value))
    assert len(window) == 10 and window.p95() == 99.0


def test_the_announced_heartbeat_interval_is_whole_seconds_and_never_zero() -> None:
    assert [announced_heartbeat_interval(s) for s in (0.3, 1.0, 2.9, 10.0)] == [1, 1, 2, 10]


def test_token_buckets_allow_the_burst_then_the_rate_per_key() -> None:
    from services.dispatch_hub.logic import TokenBuckets

    buckets = TokenBuckets(rate=1.0, burst=3)
    assert [buckets.take("a", 0.0) for _ in range(3)] == [None, None, None]
    assert buckets.take("a", 0.0) == pytest.approx(1.0)
    assert buckets.take("b", 0.0) is None  # another key has its own bucket
    assert buckets.take("a", 0.5) == pytest.approx(0.5)
    assert buckets.take("a", 1.6) is None
    assert buckets.take("a", 100.0) is None  # refilled, at most to the burst
    assert [buckets.take("a", 100.0) for _ in range(2)] == [None, None]
    assert buckets.take("a", 100.0) is not None


def test_token_buckets_stay_bounded_under_a_flood_of_keys() -> None:
    from services.dispatch_hub.logic import TokenBuckets

    buckets = TokenBuckets(rate=1.0, burst=2, max_keys=100)
    for i in range(10_000):
        buckets.take(f"k{i}", float(i) / 1000)
    assert buckets.tracked_keys <= 100


def test_a_result_post_is_classified_by_the_digest_already_stored() -> None:
    from services.dispatch_hub.logic import ResultPost, classify_result_post, result_id_for

    assert classify_result_post(None, "d1", received=False) is ResultPost.FIRST
    assert classify_result_post("d1", "d1", received=True) is ResultPost.REPLAY
    assert classify_result_post("d1", "d1", received=False) is ResultPost.REPUBLISH
    assert classify_result_post("d1", "d2", received=True) is ResultPost.CONFLICT
    task = uuid.uuid4()
    assert result_id_for(task, 1) == result_id_for(task, 1) != result_id_for(task, 2)


def test_a_preempt_cancel_needs_a_requested_interrupt() -> None:
    from services.dispatch_hub.logic import preempt_cancel_allowed

    assert not preempt_cancel_allowed(None) and not preempt_cancel_allowed({})
    assert not preempt_cancel_allowed({"interrupt_requested": False})
    assert preempt_cancel_allowed({"interrupt_requested": True, "interrupt_generation": 2})


def test_a_yield_wastes_work_only_past_navigating() -> None:
    from services.dispatch_hub.logic import preempt_wasted_work

    assert not preempt_wasted_work(None)
    assert not preempt_wasted_work("PREPARING") and not preempt_wasted_work("NAVIGATING")
    assert preempt_wasted_work("AUTHENTICATING") and preempt_wasted_work("WAITING")


def test_token_buckets_shared_among_replicas_hold_the_fleet_wide_budget() -> None:
    """A client spreading its upgrades over four replicas gets, in total, the budget of one (the rate; the burst
    rounded up to one upgrade a replica)."""
    from services.dispatch_hub.logic import TokenBuckets

    replicas = [TokenBuckets(rate=1.0, burst=8) for _ in range(4)]
    for buckets in replicas:
        buckets.share_among(4)
    allowed = sum(1 for n in range(40) if replicas[n % 4].take("client", now=0.0) is None)
    assert allowed == 8, "the burst, fleet-wide"
    later = sum(1 for n in range(40) if replicas[n % 4].take("client", now=4.0) is None)
    assert later == 4, "four seconds at 1/s, fleet-wide"
    for buckets in replicas:
        buckets.share_among(1)
    assert replicas[0].take("other", now=0.0) is None and replicas[0].burst == 8


def test_a_hub_sheds_only_its_excess_over_the_slack_a_little_a_sweep_and_only_when_calm() -> None:
    # After a rolling restart of 4 hubs, 20,000 sockets: the first restarted holds 9,000.
    assert sockets_to_shed(9_000, 20_000, 4, slack=0.25, changed=0) == 90  # 1 % a sweep
    assert sockets_to_shed(6_300, 20_000, 4, slack=0.25, changed=0) == 50  # down to 1.25 x 5,000 = 6,250
    assert sockets_to_shed(6_250, 20_000, 4, slack=0.25, changed=0) == 0  # within the slack
    assert sockets_to_shed(60, 60, 2, slack=0.25, changed=0) == 1  # at least one a sweep: down to 30 + 10
    assert sockets_to_shed(41, 60, 2, slack=0.25, changed=0) == 1
    assert sockets_to_shed(40, 60, 2, slack=0.25, changed=0) == 0
    assert sockets_to_shed(12, 12, 2, slack=0.25, changed=0) == 0  # a few over the fair share: left alone
    # Nothing with one hub, with rebalancing off, or while sockets come and go (a storm, a roll in progress).
    assert sockets_to_shed(9_000, 9_000, 1, slack=0.25, changed=0) == 0
    assert sockets_to_shed(9_000, 20_000, 4, slack=0, changed=0) == 0
    assert sockets_to_shed(9_000, 20_000, 4, slack=0.25, changed=REBALANCE_CALM_CHANGES + 91) == 0
    assert sockets_to_shed(9_000, 20_000, 4, slack=0.25, changed=REBALANCE_CALM_CHANGES + 90) == 90
    # While the lightest hub holds under (1 - slack) x its share (the one restarted last), the heavy ones go down to
    # the share itself (and 10): a random reconnect lands on the light one only a quarter of the time here.
    assert sockets_to_shed(6_300, 20_000, 4, slack=0.25, changed=0, lightest=1_751) == 63
    assert sockets_to_shed(5_011, 20_000, 4, slack=0.25, changed=0, lightest=1_751) == 1
    assert sockets_to_shed(5_010, 20_000, 4, slack=0.25, changed=0, lightest=1_751) == 0
    assert sockets_to_shed(6_300, 20_000, 4, slack=0.25, changed=0, lightest=3_750) == 50  # it has its part
    # A fleet count older than this hub's own (another hub's row not yet refreshed) never makes the target negative.
    assert sockets_to_shed(100, 40, 2, slack=0.25, changed=0) == 1  # fair 50, allowed 63


def test_rebalancing_pauses_when_the_shed_clients_keep_coming_back() -> None:
    ids = [uuid.uuid4() for _ in range(40)]
    # A random pick over two hubs: half come back here, the others stay away (counted once the window is over).
    random_lb = ShedReturns(window_s=60, pause_s=600, min_shed=20, futile_share=0.8)
    random_lb.shed(ids, now=0.0)
    for client in ids[:20]:
        random_lb.attached(client, now=1.0)
    assert not random_lb.paused(now=2.0) and not random_lb.paused(now=61.0)
    # Session affinity: every shed client is back at once. Paused for pause_s, then shedding may start again.
    sticky = ShedReturns(window_s=60, pause_s=600, min_shed=20, futile_share=0.8)
    sticky.shed(ids[:19], now=0.0)
    for client in ids[:19]:
        sticky.attached(client, now=0.5)
    assert not sticky.paused(now=1.0)  # 19 shed: too few to tell
    sticky.shed(ids[19:20], now=1.0)
    sticky.attached(ids[19], now=1.5)
    assert sticky.paused(now=2.0) and sticky.paused(now=601.0) and not sticky.paused(now=602.5)
    # A client that attaches without having been shed, or twice, counts nothing.
    sticky.attached(uuid.uuid4(), now=603.0)
    sticky.attached(ids[0], now=603.0)
    assert not sticky.paused(now=604.0)
