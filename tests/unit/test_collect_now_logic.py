"""Pure decisions of collect-now-api: scope hash, target client choice (§10.6), rate limits (§15.3)."""

from __future__ import annotations

import uuid
from datetime import date

from services.collect_now_api.logic import (
    ClientCandidate,
    accept_message,
    any_platform_healthy,
    check_rate_limits,
    choose_target_client,
    scope_hash,
)

DAY = date(2026, 4, 20)


def candidate(n: int, *, free: int = 2, attempts: int = 0, aborts: int = 0, age: float = 1.0,
              health: dict[str, str] | None = None) -> ClientCandidate:
    return ClientCandidate(client_id=uuid.UUID(int=n), max_concurrent_monitor=2, in_progress=2 - free,
                           attempts_last_minute=attempts, aborts_last_minute=aborts, heartbeat_age_s=age,
                           platform_health=health or {})


def test_scope_hash_ignores_order_and_duplicates_but_not_the_selection() -> None:
    base = scope_hash(brand_id=1, keyword_id=None, question_ids=[3, 1, 2], ai_platform_ids=None, business_date=DAY)
    assert base == scope_hash(brand_id=1, keyword_id=None, question_ids=[1, 2, 3, 3], ai_platform_ids=None,
                              business_date=DAY)
    assert len(base) == 64
    others = {
        scope_hash(brand_id=2, keyword_id=None, question_ids=[1, 2, 3], ai_platform_ids=None, business_date=DAY),
        scope_hash(brand_id=1, keyword_id=7, question_ids=[1, 2, 3], ai_platform_ids=None, business_date=DAY),
        scope_hash(brand_id=1, keyword_id=None, question_ids=[1, 2], ai_platform_ids=None, business_date=DAY),
        scope_hash(brand_id=1, keyword_id=None, question_ids=[1, 2, 3], ai_platform_ids=[1], business_date=DAY),
        scope_hash(brand_id=1, keyword_id=None, question_ids=[1, 2, 3], ai_platform_ids=None,
                   business_date=date(2026, 4, 21)),
        scope_hash(brand_id=1, keyword_id=None, question_ids=None, ai_platform_ids=None, business_date=DAY),
    }
    assert base not in others and len(others) == 6


def test_platform_health() -> None:
    assert any_platform_healthy({})  # nothing reported yet
    assert any_platform_healthy({"openai": "login_required", "gemini": "healthy"})
    assert not any_platform_healthy({"openai": "login_required", "gemini": "captcha"})


def test_the_explicit_client_is_used_when_it_is_eligible() -> None:
    clients = [candidate(1, free=2), candidate(2, free=0)]
    choice = choose_target_client(clients, requested=uuid.UUID(int=2), heartbeat_timeout_s=30)
    assert (choice.client_id, choice.reason) == (uuid.UUID(int=2), "requested")


def test_an_unavailable_explicit_client_falls_back_to_the_best_one() -> None:
    clients = [candidate(1), candidate(2, age=45)]  # 2: heartbeat too old
    choice = choose_target_client(clients, requested=uuid.UUID(int=2), heartbeat_timeout_s=30)
    assert (choice.client_id, choice.reason) == (uuid.UUID(int=1), "requested_unavailable")
    unknown = choose_target_client(clients, requested=uuid.UUID(int=99), heartbeat_timeout_s=30)
    assert unknown.client_id == uuid.UUID(int=1)


def test_ranking_capacity_then_abort_rate_then_heartbeat() -> None:
    by_capacity = [candidate(1, free=1), candidate(2, free=2, attempts=10, aborts=9), candidate(3, free=0)]
    assert choose_target_client(by_capacity, requested=None, heartbeat_timeout_s=30).client_id == uuid.UUID(int=2)
    by_abort_rate = [candidate(1, attempts=4, aborts=2), candidate(2, attempts=4, aborts=1), candidate(3, attempts=0)]
    assert choose_target_client(by_abort_rate, requested=None, heartbeat_timeout_s=30).client_id == uuid.UUID(int=3)
    by_heartbeat = [candidate(1, age=10), candidate(2, age=2)]
    assert choose_target_client(by_heartbeat, requested=None, heartbeat_timeout_s=30).client_id == uuid.UUID(int=2)


def test_unhealthy_or_silent_clients_are_never_chosen() -> None:
    logged_out = candidate(1, free=5, health={"openai": "login_required"})
    silent = candidate(2, age=30.0)  # exactly the timeout: not < 30 s
    none = choose_target_client([logged_out, silent], requested=None, heartbeat_timeout_s=30)
    assert (none.client_id, none.reason) == (None, "none_online")
    requested = choose_target_client([logged_out], requested=uuid.UUID(int=1), heartbeat_timeout_s=30)
    assert (requested.client_id, requested.reason) == (None, "requested_unavailable")


def test_rate_limits() -> None:
    ok = check_rate_limits(active_requests=1, max_active_requests=2, earliest_active_ttl_s=100,
                           user_requests_last_hour=19, max_user_requests_per_hour=20, oldest_user_request_age_s=10)
    assert ok is None
    active = check_rate_limits(active_requests=2, max_active_requests=2, earliest_active_ttl_s=99.2,
                               user_requests_last_hour=0, max_user_requests_per_hour=20, oldest_user_request_age_s=None)
    assert active is not None and (active.code, active.retry_after_s) == ("too_many_active_requests", 100)
    hourly = check_rate_limits(active_requests=0, max_active_requests=2, earliest_active_ttl_s=None,
                               user_requests_last_hour=20, max_user_requests_per_hour=20,
                               oldest_user_request_age_s=3000.5)
    assert hourly is not None and (hourly.code, hourly.retry_after_s) == ("too_many_requests", 600)
    floor = check_rate_limits(active_requests=0, max_active_requests=2, earliest_active_ttl_s=None,
                              user_requests_last_hour=20, max_user_requests_per_hour=20,
                              oldest_user_request_age_s=3600)
    assert floor is not None and floor.retry_after_s == 1
    zero = check_rate_limits(active_requests=0, max_active_requests=0, earliest_active_ttl_s=None,
                             user_requests_last_hour=0, max_user_requests_per_hour=20, oldest_user_request_age_s=None)
    assert zero is not None and zero.code == "too_many_active_requests"


def test_accept_message_says_what_happened() -> None:
    unbound = accept_message(client_id=None, reason="none_online", promoted=3, aborted_queued=0, interrupt_requested=0)
    assert "no desktop client is online" in unbound
    bound = accept_message(client_id=uuid.UUID(int=1), reason="requested_unavailable", promoted=3, aborted_queued=2,
                           interrupt_requested=1)
    assert "another online client was chosen" in bound and "2 queued" in bound and "1 running" in bound
