-- The backlog census (services/dispatch_coordinator/maintenance.py) walks the pending tasks in id order, a slice per
-- maintenance tick: this index holds only them, so a sweep costs the pending tasks, not the table's history of
-- finished ones (a slice of heap blocks did: at 10,000 ready tasks beside 100,000 finished ones, four slices).
CREATE INDEX ix_collect_tasks_pending_id ON monitoring_collect_tasks (id) WHERE status = 'pending';
