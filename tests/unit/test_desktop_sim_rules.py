"""The simulated client's local rules: §14.2 order, §10.2 generations, §10.4 safe points, backoff."""

from __future__ import annotations

import random

import pytest

from tools.desktop_sim.answers import compose_answer
from tools.desktop_sim.cli import parse_args, tokens_from_seed
from tools.desktop_sim.rules import (
    PHASES,
    LocalEntry,
    accepts_generation,
    backoff_delay,
    drain_delay_s,
    handles_interrupt_now,
    is_safe_point,
    order_locally,
)
from tools.desktop_sim.timings import TIMING_PROFILES


def entry(task_id: str, lane: str, priority: int, available_at: float = 0.0, enqueued_at: str = "",
          kind: str = "monitor") -> LocalEntry:
    return LocalEntry(task_id=task_id, kind=kind, lane=lane, priority=priority, available_at=available_at,
                      enqueued_at=enqueued_at, updated_at="")


def test_local_order_is_lane_weight_then_priority_then_available_then_enqueued() -> None:
    entries = [
        entry("retry", "retry", 99),
        entry("normal-late", "normal", 100, available_at=2.0),
        entry("normal-early", "normal", 100, available_at=1.0),
        entry("boosted", "normal_boosted", 1000),
        entry("normal-high-prio", "normal", 900, available_at=5.0),
        entry("high", "high", 5000, available_at=9.0),
        entry("publish", "normal", 12000, kind="publish"),
        entry("tie-b", "normal", 100, available_at=2.0, enqueued_at="2026-01-01T00:00:02Z"),
    ]
    assert [e.task_id for e in order_locally(entries)] == [
        "publish", "high", "boosted", "normal-high-prio", "normal-early", "normal-late", "tie-b", "retry"]


def test_monitor_high_never_outranks_publish_normal() -> None:
    ordered = order_locally([entry("high", "high", 5999), entry("pub", "normal", 10000, kind="publish")])
    assert ordered[0].task_id == "pub"


def test_generation_rule_accepts_equal_or_newer_only() -> None:
    assert accepts_generation(7, 7)
    assert accepts_generation(8, 7)
    assert not accepts_generation(6, 7)


def test_safe_points_and_not_started_phases() -> None:
    assert [p for p in PHASES if is_safe_point(p)] == ["NAVIGATING", "INPUTTING", "SUBMITTING", "PARSING"]
    # Never interrupt during login, while waiting for the platform, or while posting (§10.4).
    assert not any(is_safe_point(p) for p in ("AUTHENTICATING", "WAITING", "POSTING"))
    assert [p for p in PHASES if handles_interrupt_now(p)] == ["PREPARING", "NAVIGATING"]


def test_backoff_grows_exponentially_with_jitter_and_a_cap() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(n, base_s=0.1, max_s=5.0, rng=rng) for n in range(12)]
    assert 0.05 <= delays[0] <= 0.1
    assert 0.4 <= delays[3] <= 0.8
    assert all(d <= 5.0 for d in delays) and delays[-1] >= 2.5


def test_timing_profiles_fast_for_tests_and_slower_platforms_in_the_demo() -> None:
    fast = TIMING_PROFILES["fast"]
    assert fast.total("openai") < 0.5
    demo = TIMING_PROFILES["demo"]
    assert demo.total("openai") < demo.total("gemini") < demo.total("perplexity")
    assert abs(fast.scaled(10).total("openai") - fast.total("openai") * 10) < 1e-9


def test_demo_phases_vary_around_their_duration_so_a_fleet_drifts_out_of_lockstep() -> None:
    demo = TIMING_PROFILES["demo"].scaled(0.5)
    base = demo.duration("openai", "WAITING")
    assert base == 3.5 and demo.jitter == 0.3
    rng = random.Random(7)
    drawn = [demo.duration("openai", "WAITING", rng) for _ in range(2000)]
    assert all(base * 0.7 <= d <= base * 1.3 for d in drawn)
    assert min(drawn) < base * 0.75 and max(drawn) > base * 1.25  # the whole range is used
    assert abs(sum(drawn) / len(drawn) - base) < base * 0.02  # centred: the mean task length is unchanged
    # Without a random source, or with the jitter off, durations are exact (tests rely on it).
    assert demo.duration("openai", "WAITING") == base
    assert demo.with_jitter(0).duration("openai", "WAITING", rng) == base
    assert TIMING_PROFILES["fast"].duration("openai", "WAITING", rng) == TIMING_PROFILES["fast"].duration(
        "openai", "WAITING")
    with pytest.raises(ValueError, match="jitter"):
        demo.with_jitter(1.0)
    assert parse_args(["--jitter", "0"]).jitter == 0.0 and parse_args([]).jitter is None
    for bad in ("1.5", "-0.1", "lots"):
        with pytest.raises(SystemExit):
            parse_args(["--jitter", bad])


def test_answers_are_realistic_and_mention_the_brand_sometimes() -> None:
    rng = random.Random(3)
    answers = [compose_answer(question="What is the best CRM for a small business?", brand="Acme", platform="openai",
                              rng=rng, mention_rate=0.5) for _ in range(50)]
    mentioned = [a for a in answers if a.brand_mentioned]
    assert 10 < len(mentioned) < 40
    assert all("Acme" in a.text for a in mentioned) and not any("Acme" in a.text for a in answers
                                                                   if not a.brand_mentioned)
    assert all(1 <= len(a.citations) <= 4 and str(a.citations[0]["url"]).startswith("https://") for a in answers)


def test_tokens_from_seed_json() -> None:
    seed = {"platforms": [], "tenants": [{"tenant_id": 1, "clients": [{"client_id": "a", "token": "t1"}]},
                                         {"tenant_id": 2, "clients": [{"client_id": "b", "token": "t2"},
                                                                      {"client_id": "c", "token": "t3"}]}]}
    assert tokens_from_seed(seed) == [("a", "t1"), ("b", "t2"), ("c", "t3")]


def test_legacy_work_yields_only_before_it_really_started() -> None:
    import itertools

    from tools.desktop_sim.rules import PHASES, yields_at_checkpoint

    # desktop_tasks work: at a safe point, whatever the phase it leaves.
    assert [n for p, n in itertools.pairwise(PHASES) if yields_at_checkpoint("desktop_tasks", p, n)] == [
        "NAVIGATING", "INPUTTING", "SUBMITTING", "PARSING"]
    # legacy work (Phase 1): only while PREPARING or NAVIGATING, never once it is authenticating or later.
    assert [p for p, n in itertools.pairwise(PHASES) if yields_at_checkpoint("legacy", p, n)] == [
        "PREPARING", "NAVIGATING"]


def test_a_draining_hubs_close_names_the_reconnect_delay_and_no_other_close_does() -> None:
    assert drain_delay_s(4503, "draining; reconnect after 2750 ms") == 2.75
    assert drain_delay_s(4503, "draining") is None
    assert drain_delay_s(1001, "draining; reconnect after 2750 ms") is None
    assert drain_delay_s(None, "") is None
