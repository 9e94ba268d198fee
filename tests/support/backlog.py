"""A backlog loaded in bulk (INSERT .. SELECT generate_series), as the coordinator finds it on a busy system: tenants
with a brand, questions, platforms and online clients; ready normal tasks; outstanding executions spread over the
clients; optionally a history of finished tasks and executions. Used by the idle-statistics test and
`bench backlog_scale`."""

from __future__ import annotations

from dataclasses import dataclass

from libs.db.pool import Conn
from libs.demo import ensure_platforms
from libs.domain.lanes import lane_weight

PLATFORMS = ("openai", "gemini", "perplexity")
QUESTIONS = 10

_TENANTS = """
INSERT INTO tenants (name) SELECT 'bulk-' || %(tag)s || '-' || g FROM generate_series(1, %(n)s) g RETURNING id
"""
_BRANDS = "INSERT INTO brands (tenant_id, workspace_id, name) SELECT t, t, 'brand ' || t FROM unnest(%(t)s::bigint[]) t"
_QUESTIONS = """
INSERT INTO monitoring_questions (tenant_id, brand_id, text)
SELECT b.tenant_id, b.id, 'question ' || g FROM brands b CROSS JOIN generate_series(1, %(q)s) g
WHERE b.tenant_id = ANY(%(t)s::bigint[])
"""
_TENANT_PLATFORMS = """
INSERT INTO tenant_platforms (tenant_id, ai_platform_id)
SELECT t, p FROM unnest(%(t)s::bigint[]) t CROSS JOIN unnest(%(p)s::bigint[]) p
"""
_CLIENTS = """
INSERT INTO desktop_clients (id, tenant_id, workspace_id, user_id, name, token_hash, online, last_heartbeat_at,
                             connected_hub, max_concurrent_monitor, max_queue_depth)
SELECT gen_random_uuid(), t, t, t, 'bulk-desktop-' || t || '-' || g, md5('bulk-' || t || '-' || g || random()::text),
       true, now(), 'bulk', 4, 40
FROM unnest(%(t)s::bigint[]) t CROSS JOIN generate_series(1, %(c)s) g
"""
# Task i: tenant i % T, then platform, then question, then business day (`first_day` days back and before): every
# business key once. Status 'pending' (the backlog) or 'completed' (history, finished `finished_days_back` days ago).
_TASKS = """
INSERT INTO monitoring_collect_tasks (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, business_date,
    status, dispatch_priority, dispatch_lane, ingest_shard_key, execution_owner, enqueued_at, completed_at, created_at)
SELECT b.tenant_id, b.workspace_id, b.id, q.ids[g.qi + 1], (%(p)s::bigint[])[g.pi + 1], g.day, %(status)s::text,
       100, 'normal', b.tenant_id || ':' || b.id || ':' || to_char(g.day, 'YYYY-MM-DD'), 'desktop_tasks',
       CASE WHEN %(status)s::text = 'pending' THEN now() - random() * interval '1 hour' ELSE g.day + time '03:00' END,
       CASE WHEN %(status)s::text = 'completed' THEN g.day + time '04:00' END,
       CASE WHEN %(status)s::text = 'pending' THEN now() ELSE g.day + time '03:00' END
FROM (SELECT i %% %(nt)s::bigint AS ti, (i / %(nt)s::bigint) %% %(np)s::bigint AS pi,
             (i / (%(nt)s::bigint * %(np)s::bigint)) %% %(q)s::bigint AS qi,
             current_date - %(first_day)s - (i / (%(nt)s::bigint * %(np)s::bigint * %(q)s::bigint))::int AS day
      FROM generate_series(0, %(n)s - 1) i) g
JOIN unnest(%(t)s::bigint[]) WITH ORDINALITY AS t(id, k) ON t.k = g.ti + 1
JOIN brands b ON b.tenant_id = t.id
CROSS JOIN LATERAL (SELECT array_agg(q.id ORDER BY q.id) AS ids FROM monitoring_questions q WHERE q.brand_id = b.id) q
"""
# The outstanding executions: `n` of the ready tasks (one per tenant in turn) get a queued or in-progress execution
# on one of their tenant's clients.
_OUTSTANDING = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source, monitor_task_id, enqueued_at, brand_id, question_id, ai_platform_id, business_date,
                           lease_epoch, started_at)
SELECT gen_random_uuid(), 'monitor', m.tenant_id, m.workspace_id, c.id,
       CASE WHEN m.rn %% 2 = 0 THEN 'queued' ELSE 'in_progress' END, 100, 'normal', %(weight)s, 'daily_schedule',
       m.id, m.enqueued_at, m.brand_id, m.question_id, m.ai_platform_id, m.business_date,
       CASE WHEN m.rn %% 2 = 0 THEN 0 ELSE 1 END, CASE WHEN m.rn %% 2 = 0 THEN NULL ELSE now() END
FROM (SELECT m.*, row_number() OVER (PARTITION BY m.tenant_id ORDER BY m.id) AS rn
      FROM monitoring_collect_tasks m WHERE m.status = 'pending' AND m.tenant_id = ANY(%(t)s::bigint[])) m
CROSS JOIN LATERAL (SELECT c.id FROM desktop_clients c WHERE c.tenant_id = m.tenant_id
                    ORDER BY c.id OFFSET (m.rn %% %(c)s) LIMIT 1) c
WHERE m.rn <= %(per_tenant)s
"""
# One finished execution (and one attempt) per finished task, on the tenant's first client, created on its day.
_HISTORY_EXECUTIONS = """
INSERT INTO desktop_tasks (id, kind, tenant_id, workspace_id, target_client_id, status, priority, lane, lane_weight,
                           source, monitor_task_id, enqueued_at, brand_id, question_id, ai_platform_id, business_date,
                           lease_epoch, created_at, updated_at, started_at, finished_at)
SELECT gen_random_uuid(), 'monitor', m.tenant_id, m.workspace_id, c.id, 'succeeded', 100, 'normal', %(weight)s,
       'daily_schedule', m.id, m.enqueued_at, m.brand_id, m.question_id, m.ai_platform_id, m.business_date, 1,
       m.enqueued_at, m.completed_at, m.enqueued_at, m.completed_at
FROM monitoring_collect_tasks m
CROSS JOIN LATERAL (SELECT c.id FROM desktop_clients c WHERE c.tenant_id = m.tenant_id ORDER BY c.id LIMIT 1) c
WHERE m.status = 'completed' AND m.tenant_id = ANY(%(t)s::bigint[])
"""


_ONLINE = """
UPDATE desktop_clients SET online = %(online)s, last_heartbeat_at = now(), connected_hub = 'bulk'
WHERE tenant_id = ANY(%(t)s::bigint[])
"""


@dataclass(frozen=True, slots=True)
class Tenants:
    """Bulk tenants (brand, QUESTIONS questions, the PLATFORMS, `clients` clients each)."""

    ids: list[int]
    platforms: list[int]
    clients: int

    def params(self) -> dict[str, object]:
        return {"t": self.ids, "p": self.platforms, "q": QUESTIONS, "c": self.clients, "nt": len(self.ids),
                "np": len(self.platforms), "weight": lane_weight("monitor", "normal")}


async def load_tenants(conn: Conn, *, tenants: int, clients_per_tenant: int = 1, online: bool = True,
                       tag: str = "b") -> Tenants:
    platform_rows = await ensure_platforms(conn, PLATFORMS)
    cur = await conn.execute(_TENANTS, {"n": tenants, "tag": tag})
    loaded = Tenants([int(r["id"]) for r in await cur.fetchall()], [int(p["ai_platform_id"]) for p in platform_rows],
                     clients_per_tenant)
    for statement in (_BRANDS, _QUESTIONS, _TENANT_PLATFORMS, _CLIENTS):
        await conn.execute(statement, loaded.params())
    await set_online(conn, loaded, online=online)
    return loaded


async def set_online(conn: Conn, tenants: Tenants, *, online: bool) -> None:
    await conn.execute(_ONLINE, {"t": tenants.ids, "online": online})


async def load_ready(conn: Conn, tenants: Tenants, ready: int, *, first_day: int = 1) -> None:
    """`ready` ready normal tasks spread over the tenants, business days from `first_day` days ago (yesterday) back."""
    await conn.execute(_TASKS, {**tenants.params(), "n": ready, "status": "pending", "first_day": first_day})


async def load_outstanding(conn: Conn, tenants: Tenants, per_tenant: int) -> None:
    """`per_tenant` of each tenant's ready tasks get a queued or in-progress execution on one of its clients."""
    await conn.execute(_OUTSTANDING, {**tenants.params(), "per_tenant": per_tenant})


async def load_history(conn: Conn, tenants: Tenants, finished: int, *, days_back: int = 400) -> None:
    """`finished` completed tasks, each with a succeeded execution, on business days `days_back` days ago and before
    (older than any backlog this module loads)."""
    await conn.execute(_TASKS, {**tenants.params(), "n": finished, "status": "completed", "first_day": days_back})
    await conn.execute(_HISTORY_EXECUTIONS, tenants.params())
