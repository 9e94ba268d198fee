-- The guarded rollout ramp (docs/legacy-path.md "The ramp"): every run of the §16.2.4 consistency reconcile records
-- the figures `monitorctl rollout advance` gates a step on (ingest lag, rows the run fixed, migration orphans), so
-- "the gates held for the step's dwell" is a question about rows, asked by any process, after any restart.
-- Written by the reconciler's migration_reconcile job, which also deletes rows older than 60 days.

CREATE TABLE rollout_observations (
    id               bigserial   PRIMARY KEY,
    observed_at      timestamptz NOT NULL DEFAULT now(),
    rollout_percentage int       NOT NULL,
    ingest_lag_ms    float8      NOT NULL,
    reconcile_fixes  int         NOT NULL,
    orphans          int         NOT NULL
);
CREATE INDEX ix_rollout_observations_at ON rollout_observations (observed_at);

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON rollout_observations
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '')
    EXECUTE FUNCTION leader_fence();
