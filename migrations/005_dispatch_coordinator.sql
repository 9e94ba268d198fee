-- Dispatch coordinator (seed §9): the per-(tenant, platform) ready index and the leader's published state.

-- Candidate fetch per (tenant, platform, lane) in dispatch order; the coordinator only probes pairs
-- with free platform capacity, so each probe is a short range scan that stops at its LIMIT.
CREATE INDEX ix_collect_tasks_ready_pair
    ON monitoring_collect_tasks (tenant_id, ai_platform_id, dispatch_lane, dispatch_priority DESC, enqueued_at, id)
    WHERE status = 'pending' AND execution_owner = 'desktop_tasks';

-- Aging (seed §9.4): the oldest ready normal tasks by enqueued_at.
CREATE INDEX ix_collect_tasks_aging
    ON monitoring_collect_tasks (enqueued_at, id)
    WHERE status = 'pending' AND execution_owner = 'desktop_tasks' AND dispatch_lane IN ('normal', 'normal_boosted');

-- What the active coordinator publishes for operators (`monitorctl status`, `explain`): auto slow-down
-- state and its signals, the leader's instance id. One row per key, overwritten every few seconds.
CREATE TABLE dispatch_coordinator_state (
    key         varchar(80) PRIMARY KEY,
    value       jsonb       NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
