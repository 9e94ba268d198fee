-- desktop_tasks.supersedes_task_id (§7.2: "the old execution a preemption replaced"), written at last.
--
-- A click that interrupts a client's running scheduled execution names its replacement there and then (the interrupted
-- row's control_flags.replacement_task_id, migration 012), but the replacement row is created later, by the
-- coordinator's high pass. This trigger links the two when that row is inserted, so no dispatch statement has to carry
-- it: a collect-now execution whose id an interrupted execution names gets that execution's id (the earliest
-- interrupted, should one click have interrupted several). A legacy lease the click interrupted is not an execution
-- and is not named here (its control_flags keep the link).
--
-- The partial expression index finds the interrupted row by the replacement's id; few rows carry the key, so it is
-- small (building it reads desktop_tasks once).

CREATE INDEX ix_desktop_tasks_replacement ON desktop_tasks ((control_flags ->> 'replacement_task_id'))
    WHERE control_flags ? 'replacement_task_id';

CREATE FUNCTION desktop_tasks_link_superseded() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    SELECT d.id INTO NEW.supersedes_task_id
    FROM desktop_tasks d
    WHERE d.control_flags ? 'replacement_task_id' AND d.control_flags ->> 'replacement_task_id' = NEW.id::text
      AND d.tenant_id = NEW.tenant_id
    ORDER BY d.interrupted_at NULLS LAST, d.id
    LIMIT 1;
    RETURN NEW;
END;
$$;

CREATE TRIGGER desktop_tasks_link_superseded BEFORE INSERT ON desktop_tasks
    FOR EACH ROW WHEN (NEW.source = 'collect_now' AND NEW.supersedes_task_id IS NULL)
    EXECUTE FUNCTION desktop_tasks_link_superseded();
