"""The legacy (Phase 1) execution path and the migration between the paths, end to end (docs/legacy-path.md): real
outbox-pump, dispatch-coordinator, dispatch-hub, collect-now-api, ingest-shard-workers and reconciler processes,
Postgres, RabbitMQ, and simulated desktop clients over real WebSockets.

(a) rollout 0 from the start: a day's scheduled work runs on the legacy path, results ingested;
(b) a collect-now for a legacy tenant: Phase-1 preemption;
(c) rollout 50 %: both paths at once, collect-nows on both, no business task ever held by both paths;
(d) rollback mid-day (dry run, apply, with and without --force), then rollout back to 100.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from tests.support.db import fetch as rows
from tests.support.db import one
from tests.support.desktop import insert_ready_task
from tests.support.monitorctl import monitorctl_json
from tests.support.stack import DISPATCH_SERVICES, Stack, running_stack
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions

FAST = TIMING_PROFILES["fast"]
SERVICES = (*DISPATCH_SERVICES, "reconciler")
# A preempting click waits for its tenant's lock and for the rows a dispatch pass holds (the client's row, the scope's
# tasks; LOCK_CLIENTS): 1 s by default, then 429 tenant_busy. A pass on a machine another test's stack also loads
# can hold them longer, so these clicks wait up to 10 s (the answer is what these tests check, not the lock wait:
# tests/integration/test_collect_now_api.py checks the 429).
ENV: dict[str, str | int] = {"HUB_HEARTBEAT_FLUSH_S": "0.3", "HUB_PING_INTERVAL_S": "1",
                             "COLLECT_NOW_LOCK_WAIT_MS": "10000"}

pytestmark = pytest.mark.timeout(240)


def sim(stack: Stack, token: str, *, scale: float = 1.0, **options: Any) -> SimClient:
    return SimClient(SimOptions(hub_url=stack.hub_url, token=token, timings=FAST.scaled(scale),
                                heartbeat_interval_s=1.0, ws_ping_interval_s=2.0, idle_poll_s=1.0, seed=11,
                                **options))


@contextlib.asynccontextmanager
async def fleet(stack: Stack, tokens: list[str], *, scale: float = 1.0) -> AsyncIterator[list[SimClient]]:
    clients = [sim(stack, token, scale=scale) for token in tokens]
    async with contextlib.AsyncExitStack() as stack_:
        for client in clients:
            await stack_.enter_async_context(client)
        yield clients


async def seed(pool: AsyncConnectionPool[Conn], *, tenants: int = 1, first_tenant_id: int | None = None,
               rollout: int, questions: int = 4, clients: int = 2, due: bool = True) -> dict[str, Any]:
    async with pool.connection() as conn:
        if first_tenant_id is not None:
            await conn.execute("SELECT setval('tenants_id_seq', %s, false)", (first_tenant_id,))
        world = await seed_demo(conn, tenants=tenants, brands=2, questions=questions, clients=clients,
                                platforms=("openai", "gemini"), due=due)
        await conn.execute("UPDATE platform_settings SET max_concurrent = 20")
        await conn.execute("UPDATE desktop_clients SET max_concurrent_monitor = 2")
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000,
                           "rollout_percentage": rollout}.items():
            await set_setting(conn, key, value)
    return world


async def all_done(pool: AsyncConnectionPool[Conn], *, expected: int | None = None) -> bool:
    """No business task open, and some (`expected` of them, when given: the schedule's every task created) exist."""
    row = await one(pool, "SELECT count(*) FILTER (WHERE status NOT IN ('completed', 'failed', 'expired', 'skipped')) "
                          "AS open, count(*) AS n FROM monitoring_collect_tasks")
    return int(row["open"]) == 0 and (int(row["n"]) > 0 if expected is None else int(row["n"]) == expected)


async def never_both_paths(pool: AsyncConnectionPool[Conn]) -> list[dict[str, Any]]:
    """Business tasks that were ever held by both paths at the same instant: an execution's attempt interval and a
    legacy lease's [created_at, finished_at) overlapping (an open one runs to now). An end stamped before its start
    (by a transaction that began before the one that started it committed) spans the two stamps the other way round."""
    return await rows(pool, """
        SELECT a.monitor_task_id, a.task_id, l.id AS lease_id
        FROM desktop_task_attempts a JOIN legacy_leases l ON l.monitor_task_id = a.monitor_task_id
        CROSS JOIN LATERAL (SELECT coalesce(a.finished_at, now()) AS a_end, coalesce(l.finished_at, now()) AS l_end) e
        WHERE tstzrange(least(a.started_at, e.a_end), greatest(a.started_at, e.a_end)) &&
              tstzrange(least(l.created_at, e.l_end), greatest(l.created_at, e.l_end))
        UNION ALL
        SELECT d.monitor_task_id, d.id, l.id
        FROM desktop_tasks d JOIN legacy_leases l ON l.monitor_task_id = d.monitor_task_id
        WHERE d.kind = 'monitor' AND d.status IN ('queued', 'in_progress', 'unknown')
          AND l.status IN ('queued', 'in_progress')""")


async def test_a_rollout_zero_runs_a_days_schedule_on_the_legacy_path(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    world = await seed(pool, rollout=0)
    tenant = world["tenants"][0]
    async with running_stack(settings, tmp_path, services=SERVICES, **ENV) as stack, \
            fleet(stack, [c["token"] for c in tenant["clients"]]) as clients:
        # Every plan's task (a question x platform each), not the first ones done before the rest were seen (CI saw a
        # pending task after an earlier "all done").
        expected = sum(len(b["question_ids"]) for b in tenant["brands"]) * len(world["platforms"])
        await eventually(lambda: all_done(pool, expected=expected), timeout=90, interval=0.2,
                         message=f"every scheduled task completed\n{stack.logs()}")
        tasks = await rows(pool, "SELECT id, status, execution_owner, leased_to_executor, legacy_lease_id, "
                                 "lease_token_hash FROM monitoring_collect_tasks")
        assert {t["execution_owner"] for t in tasks} == {"legacy"}
        assert {t["status"] for t in tasks} == {"completed"}
        assert all(t["leased_to_executor"] is None and t["legacy_lease_id"] is None and t["lease_token_hash"] is None
                   for t in tasks), "a completed legacy task keeps no lease"
        # Nothing ran on the desktop_tasks path; every task has one succeeded legacy lease and one run row.
        assert (await one(pool, "SELECT count(*) AS n FROM desktop_tasks"))["n"] == 0
        leases = await rows(pool, "SELECT monitor_task_id, status, target_client_id FROM legacy_leases")
        succeeded = [lease for lease in leases if lease["status"] == "succeeded"]
        assert sorted(lease["monitor_task_id"] for lease in succeeded) == sorted(t["id"] for t in tasks)
        runs = await one(pool, "SELECT count(*) AS n FROM question_monitor_runs")
        assert runs["n"] == len(tasks)
        # The clients were told the path, and posted every result (which client took which is the coordinator's).
        owners = {owner for client in clients for owner in client.stats.owners.values()}
        assert owners == {"legacy"}
        assert sum(len(client.stats.executed) for client in clients) >= len(succeeded)
        # The budget counted every offer (the ledger of the window equals the offers made).
        assert await _budget_counted(pool) == len(leases)
        assert await never_both_paths(pool) == []


async def _budget_counted(pool: AsyncConnectionPool[Conn]) -> int:
    row = await one(pool, "SELECT coalesce(sum(used), 0) AS n FROM dispatch_budget_ledger")
    return int(row["n"])


class HandClient:
    """A desktop client driven step by step by the test (its WebSocket, lease, extend, cancel and result calls), for
    moments a simulated client's timings cannot pin down: a lease held in PREPARING beside one in AUTHENTICATING."""

    def __init__(self, http: aiohttp.ClientSession, stack: Stack, token: str) -> None:
        self.http, self.stack, self.token = http, stack, token
        self.events: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def connect(self) -> None:
        self._ws = ws = await self.http.ws_connect(self.stack.hub_url + "/api/desktop/ws", headers=self.headers)
        self._tasks = [asyncio.create_task(self._read(ws)), asyncio.create_task(self._beat(ws))]

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.events.append(json.loads(msg.data))

    async def _beat(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while not ws.closed:
            await ws.send_str('{"type":"heartbeat"}')
            await asyncio.sleep(0.5)  # a heartbeat cadence, not a wait for a condition

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(self.stack.hub_url + path, json=body, headers=self.headers) as resp:
            return resp.status, await resp.json()

    async def lease(self, n: int) -> list[dict[str, Any]]:
        status, body = await self.call("/api/desktop/monitor/lease", {"max_tasks": n})
        assert status == 200, body
        return list(body["tasks"])

    async def post_result(self, task: dict[str, Any]) -> None:
        now = datetime.now(UTC).isoformat()
        status, body = await self.call(f"/api/desktop/tasks/{task['task_id']}/result", {
            "lease_token": task["lease_token"], "status": "succeeded", "answer_text": "an answer",
            "brand_mentioned": True, "started_at": now, "finished_at": now})
        assert status == 202, body

    def controls(self, task_id: str) -> list[str]:
        return [e["control"] for e in self.events if e.get("type") == "task_control" and e["task_id"] == task_id]


async def _legacy_world(pool: AsyncConnectionPool[Conn], *, scheduled: int) -> dict[str, Any]:
    """One legacy tenant (rollout 0), one client running two tasks at once; brand 0 has `scheduled` ready tasks
    (on the legacy path), brand 1 is what the user collects now."""
    world = await seed(pool, rollout=0, clients=1, due=False)
    tenant = world["tenants"][0]
    async with pool.connection() as conn:
        for index in range(scheduled):
            await insert_ready_task(conn, tenant=tenant, brand_index=0, question_index=index,
                                    platform_id=world["platforms"][0]["ai_platform_id"], age_s=60 - index)
        await conn.execute("UPDATE monitoring_collect_tasks SET execution_owner = 'legacy'")
    return world


async def test_b_collect_now_on_a_legacy_tenant_preempts_phase_one_style(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    world = await _legacy_world(pool, scheduled=3)
    tenant = world["tenants"][0]
    client = tenant["clients"][0]
    clicked_brand = tenant["brands"][1]["brand_id"]
    async with running_stack(settings, tmp_path, services=SERVICES, **ENV) as stack, \
            aiohttp.ClientSession() as http:
        hand = HandClient(http, stack, client["token"])
        await hand.connect()
        try:
            # The coordinator offers all three scheduled tasks to the client (its queue takes them) ...
            await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM legacy_leases WHERE status = 'queued'",
                                            want=3), timeout=20, message=f"three offers\n{stack.logs()}")
            # ... it pulls two: one stays PREPARING, the other moves on to AUTHENTICATING; the third stays offered.
            preparing, started = await hand.lease(2)
            assert {preparing["execution_owner"], started["execution_owner"]} == {"legacy"}
            status, _ = await hand.call(f"/api/desktop/tasks/{started['task_id']}/extend", {
                "lease_token": started["lease_token"], "execution_phase": "AUTHENTICATING"})
            assert status == 200
            offered = (await one(pool, "SELECT id FROM legacy_leases WHERE status = 'queued'"))["id"]
            offered_task = (await one(pool, "SELECT monitor_task_id FROM legacy_leases WHERE id = %s",
                                      offered))["monitor_task_id"]
            budget_before = await _budget_counted(pool)

            accepted = await stack.collect_now(tenant, clicked_brand, {"target_client_id": client["client_id"],
                                                                       "preempt": True})
            assert accepted["aborted_queued_count"] == 1 and accepted["interrupt_requested_count"] == 2, accepted
            clicked_at = await one(pool, "SELECT now() AS at")
            # The unpulled offer is withdrawn at once (budget given back), its task pending again.
            withdrawn = await one(pool, "SELECT status, interrupt_reason FROM legacy_leases WHERE id = %s", offered)
            assert withdrawn == {"status": "aborted", "interrupt_reason": "collect_now_preempt"}
            task = await one(pool, "SELECT status, dispatch_lane, leased_to_executor, execution_owner "
                                   "FROM monitoring_collect_tasks WHERE id = %s", offered_task)
            assert task == {"status": "pending", "dispatch_lane": "normal", "leased_to_executor": None,
                            "execution_owner": "legacy"}
            assert await _budget_counted(pool) == budget_before - 1
            # The promoted tasks stay on the legacy path (promoted in place).
            high = await rows(pool, "SELECT id, execution_owner FROM monitoring_collect_tasks "
                                    "WHERE dispatch_lane = 'high'")
            assert high and {t["execution_owner"] for t in high} == {"legacy"}
            # Both leases are told to yield; the server has not cleared them.
            for lease in (preparing, started):
                await eventually(lambda lease=lease: "interrupt_requested" in hand.controls(lease["task_id"]),
                                 timeout=10, message=f"interrupt for {lease['task_id']}\n{hand.events}")
            assert "cancelled" in hand.controls(str(offered))
            live = await rows(pool, "SELECT t.status FROM legacy_leases l JOIN monitoring_collect_tasks t "
                                    "ON t.legacy_lease_id = l.id WHERE l.status = 'in_progress'")
            assert [r["status"] for r in live] == ["leased", "leased"]
            # Phase 1 on the client: the PREPARING one yields ...
            generation = accepted["interrupt_generation"]
            status, body = await hand.call(f"/api/desktop/tasks/{preparing['task_id']}/cancel", {
                "lease_token": preparing["lease_token"], "reason": "collect_now_preempt",
                "interrupt_generation": generation, "execution_phase": "PREPARING"})
            assert status == 200, body
            # The yielded task is pending again with its dispatch attempt given back. Checked here, while the client
            # has high work pending and so cannot be offered it again: after the request succeeds it may be (and is
            # then counted a new attempt), which a busy CI machine once did before the check at the end ran.
            yielded_id = uuid.UUID(preparing["task_id"])
            yielded = await one(pool, "SELECT t.status, t.dispatch_attempts FROM monitoring_collect_tasks t "
                                      "JOIN legacy_leases l ON l.monitor_task_id = t.id WHERE l.id = %s", yielded_id)
            assert yielded == {"status": "pending", "dispatch_attempts": 0}, yielded
            # ... the started one runs to its result; meanwhile no new normal work is offered to the client.
            status, body = await hand.call(f"/api/desktop/tasks/{started['task_id']}/extend", {
                "lease_token": started["lease_token"], "execution_phase": "WAITING"})
            assert status == 200 and body["interrupt_requested"], body
            await hand.post_result(started)
            # Then the high tasks: offered to this client, leased, completed.
            await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM legacy_leases WHERE lane = 'high' "
                                                  "AND status = 'queued'", want=len(high)),
                             timeout=20, message=f"the high offers\n{stack.logs()}")
            done_high: set[str] = set()
            while len(done_high) < len(high):  # as many at a time as the client's two slots take
                # The client has high work pending (offered or still to offer) until it pulls the last of it: no
                # normal offer may have been made to it since the click. After that pull its free slots may take
                # normal work again (the lane rule is "no normal while high is pending", docs/legacy-path.md), so
                # this is checked before each pull, not once the request has succeeded: ingest marks it succeeded
                # a while after the last result, and a loaded machine made that while long enough for an offer.
                assert await _normal_offered_since(pool, clicked_at["at"]) == 0, \
                    "normal work offered to the client while it was preempted"
                leased_high = await hand.lease(2)
                assert {t["lane"] for t in leased_high} <= {"high"}, leased_high
                for task_ in leased_high:
                    await hand.post_result(task_)
                    done_high.add(task_["task_id"])
                if not leased_high:
                    await eventually(lambda: _count(
                        pool, "SELECT count(*) AS n FROM legacy_leases WHERE lane = 'high' AND status = 'queued'",
                        want=len(high) - len(done_high)), timeout=10, message="the next high offers")
            request = uuid.UUID(accepted["request_id"])
            await eventually(lambda: _request_status(pool, request, "succeeded"), timeout=20,
                             message=f"the request succeeded\n{stack.logs()}")
            # The yielded task is still to run: pending, or offered again once the client had room (one new attempt).
            yielded = await one(pool, "SELECT t.status, t.dispatch_attempts FROM monitoring_collect_tasks t "
                                      "JOIN legacy_leases l ON l.monitor_task_id = t.id WHERE l.id = %s", yielded_id)
            assert yielded in ({"status": "pending", "dispatch_attempts": 0},
                               {"status": "leased", "dispatch_attempts": 1}), yielded
            assert await never_both_paths(pool) == []
        finally:
            await hand.close()


async def _normal_offered_since(pool: AsyncConnectionPool[Conn], since: datetime) -> int:
    row = await one(pool, "SELECT count(*) AS n FROM legacy_leases WHERE lane <> 'high' AND created_at > %s", since)
    return int(row["n"])


async def _count(pool: AsyncConnectionPool[Conn], query: str, *, want: int | None = None,
                 want_at_least: int | None = None) -> bool:
    n = int((await one(pool, query))["n"])
    return n == want if want is not None else n >= (want_at_least or 0)


async def _request_status(pool: AsyncConnectionPool[Conn], request_id: uuid.UUID, status: str) -> bool:
    row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request_id)
    return bool(row["status"] == status)


async def test_c_half_rollout_runs_both_paths_at_once(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                      tmp_path: Path) -> None:
    # Tenants 49 and 50 at rollout 50: 49 % 100 < 50 takes desktop_tasks, 50 takes legacy.
    world = await seed(pool, tenants=2, first_tenant_id=49, rollout=50)
    desktop_tenant, legacy_tenant = world["tenants"]
    assert (desktop_tenant["tenant_id"], legacy_tenant["tenant_id"]) == (49, 50)
    tokens = [c["token"] for t in world["tenants"] for c in t["clients"]]
    async with running_stack(settings, tmp_path, services=SERVICES, **ENV) as stack, \
            fleet(stack, tokens, scale=3) as clients:
        # Collect-now on both tenants while their scheduled work runs: each re-collects brand 1 now.
        await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks WHERE status = "
                                              "'completed'", want_at_least=2), timeout=60, interval=0.1,
                         message=f"scheduled work running\n{stack.logs()}")
        requests = []
        for tenant in (desktop_tenant, legacy_tenant):
            accepted = await stack.collect_now(tenant, tenant["brands"][1]["brand_id"], {"preempt": True})
            requests.append(uuid.UUID(accepted["request_id"]))
        await eventually(lambda: all_done(pool), timeout=150, interval=0.2,
                         message=f"every task completed\n{stack.logs()}")
        for request in requests:
            row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s", request)
            assert row["status"] in ("succeeded", "partial"), row
        owners = await rows(pool, "SELECT tenant_id, execution_owner, count(*) AS n, "
                                  "count(*) FILTER (WHERE status = 'completed') AS completed "
                                  "FROM monitoring_collect_tasks GROUP BY 1, 2 ORDER BY 1, 2")
        assert [(r["tenant_id"], r["execution_owner"]) for r in owners] == [(49, "desktop_tasks"), (50, "legacy")]
        assert all(r["n"] == r["completed"] for r in owners), owners
        # Each path ran its own tenant's work only.
        paths = await rows(pool, """
            SELECT 'desktop_tasks' AS path, d.tenant_id FROM desktop_tasks d GROUP BY 2
            UNION ALL SELECT 'legacy', l.tenant_id FROM legacy_leases l GROUP BY 2 ORDER BY 1, 2""")
        assert [(p["path"], p["tenant_id"]) for p in paths] == [("desktop_tasks", 49), ("legacy", 50)]
        assert await never_both_paths(pool) == []
        # Both kinds of client saw their path in the lease response.
        seen = {owner for client in clients for owner in client.stats.owners.values()}
        assert seen == {"desktop_tasks", "legacy"}
        runs = await one(pool, "SELECT count(*) AS n FROM question_monitor_runs")
        total = await one(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks")
        assert runs["n"] == total["n"]


async def _in_flight_executions(pool: AsyncConnectionPool[Conn]) -> int:
    row = await one(pool, "SELECT count(*) AS n FROM desktop_tasks WHERE kind = 'monitor' AND status = 'in_progress'")
    return int(row["n"])


async def test_d_rollback_mid_day_then_forward_again(settings: Settings, pool: AsyncConnectionPool[Conn],
                                                    tmp_path: Path) -> None:
    world = await seed(pool, rollout=100)
    tenant = world["tenants"][0]
    async with running_stack(settings, tmp_path, services=SERVICES, **ENV) as stack, \
            fleet(stack, [c["token"] for c in tenant["clients"]], scale=4) as clients:
        await eventually(lambda: _in_flight_executions(pool), timeout=30, interval=0.05,
                         message=f"scheduled work in flight on desktop_tasks\n{stack.logs()}")
        # The dry run counts and changes nothing.
        dry = await monitorctl_json(settings, "rollback", executable=True)
        assert dry["dry_run"] is True and dry["rollout_percentage_before"] == 100 and dry["rollout_changed"]
        assert (await one(pool, "SELECT value FROM dispatch_settings WHERE key = 'rollout_percentage'"))["value"] \
            == 100
        # Apply without --force: rollout 0, pending work without an execution moves to legacy, in-flight work finishes.
        in_flight = {r["id"] for r in await rows(pool, "SELECT id FROM desktop_tasks WHERE status = 'in_progress'")}
        applied = await monitorctl_json(settings, "rollback", "--yes", executable=True)
        assert applied["dry_run"] is False and applied["rollout_percentage"] == 0
        assert applied["aborted_executions"] == 0
        ended = await rows(pool, "SELECT status, interrupt_reason FROM desktop_tasks WHERE id = ANY(%s)",
                           list(in_flight))
        assert not [e for e in ended if e["interrupt_reason"] == "phase2_emergency_rollback"]
        again = await monitorctl_json(settings, "rollback", "--yes", executable=True)
        assert again["business_tasks_to_legacy"] == 0 and again["aborted_executions"] == 0  # idempotent
        # Work continues on the legacy path: what was pending, and a click made now.
        clicked = await stack.collect_now(tenant, tenant["brands"][1]["brand_id"], {"preempt": True})
        await eventually(lambda: all_done(pool), timeout=120, interval=0.2,
                         message=f"every task completed after the rollback\n{stack.logs()}")
        owners = await rows(pool, "SELECT execution_owner, count(*) AS n FROM monitoring_collect_tasks GROUP BY 1")
        assert {r["execution_owner"] for r in owners} == {"legacy", "desktop_tasks"}
        request = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s",
                            uuid.UUID(clicked["request_id"]))
        assert request["status"] == "succeeded"
        legacy_after = await one(pool, "SELECT count(*) AS n FROM legacy_leases WHERE status = 'succeeded'")
        assert legacy_after["n"] > 0

        # Forward again: only new tasks take desktop_tasks; a legacy task re-collected starts its new run on it too,
        # while a legacy task in flight keeps its path.
        forward = await monitorctl_json(settings, "rollout", "set", "100", "--force", executable=True)
        assert forward["rollout_percentage"] == {"before": 0, "after": 100}
        before = {r["id"]: r["execution_owner"] for r in await rows(
            pool, "SELECT id, execution_owner FROM monitoring_collect_tasks")}
        clicked = await stack.collect_now(tenant, tenant["brands"][0]["brand_id"], {"preempt": True})
        await eventually(lambda: _in_flight_executions(pool), timeout=30, interval=0.05,
                         message=f"the click's work in flight on desktop_tasks\n{stack.logs()}")
        # Then a forced rollback while it runs: aborted, clients told, tasks back on legacy, and they still finish.
        forced = await monitorctl_json(settings, "rollback", "--yes", "--force", executable=True)
        assert forced["forced"] is True and forced["aborted_executions"] >= 1
        assert forced["task_control_messages"] == forced["aborted_executions"]
        await eventually(lambda: all_done(pool), timeout=120, interval=0.2,
                         message=f"every task completed after the forced rollback\n{stack.logs()}")
        aborted = await rows(pool, "SELECT monitor_task_id FROM desktop_tasks WHERE interrupt_reason = "
                                   "'phase2_emergency_rollback'")
        assert len(aborted) == forced["aborted_executions"]
        for row in aborted:
            task = await one(pool, "SELECT execution_owner, status FROM monitoring_collect_tasks WHERE id = %s",
                             row["monitor_task_id"])
            assert task == {"execution_owner": "legacy", "status": "completed"}, (row, task)
        # Each client was told (a task_control `cancelled` for each aborted execution: on the socket, or in the
        # replay of a reconnect), whether it had pulled the execution yet or not.
        aborted_ids = {str(r["id"]) for r in await rows(pool, "SELECT id FROM desktop_tasks WHERE interrupt_reason = "
                                                              "'phase2_emergency_rollback'")}

        def told() -> set[str]:
            return {str(e["task_id"]) for client in clients for e in client.stats.events
                    if e.get("type") == "task_control" and e.get("control") == "cancelled"}

        await eventually(lambda: aborted_ids <= told(), timeout=15,
                         message=f"every client told of its aborted executions ({aborted_ids - told()} not)")
        # Nothing lost, nothing stuck: every task completed with its run row, none held by both paths.
        assert set(before) <= {r["id"] for r in await rows(pool, "SELECT id FROM monitoring_collect_tasks")}
        runs = await one(pool, "SELECT count(*) AS n FROM question_monitor_runs")
        total = await one(pool, "SELECT count(*) AS n FROM monitoring_collect_tasks")
        assert runs["n"] == total["n"]
        assert await never_both_paths(pool) == []
        await eventually(lambda: _count(pool, "SELECT count(*) AS n FROM outbox WHERE status <> 'published'", want=0),
                         timeout=15, message="every outbox row published (nothing stuck)")
