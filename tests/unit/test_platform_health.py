"""Platform-health pause (pure): which platforms a client's report blocks, which tenant platforms are held,
and that the dispatch tree keeps scheduled work of a blocked platform off that client only."""

from __future__ import annotations

import uuid

from libs.domain.dispatch import Candidate, ClientState, Ledger, PassLimits, plan_pass
from libs.domain.platform_health import ClientHealth, blocked_platforms, paused_pairs

IDS = {"openai": 1, "gemini": 2, "perplexity": 3}


def test_blocking_states_block_their_platform_only() -> None:
    assert blocked_platforms(None, IDS) == frozenset()
    assert blocked_platforms({"openai": "healthy", "gemini": "degraded", "perplexity": "unknown"}, IDS) == frozenset()
    assert blocked_platforms({"openai": "login_required", "gemini": "captcha", "perplexity": "healthy"},
                             IDS) == frozenset({1, 2})
    assert blocked_platforms({"openai": "rate_limited", "mystery": "login_required"}, IDS) == frozenset({1})
    assert blocked_platforms({"openai": "login_required"}, IDS, ignored=[1]) == frozenset()


def test_a_tenant_platform_is_paused_when_every_eligible_client_blocks_it() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    one_blocks = [ClientHealth(a, 7, frozenset({1})), ClientHealth(b, 7, frozenset())]
    both_block = [ClientHealth(a, 7, frozenset({1})), ClientHealth(b, 7, frozenset({1, 2}))]
    assert paused_pairs(one_blocks, {}, [1, 2, 3]) == {}
    assert paused_pairs(both_block, {}, [1, 2, 3]) == {(7, 1): "health"}
    assert paused_pairs(both_block, {(7, 1): "ignore_health"}, [1, 2, 3]) == {}
    assert paused_pairs(one_blocks, {(7, 3): "pause"}, [1, 2, 3]) == {(7, 3): "operator"}


def _task(task_id: int, platform: int, lane: str = "normal", client: uuid.UUID | None = None) -> Candidate:
    return Candidate(id=task_id, tenant_id=7, workspace_id=7, ai_platform_id=platform, lane=lane, priority=100,
                     enqueued_at=float(task_id), target_client_id=client)


def test_scheduled_work_of_a_blocked_platform_goes_to_a_client_whose_login_works() -> None:
    broken, working = uuid.uuid4(), uuid.uuid4()
    clients = [ClientState(id=broken, tenant_id=7, workspace_id=7, max_concurrent=2, max_queue_depth=20,
                           blocked_platforms=frozenset({1})),
               ClientState(id=working, tenant_id=7, workspace_id=7, max_concurrent=2, max_queue_depth=20,
                           queued=5)]  # busier: the planner would pick `broken` first if it could
    ledger = Ledger(platform_limit={1: 10, 2: 10})
    result = plan_pass({"normal": [_task(1, 1), _task(2, 2)]}, clients, ledger,
                       PassLimits(cluster_per_window=100, tenant_per_window=100))
    placed = {d.task.id: d.client_id for d in result.decisions}
    assert placed == {1: working, 2: broken}  # openai avoids the broken login; gemini still goes there


def test_a_paused_tenant_platform_holds_scheduled_work_but_not_high() -> None:
    clicked, other = uuid.uuid4(), uuid.uuid4()
    clients = [ClientState(id=c, tenant_id=7, workspace_id=7, max_concurrent=5, max_queue_depth=20)
               for c in (clicked, other)]
    ledger = Ledger(platform_limit={1: 10, 2: 10}, paused_pairs=frozenset({(7, 1)}))
    result = plan_pass({"normal": [_task(1, 1), _task(2, 2)], "retry": [_task(4, 1, "retry")],
                        "high": [_task(3, 1, "high", clicked)]}, clients, ledger,
                       PassLimits(cluster_per_window=100, tenant_per_window=100))
    assert {d.task.id: d.client_id for d in result.decisions} == {3: clicked, 2: other}
    assert result.rejections["tenant_platform_paused"] == 2
