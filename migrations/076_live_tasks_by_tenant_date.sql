-- migrate: no-transaction
-- The business-day sweep (libs/tasks/business_day.py, docs/architecture.md "History retention") looks for live
-- business tasks (pending, or leased/received on the legacy path) of a business date that is over in their tenant's
-- time zone. Its only index on business_date that covered the legacy states was 075's index of every business task,
-- so each run walked the finished history from its oldest date (a year of it: 1,095,000 finished rows, 300 ms and
-- 30,000 buffers a run, to find nothing). This index holds only the live tasks, per tenant in date order: the sweep
-- probes each tenant's overdue ones, whatever the history holds.
--
-- Two indexes go, so a pending task's row is in no more indexes than before (every aging boost and dispatch writes
-- an entry in each): the pending tasks by business date (this one serves the sweep instead) and the pending tasks
-- by (tenant, lane, priority, enqueued), whose one reader (the explain endpoint's tenant backlog per lane) reads the
-- tenant's live tasks in this index (or its part of ix_collect_tasks_ready_pair) as cheaply. All concurrent: the
-- table is written on every scan, dispatch and result while a rolling deploy runs this.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_collect_tasks_live_tenant_date
    ON monitoring_collect_tasks (tenant_id, business_date, id)
    WHERE status IN ('pending', 'leased', 'received');
DROP INDEX CONCURRENTLY IF EXISTS ix_collect_tasks_business_date;
DROP INDEX CONCURRENTLY IF EXISTS ix_collect_tasks_ready_tenant;
