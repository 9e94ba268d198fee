-- Outbox priority: latency-sensitive events (high-lane TaskAvailable, collect-now TaskControl) are claimed
-- before older normal ones. Per ordering key the publish order is unchanged (libs/outbox/queries.py CLAIM:
-- a prioritised row waits for every earlier unfinished row of its key, and a normal row waits for an
-- earlier prioritised row of its key).
ALTER TABLE outbox ADD COLUMN priority smallint NOT NULL DEFAULT 0;
-- Claim order: priority DESC, id.
CREATE INDEX ix_outbox_claimable_priority ON outbox (priority DESC, id) WHERE status IN ('queued', 'retryable');
