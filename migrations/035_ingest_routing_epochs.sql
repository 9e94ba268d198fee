-- Online resharding of result ingest (libs/ingest/routing.py, docs/reliability.md "Resharding ingest online").
-- A routing epoch is a shard count results are routed by; at most one is active (the hub routes by it), at most
-- one is draining (the previous, its queues unbound and emptied before the new epoch's shards that take over its
-- keys start). No row: epoch 0 with INGEST_SHARDS shards (what a deployment ran before its first reshard).
CREATE TABLE ingest_routing_epochs (
    epoch             int          PRIMARY KEY CHECK (epoch >= 0),
    shards            int          NOT NULL CHECK (shards > 0),
    state             varchar(20)  NOT NULL CHECK (state IN ('active', 'draining', 'retired')),
    created_at        timestamptz  NOT NULL DEFAULT now(),
    drain_started_at  timestamptz,
    -- When the draining epoch's queues lost their bindings (no publish reaches them after this).
    unbound_at        timestamptz,
    retired_at        timestamptz
);
CREATE UNIQUE INDEX ux_ingest_routing_one_active ON ingest_routing_epochs ((true)) WHERE state = 'active';
CREATE UNIQUE INDEX ux_ingest_routing_one_draining ON ingest_routing_epochs ((true)) WHERE state = 'draining';

-- A draining epoch's shard found empty (no message, no consumer) past the grace after the unbind.
CREATE TABLE ingest_routing_drains (
    epoch       int          NOT NULL REFERENCES ingest_routing_epochs (epoch),
    shard       int          NOT NULL CHECK (shard >= 0),
    drained_at  timestamptz  NOT NULL DEFAULT clock_timestamp(),
    drained_by  varchar(120) NOT NULL,
    PRIMARY KEY (epoch, shard)
);

-- The ledger says which epoch applied a result and when its transaction began, so a reshard can be checked
-- from the raw facts: a key's applies by one (epoch, shard) never overlap another's.
ALTER TABLE ingest_applied_results
    ADD COLUMN routing_epoch int NOT NULL DEFAULT 0,
    ADD COLUMN tx_started_at timestamptz NOT NULL DEFAULT transaction_timestamp();

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ingest_routing_epochs
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '') EXECUTE FUNCTION leader_fence();
CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ingest_routing_drains
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '') EXECUTE FUNCTION leader_fence();
