"""Outbox SQL, named parameters only."""

OUTBOX_CLAIM_LOCK = 7_401_552_002

# Pumps take turns claiming (a short transaction), which is what lets one key's events be
# claimed in order across pumps; publishing happens outside the lock.
LOCK_CLAIMS = "SELECT pg_advisory_xact_lock(%(lock)s)"

# A lease that ran out says nothing about the event (its claimer died or stalled): a dead letter for running out
# of attempts this way is transient. `expired` only names the rows and their claimers (an UPDATE returns the new
# claimed_by, NULL); the UPDATE re-checks that each is still running past its lease.
RECLAIM_EXPIRED = """
WITH expired AS (
    SELECT id, claimed_by FROM outbox WHERE status = 'running' AND claim_expires_at < now()
)
UPDATE outbox o
SET status = CASE WHEN o.attempts >= o.max_attempts THEN 'dead_letter' ELSE 'retryable' END,
    dead_lettered_at = CASE WHEN o.attempts >= o.max_attempts THEN now() END,
    last_error = 'claim lease expired while running (pump died or stalled)',
    last_error_class = CASE WHEN o.attempts >= o.max_attempts THEN 'transient' END,
    claimed_by = NULL,
    claim_expires_at = NULL,
    next_retry_at = now()
FROM expired e
WHERE o.id = e.id AND o.status = 'running' AND o.claim_expires_at < now()
RETURNING o.id, o.status, o.event_id, o.tenant_id, o.exchange, o.routing_key, o.ordering_key, o.message_type,
          o.attempts, o.max_attempts, o.next_retry_at, e.claimed_by AS previous_owner
"""

# Both claims: the `candidates` rows become running under the claimer's name with a lease, counting the attempt.
# `previous_status` (queued or retryable) is for the claim's transition log line.
_TAKE_CANDIDATES = """
UPDATE outbox o
SET status = 'running',
    attempts = o.attempts + 1,
    claimed_by = %(claimed_by)s,
    claim_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM candidates c
WHERE o.id = c.id
RETURNING o.id, o.event_id, o.exchange, o.routing_key, o.message_type, o.payload, o.headers,
          o.ordering_key, o.tenant_id, o.traceparent, o.attempts, o.max_attempts, o.created_at,
          o.priority, c.previous_status
"""

# A row is claimable when no earlier row of its ordering key is still running or waiting out
# a backoff; earlier rows that are claimable themselves come first in this batch. Claim order is
# priority DESC, id. So that per-key order still holds, a prioritised row (priority > 0) is claimable
# only when its key has no earlier unfinished row at all (it is then the head of its key), and a normal
# row also waits while its key has an earlier unfinished prioritised row (that row is claimed alone
# first). Hence every earlier unfinished row of a claimed row's key is in the same batch, before it.
# `min_priority` > 0 claims prioritised rows only (the pump's express loop), and needs no claim lock: a
# prioritised row is claimable only as the head of its key (no earlier unfinished row, whatever its state),
# and while it is unfinished no later row of its key is claimable, so two claimers can at worst race for
# the same head row, which FOR UPDATE SKIP LOCKED (re-checking the row's status) gives to one of them. The
# lock is for batches of consecutive normal rows of one key, which must all go to the same claimer.
CLAIM = f"""
WITH candidates AS (
    SELECT o.id, o.status AS previous_status
    FROM outbox o
    WHERE o.status IN ('queued', 'retryable')
      AND o.next_retry_at <= now()
      AND o.priority >= %(min_priority)s
      AND (o.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM outbox p
            WHERE p.ordering_key = o.ordering_key
              AND p.id < o.id
              AND p.status IN ('queued', 'running', 'retryable')
              AND (o.priority > 0 OR p.priority > 0 OR p.status = 'running' OR p.next_retry_at > now())))
    ORDER BY o.priority DESC, o.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
{_TAKE_CANDIDATES}"""

# A writer claims its own rows (`event_ids`, written earlier in the same transaction; see relay.claim_own) to
# publish them itself after its commit. Same per-key rule as CLAIM, with the writer's batch as the batch: a
# row is claimed only when no earlier unfinished row of its key exists outside that batch (its own earlier
# rows of the key are claimed with it and published before it). The writer holds its keys' advisory locks
# (enqueue_many), so every earlier row of those keys is committed and visible here. No claim lock: the rows
# are invisible to every pump until this transaction commits, and then they are running.
CLAIM_OWN = f"""
WITH own AS (SELECT unnest(%(event_ids)s::uuid[]) AS event_id),
candidates AS (
    SELECT o.id, o.status AS previous_status
    FROM outbox o JOIN own USING (event_id)
    WHERE o.status = 'queued'
      AND (o.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM outbox p
            WHERE p.ordering_key = o.ordering_key
              AND p.id < o.id
              AND p.status IN ('queued', 'running', 'retryable')
              AND p.event_id <> ALL(%(event_ids)s::uuid[])))
    FOR UPDATE
)
{_TAKE_CANDIDATES}"""

# After CLAIM_OWN: the rows it left queued need a pump, woken at commit.
NOTIFY_IF_UNCLAIMED = """
SELECT pg_notify(%(channel)s, %(payload)s) FROM (SELECT 1 FROM outbox
    WHERE event_id = ANY(%(event_ids)s::uuid[]) AND status = 'queued' LIMIT 1) left_queued
"""

# The pump's own transactions (claim, mark) do not wait for the WAL flush. Losing one in a database crash
# only repeats work, never loses an event: a lost claim puts the row back to queued, a lost mark leaves it
# running until its lease expires; either way it is published again (at least once, as the rulebook
# allows: consumers are idempotent). It takes an fsync off the path of every event.
ASYNC_COMMIT = "SET LOCAL synchronous_commit = off"

# published_at is the time of the broker's confirm (taken by the pump), not of this update. The marks return the
# rows they changed: only those made the transition (a claim lost meanwhile is not this claimer's to log).
MARK_PUBLISHED = """
UPDATE outbox o
SET status = 'published', published_at = m.published_at, claim_expires_at = NULL, last_error = NULL
FROM unnest(%(ids)s::bigint[], %(published_at)s::timestamptz[]) AS m(id, published_at)
WHERE o.id = m.id AND o.status = 'running' AND o.claimed_by = %(claimed_by)s
RETURNING o.id
"""

MARK_RETRYABLE = """
UPDATE outbox
SET status = 'retryable', claim_expires_at = NULL, claimed_by = NULL, last_error = %(error)s,
    next_retry_at = now() + make_interval(secs => %(delay_s)s)
WHERE id = %(id)s AND status = 'running' AND claimed_by = %(claimed_by)s
RETURNING id, next_retry_at
"""

MARK_DEAD_LETTER = """
UPDATE outbox
SET status = 'dead_letter', claim_expires_at = NULL, claimed_by = NULL, last_error = %(error)s,
    last_error_class = %(error_class)s, dead_lettered_at = now()
WHERE id = %(id)s AND status = 'running' AND claimed_by = %(claimed_by)s
RETURNING id
"""

# Later events of a just-published key became claimable: wake the pumps, but only if there are any.
NOTIFY_IF_SUCCESSORS = """
SELECT pg_notify(%(channel)s, '') FROM (SELECT 1 FROM outbox
    WHERE ordering_key = ANY(%(keys)s::text[]) AND status IN ('queued', 'retryable') LIMIT 1) waiting
"""

# Claimed but never attempted (shutdown, or an earlier event of the same key failed): give the
# attempt back, since it was counted at claim and nothing was tried.
RELEASE_UNATTEMPTED = """
UPDATE outbox
SET status = 'queued', attempts = greatest(attempts - 1, 0), claim_expires_at = NULL, claimed_by = NULL,
    next_retry_at = now()
WHERE id = ANY(%(ids)s) AND status = 'running' AND claimed_by = %(claimed_by)s
RETURNING id, attempts
"""

DELETE_PUBLISHED_BEFORE = """
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox
    WHERE status = 'published' AND published_at < now() - make_interval(hours => %(hours)s)
    LIMIT %(limit)s)
"""

DEPTH_BY_STATUS = """
SELECT status, count(*) AS n,
       coalesce(extract(epoch FROM now() - min(created_at)) * 1000, 0)::bigint AS oldest_ms
FROM outbox WHERE status IN ('queued', 'running', 'retryable', 'dead_letter')
GROUP BY status
"""

LIST_DEAD_LETTERS = """
SELECT id, event_id, exchange, routing_key, message_type, tenant_id, attempts, max_attempts,
       last_error_class, last_error, created_at, dead_lettered_at
FROM outbox WHERE status = 'dead_letter'
ORDER BY id
LIMIT %(limit)s
"""

# Explicit, operator-driven replay only (rulebook: no automatic dead-letter replay), in one transaction: the rows
# asked about (the named ids, or every dead letter), locked, for state.plan_replay to decide; then the reset of
# the ids it chose (still dead letters), returned for the transition log.
REPLAY_CANDIDATES = """
SELECT id, status, attempts, last_error_class, left(last_error, 400) AS last_error
FROM outbox
WHERE CASE WHEN %(all)s THEN status = 'dead_letter' ELSE id = ANY(%(ids)s::bigint[]) END
ORDER BY id
FOR UPDATE
"""
REPLAY_DEAD_LETTERS = """
UPDATE outbox
SET status = 'queued', attempts = 0, next_retry_at = now(), dead_lettered_at = NULL,
    last_error = 'replayed by operator: ' || coalesce(last_error, ''), last_error_class = NULL
WHERE status = 'dead_letter' AND id = ANY(%(ids)s::bigint[])
RETURNING id, event_id, tenant_id, exchange, routing_key, ordering_key, message_type, attempts, max_attempts
"""
