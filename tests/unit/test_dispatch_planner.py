"""The dispatch decision tree, lane rules and tenant fairness (libs/domain/dispatch.py), with a fake clock."""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

from libs.domain.dispatch import (
    Candidate,
    ClientState,
    Ledger,
    PassLimits,
    cluster_room,
    evaluate,
    normal_client_room,
    pair_fetch_limit,
    plan_pass,
    round_robin,
    window_start,
)

_ids = itertools.count(1)


@dataclass
class FakeClock:
    now: float = 1_700_000_000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class World:
    clock: FakeClock = field(default_factory=FakeClock)

    def task(self, tenant: int = 1, *, lane: str = "normal", priority: int = 100, platform: int = 1,
             workspace: int | None = None, client: uuid.UUID | None = None, age_s: float = 0.0) -> Candidate:
        return Candidate(id=next(_ids), tenant_id=tenant, workspace_id=workspace if workspace is not None else tenant,
                         ai_platform_id=platform, lane=lane, priority=priority, enqueued_at=self.clock.now - age_s,
                         target_client_id=client)


def client(tenant: int = 1, *, workspace: int | None = None, max_concurrent: int = 2, max_queue_depth: int = 20,
           in_progress: int = 0, queued: int = 0, pending_high: bool = False, overdue: bool = False,
           generation: int = 0) -> ClientState:
    return ClientState(id=uuid.uuid4(), tenant_id=tenant, workspace_id=workspace if workspace is not None else tenant,
                       max_concurrent=max_concurrent, max_queue_depth=max_queue_depth, in_progress=in_progress,
                       queued=queued, pending_high=pending_high, interrupt_overdue=overdue,
                       interrupt_generation=generation)


def limits(cluster: int = 300, tenant: int = 30, **kw: object) -> PassLimits:
    return PassLimits(cluster_per_window=cluster, tenant_per_window=tenant, **kw)  # type: ignore[arg-type]


def ledger(**platform_limits: int) -> Ledger:
    return Ledger(platform_limit={int(k[1:]): v for k, v in platform_limits.items()}, default_platform_limit=100)


def by_lane(*tasks: Candidate) -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for t in tasks:
        out.setdefault(t.lane, []).append(t)
    return out


# ---- decision tree, in order ---------------------------------------------------------------------

def decide_one(task: Candidate, c: ClientState, led: Ledger, lim: PassLimits) -> str | None:
    _, reason = evaluate(task, led, lim, [c], {c.id: c}, normal_has_work=False)
    return reason


@pytest.mark.parametrize("lane", ["normal", "high"])
def test_tree_checks_cluster_budget_first(lane: str) -> None:
    w = World()
    c = client(in_progress=2, queued=20)  # every later check would fail too
    led = ledger()
    led.cluster_used = 300
    led.tenant_used[1] = 30
    led.platform_active[(1, 1)] = 100
    assert decide_one(w.task(lane=lane, client=c.id), c, led, limits()) == "cluster_budget"


def test_tree_order_for_normal_is_tenant_then_concurrency_then_queue_then_platform() -> None:
    w = World()
    c = client(in_progress=2, queued=20)
    led = ledger()
    led.tenant_used[1] = 30
    led.platform_active[(1, 1)] = 100
    task = w.task(client=c.id)
    assert decide_one(task, c, led, limits()) == "tenant_budget"
    led.tenant_used[1] = 29
    assert decide_one(task, c, led, limits()) == "client_concurrency"
    c.in_progress = 1
    assert decide_one(task, c, led, limits()) == "client_queue_depth"
    c.queued = 19
    assert decide_one(task, c, led, limits()) == "platform_concurrency"
    led.platform_active[(1, 1)] = 99
    assert decide_one(task, c, led, limits()) is None


def test_high_bypasses_tenant_budget_and_queue_depth_but_not_concurrency_or_platform() -> None:
    w = World()
    c = client(in_progress=1, queued=500)
    led = ledger()
    led.tenant_used[1] = 10_000
    high = w.task(lane="high", priority=5000, client=c.id)
    assert decide_one(high, c, led, limits()) is None
    c.in_progress = 2
    assert decide_one(high, c, led, limits()) == "client_concurrency"
    c.in_progress = 0
    led.platform_active[(1, 1)] = 100
    assert decide_one(high, c, led, limits()) == "platform_concurrency"


def test_platform_concurrency_is_per_tenant_and_platform_across_clients() -> None:
    w = World()
    a, b = client(), client()
    led = ledger(p1=1)
    plan = plan_pass(by_lane(w.task(), w.task(), w.task(platform=2)), [a, b], led, limits())
    # Only one openai (platform 1) execution for the tenant, even with two idle clients; gemini goes too.
    assert sorted(d.task.ai_platform_id for d in plan.decisions) == [1, 2]
    assert plan.rejections["platform_concurrency"] == 1
    # Another tenant's platform-1 account is independent.
    plan2 = plan_pass(by_lane(w.task(tenant=2)), [client(tenant=2)], led, limits())
    assert len(plan2.decisions) == 1


def test_queue_depth_sends_unbound_task_to_next_client_and_bound_task_waits() -> None:
    w = World()
    full = client(queued=20)
    free = client(queued=3)
    led = ledger()
    plan = plan_pass(by_lane(w.task()), [full, free], led, limits())
    assert [d.client_id for d in plan.decisions] == [free.id]
    bound = plan_pass(by_lane(w.task(client=full.id)), [full, free], ledger(), limits())
    assert bound.decisions == [] and bound.rejections == Counter({"client_queue_depth": 1})


def test_unbound_task_goes_to_least_loaded_client_of_same_tenant_and_workspace() -> None:
    w = World()
    other_ws = client(workspace=9)
    other_tenant = client(tenant=2, workspace=1)
    busy = client(in_progress=1, queued=4)
    idle = client(queued=1)
    plan = plan_pass(by_lane(w.task(workspace=1)), [other_ws, other_tenant, busy, idle], ledger(), limits())
    assert [d.client_id for d in plan.decisions] == [idle.id]
    none = plan_pass(by_lane(w.task(tenant=3)), [other_ws, busy], ledger(), limits())
    assert none.rejections == Counter({"no_eligible_client": 1})


def test_budgets_are_spent_within_a_pass() -> None:
    w = World()
    clients = [client(max_queue_depth=1000)]
    tasks = [w.task(platform=p) for p in range(1, 11) for _ in range(5)]
    plan = plan_pass(by_lane(*tasks), clients, ledger(), limits(cluster=1000, tenant=7))
    assert len(plan.decisions) == 7
    assert plan.rejections["tenant_budget"] == 1  # the tenant is then skipped for the rest of the pass
    led = ledger()
    plan = plan_pass(by_lane(*tasks), clients, led, limits(cluster=20, tenant=1000, high_reserved_share=0.1))
    assert len(plan.decisions) == 18  # 20 - ceil(20 * 0.1) reserved for high
    assert plan.cluster_exhausted and led.non_high_used == 18


def test_high_keeps_headroom_that_normal_cannot_spend() -> None:
    w = World()
    c = client(max_queue_depth=1000, max_concurrent=100)
    led = ledger()
    lim = limits(cluster=100, tenant=1000, high_reserved_share=0.1)
    normal = [w.task(platform=p) for p in range(1000, 1200)]
    plan_pass(by_lane(*normal), [c], led, lim)
    assert led.cluster_used == 90
    high = [w.task(lane="high", priority=5000, platform=p) for p in range(1, 20)]
    plan = plan_pass(by_lane(*high), [c], led, lim)
    assert len(plan.decisions) == 10 and led.cluster_used == 100


# ---- lane rules (§9.3) ---------------------------------------------------------------------------

def test_lane_order_high_then_boosted_then_normal_then_retry() -> None:
    w = World()
    c, h = client(max_queue_depth=100), client()
    tasks = [w.task(lane="retry", priority=50, platform=1), w.task(lane="normal", platform=2),
             w.task(lane="normal_boosted", priority=1200, platform=3),
             w.task(lane="high", priority=5000, platform=4, client=h.id)]
    plan = plan_pass(by_lane(*tasks), [c, h], ledger(), limits())
    assert [d.task.lane for d in plan.decisions] == ["high", "normal_boosted", "normal", "retry"]


def test_within_a_tenant_lane_order_is_priority_desc_then_oldest_first() -> None:
    w = World()
    young_high_prio = w.task(lane="normal_boosted", priority=1500)
    w.clock.advance(60)
    old_low = w.task(lane="normal_boosted", priority=1100, age_s=600)
    new_low = w.task(lane="normal_boosted", priority=1100)
    ordered = round_robin([new_low, old_low, young_high_prio], None)
    assert ordered == [young_high_prio, old_low, new_low]


def test_no_new_normal_to_a_client_with_pending_high_but_other_clients_unaffected() -> None:
    w = World()
    with_high = client(pending_high=True)
    plan = plan_pass(by_lane(w.task(client=with_high.id)), [with_high], ledger(), limits())
    assert plan.decisions == [] and plan.rejections == Counter({"client_has_high": 1})
    other = client()
    plan = plan_pass(by_lane(w.task()), [with_high, other], ledger(), limits())
    assert [d.client_id for d in plan.decisions] == [other.id]


def test_high_dispatched_in_a_pass_blocks_normal_on_that_client_in_the_same_pass() -> None:
    w = World()
    c = client(generation=7)
    plan = plan_pass(by_lane(w.task(lane="high", priority=5000, client=c.id), w.task(platform=2)), [c], ledger(),
                     limits())
    assert [(d.task.lane, d.interrupt_generation) for d in plan.decisions] == [("high", 7)]
    assert plan.rejections == Counter({"client_has_high": 1})


def test_no_new_normal_to_a_client_whose_interrupt_is_overdue() -> None:
    w = World()
    late = client(overdue=True)
    plan = plan_pass(by_lane(w.task()), [late], ledger(), limits())
    assert plan.decisions == [] and plan.rejections == Counter({"client_interrupt_overdue": 1})
    plan = plan_pass(by_lane(w.task(lane="high", priority=5000, platform=2)), [late], ledger(), limits())
    assert [d.task.lane for d in plan.decisions] == ["high"]


def test_normal_keeps_its_background_share_while_high_is_busy() -> None:
    w = World()
    clients = [client(max_concurrent=1000, max_queue_depth=100_000) for _ in range(3)]
    led = ledger()
    lim = limits(cluster=100, tenant=1000, normal_background_share=0.15)
    high = [w.task(lane="high", priority=5000, platform=p, client=clients[0].id) for p in range(1, 200)]
    normal = [w.task(platform=p) for p in range(1000, 1200)]
    plan = plan_pass(by_lane(*high, *normal), clients, led, lim)
    lanes = Counter(d.task.lane for d in plan.decisions)
    assert lanes == Counter({"high": 85, "normal": 15})
    # Without normal work, high may use the whole window.
    led2 = ledger()
    plan = plan_pass(by_lane(*high), clients, led2, lim)
    assert len(plan.decisions) == 100


def test_background_share_counts_normal_already_dispatched_this_window() -> None:
    led = ledger()
    led.non_high_used = led.cluster_used = 15
    lim = limits(cluster=100, normal_background_share=0.15)
    assert cluster_room("high", led, lim, normal_has_work=True) == 85
    led.non_high_used = led.cluster_used = 5
    assert cluster_room("high", led, lim, normal_has_work=True) == 85
    assert cluster_room("high", led, lim, normal_has_work=False) == 95


def test_retry_waits_until_high_and_normal_backlogs_are_low() -> None:
    w = World()
    c = client(max_queue_depth=100)
    tasks = by_lane(w.task(lane="retry", priority=50))
    lim = limits(retry_low_watermark=10)
    blocked = plan_pass(tasks, [c], ledger(), lim, cluster_high_backlog=0, tenant_normal_backlog={1: 11})
    assert blocked.decisions == [] and blocked.rejections == Counter({"retry_waits_for_low_water": 1})
    blocked = plan_pass(tasks, [c], ledger(), lim, cluster_high_backlog=11, tenant_normal_backlog={1: 0})
    assert blocked.decisions == []
    ok = plan_pass(tasks, [c], ledger(), lim, cluster_high_backlog=3, tenant_normal_backlog={1: 10})
    assert len(ok.decisions) == 1


def test_paused_lane_and_auto_slowdown_stop_normal_but_keep_high() -> None:
    w = World()
    c = client()
    tasks = by_lane(w.task(lane="high", priority=5000), w.task(platform=2), w.task(lane="retry", platform=3))
    slow = plan_pass(tasks, [c], ledger(), limits(slowdown=True))
    assert [d.task.lane for d in slow.decisions] == ["high"]
    assert slow.rejections["auto_slowdown"] == 2
    paused = plan_pass(by_lane(w.task(platform=4)), [client()], ledger(), limits(paused_lanes=frozenset({"normal"})))
    assert paused.decisions == [] and paused.rejections == Counter({"lane_paused": 1})


# ---- fairness ------------------------------------------------------------------------------------

def test_round_robin_interleaves_tenants_and_resumes_after_the_last_served() -> None:
    w = World()
    a = [w.task(tenant=1, age_s=1000 - i) for i in range(3)]
    b = [w.task(tenant=2) for _ in range(2)]
    c = [w.task(tenant=3)]
    assert [t.tenant_id for t in round_robin([*a, *b, *c], None)] == [1, 2, 3, 1, 2, 1]
    assert [t.tenant_id for t in round_robin([*a, *b, *c], 1)] == [2, 3, 1, 2, 1, 1]
    assert [t.tenant_id for t in round_robin([*a, *b, *c], 3)] == [1, 2, 3, 1, 2, 1]


def test_a_huge_backlog_does_not_take_more_than_its_share_of_the_cluster_budget() -> None:
    """Tenant 1 has 5,000 ready tasks enqueued an hour earlier; nine tenants have 100 each."""
    w = World()
    big = [w.task(tenant=1, platform=p % 50, age_s=3600) for p in range(5000)]
    small = [w.task(tenant=t, platform=p % 50) for t in range(2, 11) for p in range(100)]
    clients = [client(tenant=t, max_queue_depth=10_000) for t in range(1, 11)]
    lim = limits(cluster=100, tenant=1000, high_reserved_share=0.0)
    served: Counter[int] = Counter()
    last: dict[str, int] = {}
    for _window in range(5):  # five budget windows
        plan = plan_pass({"normal": big + small}, clients, ledger(), lim, last_served=last)
        last.update(plan.last_served)
        per_window = Counter(d.task.tenant_id for d in plan.decisions)
        assert sum(per_window.values()) == 100
        assert max(per_window.values()) - min(per_window.values()) <= 1  # 10 each
        served.update(per_window)
    assert served[1] == 50 and all(served[t] == 50 for t in range(2, 11))


def test_rotation_gives_leftover_slots_to_different_tenants_across_passes() -> None:
    w = World()
    tasks = [w.task(tenant=t, platform=p) for t in range(1, 4) for p in range(10)]
    clients = [client(tenant=t, max_queue_depth=100) for t in range(1, 4)]
    last: dict[str, int] = {}
    firsts = []
    for _ in range(3):
        plan = plan_pass({"normal": tasks}, clients, ledger(), limits(cluster=1000, tenant=1000), last_served=last,
                         max_dispatches=1)
        firsts.append(plan.decisions[0].task.tenant_id)
        last.update(plan.last_served)
    assert firsts == [1, 2, 3]


def test_window_start_and_pair_fetch_limit() -> None:
    clock = FakeClock(now=1_700_000_059.9)
    assert window_start(clock.now, 60) == 1_700_000_040.0
    assert window_start(clock.advance(0.2), 60) == 1_700_000_040.0
    assert window_start(clock.advance(40), 60) == 1_700_000_100.0
    assert window_start(clock.now, 5) == 1_700_000_100.0
    assert pair_fetch_limit(0, 10, lane="normal", cap=50) == 0
    assert pair_fetch_limit(3, 0, lane="normal", cap=50) == 0
    assert pair_fetch_limit(3, 0, lane="high", cap=50) == 5
    assert pair_fetch_limit(100, 100, lane="normal", cap=50) == 50


def test_pair_fetch_limit_is_bounded_by_what_the_tenants_clients_can_take() -> None:
    assert pair_fetch_limit(100, 100, lane="normal", cap=50, client_room=3) == 5
    assert pair_fetch_limit(100, 100, lane="normal", cap=50, client_room=0) == 0
    assert pair_fetch_limit(100, 100, lane="high", cap=50, client_room=0) == 50  # high ignores it


def test_normal_client_room_per_tenant_and_the_reason_when_none() -> None:
    def client(tenant: int, **kw: object) -> ClientState:
        return ClientState(id=uuid.uuid4(), tenant_id=tenant, workspace_id=1, max_concurrent=2, max_queue_depth=5,
                           **kw)  # type: ignore[arg-type]

    room, refused = normal_client_room([
        client(1, queued=2), client(1, queued=5),            # one full queue; the other takes 3 more
        client(2, in_progress=2), client(2, pending_high=True),  # busy, and reserved for high work
        client(3, interrupt_overdue=True),
    ])
    assert room == {1: 3}
    # As choose_client reports it: the least-loaded client's reason.
    assert refused == {2: "client_has_high", 3: "client_interrupt_overdue"}
    assert 4 not in room and 4 not in refused  # no eligible client at all: the caller's "no_eligible_client"
