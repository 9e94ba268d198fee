"""No reconcile job reads the finished history to find its work (docs/architecture.md "History retention").

The database holds HISTORY finished business tasks with their succeeded executions (a year back and more, as the
retention keeps them), a day of overdue backlog, a day of today's and online clients, analyzed as autovacuum would
have. Every job but the retention itself (which walks the history by design, a bounded batch a run) then runs once
with every statement's EXPLAIN (ANALYZE, BUFFERS) captured (auto_explain, in this pool's sessions only), and no
statement may read more than BUFFER_BOUND shared buffers or throw away more than FILTERED_BOUND rows in one plan node:
a statement that walks the history reads and throws away at least HISTORY rows (the business-day sweep's did, before
migration 076)."""

from __future__ import annotations

from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from services.reconciler.config import ReconcilerConfig
from services.reconciler.jobs import JOBS
from services.reconciler.runner import run_job
from tests.support.backlog import load_history, load_ready, load_tenants
from tests.support.explain import Plan, explaining_pool

TENANTS = 20
HISTORY = 20_000
DAY = TENANTS * 30  # one business day of every tenant (the loader's 10 questions x 3 platforms)
# What a job's statement may read: the live work and its indexes (a few thousand buffers at most here); the history
# alone is ~2,000 heap pages of tasks and as many of executions.
BUFFER_BOUND = 4_000
FILTERED_BOUND = HISTORY // 4
# The retention walks the history by design (RETENTION_BATCH_ROWS a batch, tests/integration/test_history_retention.py).
_WALKS_HISTORY = {"history_retention"}


async def test_no_reconcile_job_reads_the_finished_history(pool: AsyncConnectionPool[Conn],
                                                           settings: Settings) -> None:
    async with pool.connection() as conn:
        tenants = await load_tenants(conn, tenants=TENANTS, online=True)
        await load_history(conn, tenants, HISTORY)
        await load_ready(conn, tenants, DAY)  # yesterday's: overdue, the business-day sweep expires them
        await load_ready(conn, tenants, DAY, first_day=0)  # today's
        await conn.execute("VACUUM ANALYZE")
    plans: list[Plan] = []
    explained = explaining_pool(settings.database_url, plans)
    await explained.open(wait=True)
    ran: dict[str, list[Plan]] = {}
    try:
        for name, job in JOBS.items():
            if name in _WALKS_HISTORY:
                continue
            before = len(plans)
            async with explained.connection() as conn:
                await run_job(job, conn, ReconcilerConfig())
            ran[name] = plans[before:]
    finally:
        await explained.close()
    assert ran["business_day_expiry"], "the sweep ran no statement"
    over = [(name, p.buffers, p.filtered, p.query[:160]) for name, job_plans in ran.items() for p in job_plans
            if p.buffers > BUFFER_BOUND or p.filtered > FILTERED_BOUND]
    assert not over, over
