-- The execution id a business task's next dispatch takes, when decided ahead: a collect-now that interrupts a
-- client's running scheduled task names the high execution that replaces it (task_control.replacement_task_id)
-- before the coordinator creates that execution. The coordinator uses the id and clears it when it dispatches.
ALTER TABLE monitoring_collect_tasks ADD COLUMN next_execution_id uuid;
