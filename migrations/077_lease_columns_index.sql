-- migrate: no-transaction
-- The migration reconcile's zombie-lease check (libs/tasks/legacy.py CLEAR_ZOMBIE_LEASES, docs/legacy-path.md) looks
-- for business tasks whose legacy lease columns are set or whose state is leased/received. Those three conditions
-- had no index between them, so every run read every business task, a year of finished history included (21,200
-- rows for 600 live ones in tests/integration/test_reconciler_history_plans.py). This partial index holds exactly
-- the rows the check's predicate names (the live legacy leases, and what the check clears), so its run reads those
-- and nothing else. A row without lease columns (every pending task of the desktop path, every finished one) is not
-- in it, so the aging boosts and dispatches write nothing to it. Built concurrently: the table is written on every
-- scan, dispatch and result while a rolling deploy runs this.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_collect_tasks_lease_columns ON monitoring_collect_tasks (id)
    WHERE leased_to_executor IS NOT NULL OR legacy_lease_id IS NOT NULL OR status IN ('leased', 'received');
