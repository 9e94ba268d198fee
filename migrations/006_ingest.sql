-- Result ingest bookkeeping (seed §12.2, §12.3).

-- One row per MonitorResult applied by ingest-shard-workers: a redelivered result_id finds its row
-- and changes nothing. `seq` records the order results were applied in (per shard it is the
-- publish order); rows older than INGEST_APPLIED_RETENTION_HOURS are purged.
CREATE TABLE ingest_applied_results (
    result_id        uuid         PRIMARY KEY,
    seq              bigint       GENERATED ALWAYS AS IDENTITY,
    tenant_id        bigint       NOT NULL,
    shard            int          NOT NULL,
    task_id          uuid,
    monitor_task_id  bigint,
    status           varchar(20)  NOT NULL,
    applied_by       varchar(120) NOT NULL,
    applied_at       timestamptz  NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX ix_ingest_applied_results_age ON ingest_applied_results (applied_at);

-- Live ingest-shard-workers replicas. Each replica consumes every shard queue (single active
-- consumer per queue); members spread the active consumers between them by yielding the
-- shards assigned to another live member (libs.ingest.shards.assign_shards).
CREATE TABLE ingest_shard_members (
    instance_id   varchar(120) PRIMARY KEY,
    started_at    timestamptz  NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz  NOT NULL DEFAULT now()
);
