-- Why a dead letter failed: 'transient' (broker unavailable, timeout, nack, lost connection or an expired
-- claim lease, until max_attempts ran out) or 'permanent' (a payload that does not match its contract, a
-- publish the broker rejected or returned as unroutable, anything not worth retrying). An operator's replay
-- resets only transient ones unless asked to include permanent ones. Dead letters written before this
-- column existed stay NULL: unknown, and replayed only as permanent ones are.
ALTER TABLE outbox ADD COLUMN last_error_class varchar(12)
    CHECK (last_error_class IN ('transient', 'permanent'));
