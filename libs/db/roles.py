"""A Postgres role per service, with only the privileges its code uses (docs/security.md "Least privilege").

The migration role owns the schema (it runs `monitorctl migrate` and then `monitorctl db-roles`); each service
connects as a login user that is a member of its group role `<prefix><service>` below, which holds DML on the
tables the service's statements touch and nothing else: no DDL, no TRUNCATE, SELECT only where it only reads.
Roles are cluster-wide, so their names carry a configurable prefix (`DB_ROLE_PREFIX`): two deployments (or two
test runs) on one Postgres never share a role. Privileges are per database: `apply_roles` is run in each database
the stack uses, after every migration (it revokes what a service no longer needs and grants what a new migration's
tables need).

`GRANTS` was derived from the SQL of the modules each service's entry point imports (tables named after INSERT
INTO / UPDATE / DELETE FROM / FROM / JOIN, plus UPDATE where a statement upserts or locks rows), then checked by
running every service under its role (tests/e2e/test_least_privilege_e2e.py). Tables written only by triggers (the
budget ledger) are granted to nobody: the trigger functions run as their owner (migration 040).
"""

from __future__ import annotations

import re

from psycopg import sql

from libs.db.pool import Conn

S, INS, U, D = "SELECT", "INSERT", "UPDATE", "DELETE"
READ = (S,)
RW = (S, INS, U, D)

# Shared by every service: readiness compares the schema version; libs.db.write_health records its heartbeat;
# libs.dispatch_settings reads (and seeds missing defaults of) the settings cache.
_COMMON: dict[str, tuple[str, ...]] = {
    "schema_migrations": READ,
    "writer_health": (S, INS, U, D),
    "dispatch_settings": (S, INS, U),
    "platform_health_overrides": READ,
}
# The task tables of a task's life (libs/tasks): every service that moves a task holds these.
_TASK_LIFE: dict[str, tuple[str, ...]] = {
    "desktop_clients": (S, U),
    "desktop_tasks": (S, INS, U),
    "desktop_task_attempts": (S, INS, U),
    "legacy_leases": (S, INS, U),
    "monitoring_collect_requests": (S, INS, U),
    "monitoring_collect_tasks": (S, INS, U),
    "outbox": (INS,),
}
_REFERENCE_READ: dict[str, tuple[str, ...]] = {
    "ai_platforms": READ, "brands": READ, "monitoring_questions": READ, "tenants": READ,
}

GRANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "collect-now-api": {
        **_COMMON, **_TASK_LIFE, **_REFERENCE_READ,
        "monitoring_keywords": READ, "tenant_platforms": READ, "monitoring_plans": (S, U),
        "collect_now_idempotency_keys": RW,  # Idempotency-Key answers, purged past their TTL
    },
    "dispatch-hub": {
        **_COMMON, **_TASK_LIFE, **_REFERENCE_READ,
        "monitoring_collect_tasks": (S, U),
        "safe_point_histogram": (S, INS, U),
        "safe_point_client_histogram": (S, INS, U),
        "platform_mode_settings": READ, "monitoring_plans": READ,  # the lease carries the task's mode (its plan's)
        # Which routing epoch (shard count) a result is published by (libs/ingest/routing.py).
        "ingest_routing_epochs": READ, "ingest_routing_drains": READ,
        # The fleet's sockets (the fleet-wide cap) and live hubs (the shared upgrade budgets), migration 055.
        "hub_sockets": RW, "hub_instances": RW,
        # The leader's push-lease key fingerprint, which the hub checks its own against (libs/tasks/push_leases.py).
        "dispatch_coordinator_state": READ,
    },
    "dispatch-coordinator": {
        **_COMMON, **_TASK_LIFE, **_REFERENCE_READ,
        # Its outbox relay publishes (and so marks) its own rows.
        "outbox": RW,
        "monitoring_plans": (S, U),
        "dispatch_budget_rows": READ,  # a view
        # The leader (re)builds the budget ledger's start and prunes old windows; the triggers keep it current.
        "dispatch_budget_ledger": RW, "dispatch_budget_ledger_tracking": RW, "dispatch_budget_totals": RW,
        "dispatch_coordinator_state": (S, INS, U),
        "leader_terms": (S, INS, U),
        "platform_health_overrides": (S, INS, U, D),
        "platform_settings": (S, INS, U),
        "projection_rebuild_queue": READ,
        "platform_mode_settings": READ,  # the soft interrupt timeout of a task's mode
    },
    "outbox-pump": {
        **_COMMON,
        "outbox": RW,
        "desktop_clients": READ,  # a dispatch event goes to the hub its client is connected to (libs/mq/hub_routing.py)
    },
    "ingest-shard-workers": {
        **_COMMON, **_TASK_LIFE, **_REFERENCE_READ,
        "desktop_clients": READ,
        "desktop_tasks": (S, U), "desktop_task_attempts": (S, U), "monitoring_collect_tasks": (S, U),
        "ingest_applied_results": (S, INS, D),
        "ingest_shard_members": (S, INS, U, D),
        "monitoring_citation_facts": (S, INS, U, D),
        "projection_rebuild_queue": (S, INS, U),
        "question_monitor_parse_results": (S, INS, U, D),
        "question_monitor_runs": (S, INS, U),
        # A shard records the drain marker of a resharded epoch it reached (libs/ingest/routing.py).
        "ingest_routing_epochs": READ, "ingest_routing_drains": (S, INS),
    },
    "projection-worker": {
        **_COMMON,
        "tenants": READ,
        "dispatch_coordinator_state": READ,
        "monitoring_citation_facts": READ,
        "question_monitor_runs": READ,
        "monitoring_brand_daily": (S, INS, U, D),
        "monitoring_brand_platform_daily": (S, INS, U, D),
        "projection_rebuild_queue": (S, U, D),
    },
    "reconciler": {
        **_COMMON, **_TASK_LIFE, **_REFERENCE_READ,
        "monitoring_plans": (S, U),
        "leader_terms": (S, INS, U),
        "platform_settings": (S, INS, U),
        "safe_point_histogram": (S, D),
        "safe_point_client_histogram": (S, D),
        # history_retention deletes finished history past its retention (libs/tasks/retention.py).
        "desktop_tasks": RW, "desktop_task_attempts": RW, "legacy_leases": RW, "monitoring_collect_requests": RW,
        "monitoring_collect_tasks": RW,
        "platform_mode_settings": READ,  # the hard interrupt timeout of a task's mode
        "rollout_observations": (S, INS, D),  # each migration reconcile's gate readings, pruned after 60 days
        "ingest_applied_results": READ,
        "question_monitor_runs": READ,
    },
}
SERVICES = tuple(GRANTS)
# Tables and views no service role holds a privilege on, and why (a table missing from GRANTS and from here is a
# mistake: tests/integration/test_db_roles.py fails on it, so a migration's new table gets its grants).
GRANTED_TO_NONE: dict[str, str] = {
}
_PREFIX = re.compile(r"[a-z][a-z0-9_]{0,40}")


def role_name(prefix: str, service: str) -> str:
    """`<prefix><service>` with `-` as `_` (e.g. `md_dispatch_hub`): a plain identifier, no quoting surprises."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"role prefix {prefix!r} must be lower-case letters, digits and _, starting with a letter")
    if service not in GRANTS:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    return prefix + service.replace("-", "_")


async def apply_roles(conn: Conn, prefix: str, *, schema: str = "public") -> dict[str, dict[str, list[str]]]:
    """Create the missing group roles (NOLOGIN) and set each one's privileges in this database to `GRANTS`,
    revoking everything else on the schema's tables and sequences, in one transaction. Run by the migration role
    (the tables' owner; CREATEROLE if the roles do not exist yet). Returns what was granted."""
    granted: dict[str, dict[str, list[str]]] = {}
    async with conn.transaction():
        cur = await conn.execute("SELECT c.relname AS name FROM pg_class c "
                                 "JOIN pg_namespace n ON n.oid = c.relnamespace "
                                 "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm')", (schema,))
        tables = {str(row['name']) for row in await cur.fetchall()}
        for service, grants in GRANTS.items():
            role = sql.Identifier(role_name(prefix, service))
            cur = await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role_name(prefix, service),))
            if await cur.fetchone() is None:
                await conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(role))
            ns = sql.Identifier(schema)
            await conn.execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(ns, role))
            await conn.execute(sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {} FROM {}").format(ns, role))
            await conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ns, role))
            missing = sorted(set(grants) - tables)
            if missing:
                raise RuntimeError(f"{service}: granted tables missing from schema {schema}: {missing} "
                                   "(run `monitorctl migrate` first)")
            granted[service] = {}
            for table, privileges in sorted(grants.items()):
                await conn.execute(sql.SQL("GRANT {} ON TABLE {}.{} TO {}").format(
                    sql.SQL(", ").join(sql.SQL(p) for p in privileges), ns, sql.Identifier(table), role))
                granted[service][table] = list(privileges)
                if INS in privileges:
                    # Serial / identity columns: inserting draws from the table's own sequences.
                    cur = await conn.execute(
                        "SELECT s.relname AS name FROM pg_class s JOIN pg_depend d ON d.objid = s.oid "
                        "JOIN pg_class t ON t.oid = d.refobjid JOIN pg_namespace n ON n.oid = t.relnamespace "
                        "WHERE s.relkind = 'S' AND t.relname = %s AND n.nspname = %s", (table, schema))
                    for row in await cur.fetchall():
                        await conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE {}.{} TO {}").format(
                            ns, sql.Identifier(str(row["name"])), role))
    return granted


async def drop_roles(conn: Conn, prefix: str) -> None:
    """Remove the group roles (their privileges in this database first). For tests and decommissioning: a role
    with privileges in another database cannot be dropped until `DROP OWNED` ran there too."""
    for service in SERVICES:
        name = role_name(prefix, service)
        cur = await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,))
        if await cur.fetchone() is not None:
            await conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            await conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
