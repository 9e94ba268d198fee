-- Fleet-wide socket cap (docs/architecture.md "Hub fleet"): every live desktop socket of every hub replica, so
-- that one client's sockets count together however a load balancer spread them; and the replicas themselves,
-- so that a replica's share of the fleet-wide upgrade budgets and the clean-up of a dead replica's rows are
-- known without asking the others.
--
-- A hub inserts its sockets' rows in the transaction that marks their clients online (under the clients' row
-- locks, so two hubs attaching sockets of one client count each other's), marks the oldest beyond the cap
-- `replaced_at`, and closes the replaced sockets it holds itself; every hub closes its own replaced sockets at
-- its next sweep (HUB_REVOCATION_CHECK_S). A closed socket's row is deleted; the rows of a replica that stopped
-- sweeping (killed) are deleted by the others a minute later.

CREATE TABLE hub_instances (
    hub_id      text        PRIMARY KEY,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE hub_sockets (
    socket_id    uuid        PRIMARY KEY,
    client_id    uuid        NOT NULL REFERENCES desktop_clients (id) ON DELETE CASCADE,
    tenant_id    bigint      NOT NULL,
    hub_id       text        NOT NULL,
    opened_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    replaced_at  timestamptz
);

-- The cap's count (a client's live sockets, newest first) and each hub's sweep of its replaced sockets.
CREATE INDEX hub_sockets_client ON hub_sockets (client_id, opened_at DESC) WHERE replaced_at IS NULL;
CREATE INDEX hub_sockets_hub ON hub_sockets (hub_id);

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON hub_instances
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '') EXECUTE FUNCTION leader_fence();
CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON hub_sockets
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '') EXECUTE FUNCTION leader_fence();
