"""collect-now-api's own SQL (its locks, its Idempotency-Keys, the client's interrupt generation, its wake-ups), with
named parameters; each one filters by the caller's tenant. What the click reads and writes of the task tables is the
task store's (libs/tasks/clicks.py, libs/tasks/requests.py)."""

import uuid

from libs.tasks.clicks import CLICK_WARM_UP

# Serialises collect-now within one tenant: idempotency, the active-request limit and the supersede
# chain are then decided on committed data, and two clicks can never both create a request.
LOCK_TENANT = "SELECT pg_advisory_xact_lock(hashtextextended('collect_now.tenant:' || %(tenant_id)s::text, 0))"
# How long a click waits for its tenant's lock (and, for the rest of its transaction, for any row lock) before it
# is answered 429: a burst of one tenant's clicks must not hold the connections other tenants' clicks need.
LOCK_WAIT = "SELECT set_config('lock_timeout', %(lock_wait)s, true)"

# collect-now's Idempotency-Key (migration 045). A request carrying a key first takes the key's lock, without
# waiting: a second request with the same key while the first is still in its transaction answers 409 at once (it
# cannot know yet what to replay); after the first committed, the lock is free and the key's row is there.
TRY_LOCK_IDEMPOTENCY_KEY = """
SELECT pg_try_advisory_xact_lock(hashtextextended(
    'collect_now.idempotency:' || %(tenant_id)s::text || ':' || %(user_id)s::text || ':' || %(idempotency_key)s, 0))
    AS locked
"""

# The key's unexpired first answer, of this tenant and user only.
IDEMPOTENCY_KEY = """
SELECT request_fingerprint, response_status, response_body
FROM collect_now_idempotency_keys
WHERE tenant_id = %(tenant_id)s AND user_id = %(user_id)s AND idempotency_key = %(idempotency_key)s
  AND expires_at > now()
"""

# Under the key's lock; an expired row of the same key (not yet purged) is replaced.
STORE_IDEMPOTENCY_KEY = """
INSERT INTO collect_now_idempotency_keys
    (tenant_id, user_id, idempotency_key, request_fingerprint, collect_request_id, response_status, response_body,
     expires_at)
VALUES (%(tenant_id)s, %(user_id)s, %(idempotency_key)s, %(fingerprint)s, %(collect_request_id)s, %(status)s,
        %(body)s, now() + make_interval(hours => %(ttl_hours)s))
ON CONFLICT (tenant_id, user_id, idempotency_key) DO UPDATE
SET request_fingerprint = excluded.request_fingerprint, collect_request_id = excluded.collect_request_id,
    response_status = excluded.response_status, response_body = excluded.response_body,
    created_at = now(), expires_at = excluded.expires_at
WHERE collect_now_idempotency_keys.expires_at <= now()
"""

# `wait_for_first_dispatch`: the answer the first caller got after its wait is what the key replays.
UPDATE_IDEMPOTENT_ANSWER = """
UPDATE collect_now_idempotency_keys SET response_body = %(body)s
WHERE tenant_id = %(tenant_id)s AND user_id = %(user_id)s AND idempotency_key = %(idempotency_key)s
  AND collect_request_id = %(collect_request_id)s
"""

# A batch of expired keys (any tenant: retention, not a tenant's data); replicas purging at once skip each other's.
PURGE_IDEMPOTENCY_KEYS = """
DELETE FROM collect_now_idempotency_keys k
USING (SELECT tenant_id, user_id, idempotency_key FROM collect_now_idempotency_keys
       WHERE expires_at <= now() ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) old
WHERE k.tenant_id = old.tenant_id AND k.user_id = old.user_id AND k.idempotency_key = old.idempotency_key
"""

INCREMENT_GENERATION = """
UPDATE desktop_clients SET interrupt_generation = interrupt_generation + 1, updated_at = now()
WHERE id = %(client_id)s AND tenant_id = %(tenant_id)s
RETURNING interrupt_generation
"""

# Wakes the coordinator (dispatch the high work now) at commit, and the outbox pumps when control events (cancel,
# interrupt) were written: they are prioritised, so the payload wakes the pump's priority loop. The request's
# lifecycle event alone wakes no pump: it is the coordinator's fallback wake-up for a lost NOTIFY, and a pump
# woken for it would publish it, and the coordinator consume it, while the click's high pass is running.
NOTIFY = """
SELECT pg_notify(%(dispatch_channel)s, ''),
       CASE WHEN %(controls)s THEN pg_notify(%(outbox_channel)s, %(outbox_payload)s) END
"""

# What a new pooled connection plans before its first click (libs.db.pool: EXPLAIN, nothing runs): the statements
# of the accept transaction, with parameters that match no row.
WARM_UP = [(INCREMENT_GENERATION, {"client_id": uuid.UUID(int=0), "tenant_id": 0}), *CLICK_WARM_UP]
