"""Every SQL statement of the hub on its own tables (clients, sockets, hub replicas, safe points), with named
parameters. Its reads and writes of the task tables are operations of the task store (libs/tasks/execution_paths.py,
libs/tasks/lease_context.py)."""

# The tokens of every handshake and call that missed the hub's cache while the previous lookup ran.
AUTHENTICATE_CLIENTS = """
SELECT id, tenant_id, workspace_id, user_id, disabled_at, token_hash
FROM desktop_clients WHERE token_hash = ANY(%(token_hashes)s)
"""

# Revocation sweep: which of this hub's sockets (ids[i] authenticated with token_hashes[i]) belong to a client that
# was disabled or deleted (`disabled`), or whose token was rotated since; only those come back.
REVOKED_SOCKETS = """
SELECT s.client_id, s.token_hash, (c.id IS NULL OR c.disabled_at IS NOT NULL) AS disabled
FROM unnest(%(ids)s::uuid[], %(token_hashes)s::text[]) AS s(client_id, token_hash)
LEFT JOIN desktop_clients c ON c.id = s.client_id
WHERE c.id IS NULL OR c.disabled_at IS NOT NULL OR c.token_hash IS DISTINCT FROM s.token_hash
"""

# Serialises concurrent lease calls of one client so the concurrency limit holds (no row lock on
# desktop_clients, which heartbeats and collect-now update).
LOCK_CLIENT_LEASES = "SELECT pg_advisory_xact_lock(hashtextextended('hub.lease:' || %(client_id)s::text, 0))"

PLATFORM_CODES = "SELECT id, code FROM ai_platforms"

# A batch of attaching clients (rows locked in id order, as the heartbeat batch does: no deadlocks between them);
# a disabled client is not marked online.
CLIENTS_ONLINE = """
UPDATE desktop_clients c
SET online = true, connected_hub = %(hub)s, last_heartbeat_at = now(), offline_since = NULL, updated_at = now()
FROM (SELECT id, online AS was_online FROM desktop_clients
      WHERE id = ANY(%(ids)s::uuid[]) AND disabled_at IS NULL ORDER BY id FOR UPDATE) p
WHERE c.id = p.id
RETURNING c.id, c.tenant_id, c.interrupt_generation, p.was_online
"""

# A batch of clients whose last socket on this hub closed (another hub may already hold them).
CLIENTS_OFFLINE = """
UPDATE desktop_clients c
SET online = false, offline_since = now(), updated_at = now()
FROM (SELECT id FROM desktop_clients
      WHERE id = ANY(%(ids)s::uuid[]) AND connected_hub = %(hub)s AND online ORDER BY id FOR UPDATE) p
WHERE c.id = p.id
RETURNING c.id, c.tenant_id
"""

# One statement per flush for every client that showed a sign of life (ids sorted: no deadlocks); a disabled
# client's heartbeats are ignored. Only the clients that were offline come back (they get `client.online`, and
# the hub replays to them). A beat does not take the presence (where dispatch events are routed) of a client that
# is online on another hub: only an attach or a revival moves it (a flush that lost a race with the client's
# attach elsewhere would otherwise route its events to a hub it left).
HEARTBEAT_BATCH = """
WITH beat AS (
    UPDATE desktop_clients c
    SET last_heartbeat_at = now(), online = true, offline_since = NULL,
        connected_hub = CASE WHEN p.was_online THEN coalesce(c.connected_hub, %(hub)s) ELSE %(hub)s END
    FROM (SELECT id, online AS was_online FROM desktop_clients
          WHERE id = ANY(%(ids)s::uuid[]) AND disabled_at IS NULL ORDER BY id FOR UPDATE) p
    WHERE c.id = p.id
    RETURNING c.id, c.tenant_id, p.was_online
)
SELECT id, tenant_id FROM beat WHERE NOT was_online
"""

# A client's report replaces its stored platform health (a platform it no longer reports is not kept).
PLATFORM_HEALTH = """
UPDATE desktop_clients SET platform_health = %(health)s::jsonb, updated_at = now()
WHERE id = %(client_id)s AND disabled_at IS NULL AND platform_health IS DISTINCT FROM %(health)s::jsonb
"""

# Every report of a flush in one statement ([{"id", "health"}], ids sorted).
PLATFORM_HEALTH_BATCH = """
UPDATE desktop_clients c SET platform_health = r.health, updated_at = now()
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(id uuid, health jsonb)
WHERE c.id = r.id AND c.disabled_at IS NULL AND c.platform_health IS DISTINCT FROM r.health
"""

# On shutdown: this hub's clients are gone from here (another hub may already hold them).
HUB_CLIENTS_OFFLINE = """
UPDATE desktop_clients SET online = false, offline_since = now(), updated_at = now()
WHERE id = ANY(%(ids)s) AND connected_hub = %(hub)s AND online
RETURNING id, tenant_id
"""

# A flush of safe-point intervals into this hour's per-client histogram rows
# ([{"platform_id", "client_id", "le_ms", "n"}], sorted).
RECORD_SAFE_POINTS = """
INSERT INTO safe_point_client_histogram (ai_platform_id, client_id, hour, le_ms, n)
SELECT r.platform_id, r.client_id, date_trunc('hour', now()), r.le_ms, r.n
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(platform_id bigint, client_id uuid, le_ms int, n bigint)
ON CONFLICT (ai_platform_id, hour, client_id, le_ms) DO UPDATE SET n = safe_point_client_histogram.n + EXCLUDED.n
"""

# ---- the fleet-wide socket cap (migrations/055_hub_sockets.sql) -------------------------------------------------
# The sockets of an attach batch (socket_ids[i] of client_ids[i] of tenant_ids[i], in the order they opened), in
# the transaction whose CLIENTS_ONLINE holds their clients' rows locked: a disabled client's are not recorded.
SOCKETS_OPENED = """
INSERT INTO hub_sockets (socket_id, client_id, tenant_id, hub_id)
SELECT s.socket_id, c.id, c.tenant_id, %(hub)s
FROM unnest(%(socket_ids)s::uuid[], %(client_ids)s::uuid[], %(tenant_ids)s::bigint[]) WITH ORDINALITY
     AS s(socket_id, client_id, tenant_id, n)
JOIN desktop_clients c ON c.id = s.client_id AND c.tenant_id = s.tenant_id AND c.disabled_at IS NULL
ORDER BY s.n
"""

# Then every socket of those clients, on any hub, beyond the newest `cap`: replaced (the hub holding it closes it
# with 4409). The rows come back for the attaching hub to close its own at once.
SOCKETS_BEYOND_CAP = """
UPDATE hub_sockets h SET replaced_at = now()
FROM (SELECT socket_id, row_number() OVER (PARTITION BY client_id ORDER BY opened_at DESC, socket_id DESC) AS n
      FROM hub_sockets
      WHERE (client_id, tenant_id) IN (SELECT * FROM unnest(%(client_ids)s::uuid[], %(tenant_ids)s::bigint[]))
        AND replaced_at IS NULL) r
WHERE h.socket_id = r.socket_id AND r.n > %(cap)s
RETURNING h.socket_id, h.client_id, h.hub_id
"""

# Closed sockets of this hub (any client's: the rows are this hub's own).
SOCKETS_CLOSED = "DELETE FROM hub_sockets WHERE socket_id = ANY(%(socket_ids)s::uuid[]) AND hub_id = %(hub)s"

# A hub's sweep: it is alive with this many sockets, how many replicas are (its share of the upgrade budgets) and
# how many sockets they hold, and the lightest (its share of the fleet's: rebalancing), and which of its sockets
# another hub's attach replaced.
HUB_SEEN = """
WITH seen AS (
    INSERT INTO hub_instances (hub_id, sockets) VALUES (%(hub)s, %(sockets)s)
    ON CONFLICT (hub_id) DO UPDATE SET seen_at = now(), sockets = EXCLUDED.sockets
    RETURNING hub_id, sockets
), others AS (
    SELECT count(*) AS hubs, coalesce(sum(sockets), 0) AS sockets, min(sockets) AS lightest FROM hub_instances
    WHERE hub_id <> %(hub)s AND seen_at > now() - make_interval(secs => %(live_s)s)
)
SELECT 1 + (SELECT hubs FROM others) AS live, seen.sockets + (SELECT sockets FROM others) AS fleet_sockets,
       least(seen.sockets, (SELECT lightest FROM others)) AS lightest,
       coalesce((SELECT array_agg(socket_id) FROM hub_sockets
                 WHERE hub_id = %(hub)s AND replaced_at IS NOT NULL), '{}') AS replaced
FROM seen
"""

# The rows of replicas that stopped sweeping (killed: nothing deleted their sockets), then the replicas.
FORGET_DEAD_HUBS = """
WITH gone AS (
    DELETE FROM hub_instances WHERE seen_at < now() - make_interval(secs => %(dead_s)s) RETURNING hub_id
)
DELETE FROM hub_sockets WHERE hub_id IN (SELECT hub_id FROM gone)
"""

# A draining hub: its sockets' rows and its own row, at once (its clients count against their cap elsewhere now).
HUB_DRAINING = """
WITH sockets AS (DELETE FROM hub_sockets WHERE hub_id = %(hub)s)
DELETE FROM hub_instances WHERE hub_id = %(hub)s
"""
