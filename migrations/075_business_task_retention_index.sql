-- migrate: no-transaction
-- What the history retention job walks to bound the business tasks (libs/tasks/retention.py, docs/architecture.md
-- "History retention"): every business task by business date, oldest first. The only index on
-- monitoring_collect_tasks.business_date so far is partial (pending tasks: the business-day sweep); this one covers
-- the finished ones too. A plain date key: B-tree deduplication keeps it to a few bytes a row (a day's tasks share
-- one key). Built concurrently: the table is written on every scan, dispatch and result while a rolling deploy runs
-- this.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_collect_tasks_business_date_all ON monitoring_collect_tasks (business_date);
