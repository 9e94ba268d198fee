-- migrate: no-transaction
-- What the history retention job (services/reconciler/jobs/history_retention.py) walks: the attempts of the executions
-- it deletes, by execution, and the collect-now requests by age. Built concurrently: both tables are written on every
-- dispatch and click while a rolling deploy runs this.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_attempts_task ON desktop_task_attempts (task_id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_collect_requests_created ON monitoring_collect_requests (created_at);
