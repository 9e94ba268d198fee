-- Least privilege (docs/security.md "Least privilege"): each service connects with a role holding only the DML
-- its own statements use (libs/db/roles.py, `monitorctl db-roles`). Triggers run their function with the
-- privileges of whoever fired them, so without this a service updating desktop_tasks would need write access to
-- the budget ledger the trigger maintains, and the leader fence's `FOR SHARE` read of leader_terms needs UPDATE
-- on it. The trigger functions therefore run as their owner, the migration role (SECURITY DEFINER), with the
-- search path pinned to the schema they were created in, so no caller can put a table of its own in front.
-- A later migration that replaces one of them (CREATE OR REPLACE) must repeat these two attributes.

ALTER FUNCTION dispatch_budget_ledger_rows() SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION dispatch_budget_ledger_update() SECURITY DEFINER SET search_path FROM CURRENT;
ALTER FUNCTION leader_fence() SECURITY DEFINER SET search_path FROM CURRENT;
-- A SECURITY DEFINER function is callable by PUBLIC by default; these are triggers (calling one directly fails),
-- but say it: only the trigger machinery runs them.
REVOKE EXECUTE ON FUNCTION dispatch_budget_ledger_rows(), dispatch_budget_ledger_update(), leader_fence() FROM PUBLIC;
