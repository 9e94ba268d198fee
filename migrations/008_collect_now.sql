-- collect-now-api: the request status page (seed §13.5) finds a request's executions by request id.
CREATE INDEX ix_desktop_tasks_collect_request ON desktop_tasks (collect_request_id)
    WHERE collect_request_id IS NOT NULL;
