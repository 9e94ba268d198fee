-- Fencing terms for the leader-elected roles (docs/reliability.md "Leader election and fencing").
--
-- The advisory lock says who may lead; it cannot stop a deposed leader whose node went silent from committing
-- later, when its packets flow again. Every takeover therefore takes a new term (term + 1, on the new leader's
-- lock session), and the leader's pooled sessions carry the term they were opened for in their options
-- (`-c monitoring.leader_role=... -c monitoring.leader_term=N`). A statement-level trigger on every table checks
-- that term against this table, `FOR SHARE`: a statement of a deposed leader (its term is no longer the stored
-- one) fails with SQLSTATE MLF01 and its transaction rolls back; and since the share lock is held until the
-- statement's transaction ends, a takeover's term + 1 waits for a write the old leader has started, so no
-- write of the old term can commit after the new term did. Sessions without a leader term (every other service,
-- the ops endpoints of a standby) skip the trigger in its WHEN clause, at no cost.

CREATE TABLE leader_terms (
    role      varchar(40) PRIMARY KEY,
    term      bigint      NOT NULL CHECK (term > 0),
    holder    text        NOT NULL,
    taken_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION leader_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    fence_role text := current_setting('monitoring.leader_role', true);
    fence_term bigint := nullif(current_setting('monitoring.leader_term', true), '')::bigint;
    stored bigint;
BEGIN
    -- One check per transaction: the share lock taken by the first one lasts until the transaction ends.
    IF current_setting('monitoring.leader_fenced', true) = 'ok' THEN
        RETURN NULL;
    END IF;
    SELECT term INTO stored FROM leader_terms WHERE role = fence_role FOR SHARE;
    IF stored IS DISTINCT FROM fence_term THEN
        RAISE EXCEPTION 'fenced: % term % is not the current leader term %', fence_role, fence_term, stored
            USING ERRCODE = 'MLF01';
    END IF;
    PERFORM set_config('monitoring.leader_fenced', 'ok', true);
    RETURN NULL;
END;
$$;

-- Every table the schema has now; tests/integration/test_leader_fencing.py fails when a later migration adds a
-- table without the trigger (give it the same CREATE TRIGGER statement there).
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')
               AND c.relname NOT IN ('leader_terms', 'schema_migrations')
               AND NOT c.relispartition
    LOOP
        EXECUTE format('CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I '
                       'FOR EACH STATEMENT '
                       'WHEN (current_setting(''monitoring.leader_term'', true) <> '''') '
                       'EXECUTE FUNCTION leader_fence()', t.relname);
    END LOOP;
END;
$$;
