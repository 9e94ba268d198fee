"""Least privilege end to end (docs/security.md "Least privilege"): every service process runs as its own Postgres
login (a member of the group role `monitorctl db-roles` grants, libs/db/roles.py) and its own RabbitMQ user (the
permissions of libs/mq/permissions.py, imported as a definitions document the way an operator would), a click
still goes from collect-now-api through the coordinator, the pump and the hub to a desktop and back through ingest
to a succeeded request, and what a service must not do is refused by the servers themselves: the hub writing an
ingest table or reading the outbox, any service running DDL, the hub publishing a dispatch event, the pump
publishing a result.

Cluster-wide objects (roles, broker users) carry a unique prefix and are removed on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import aiohttp
import aiormq
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn
from libs.db.roles import SERVICES, apply_roles, drop_roles, role_name
from libs.demo import seed_demo
from libs.dispatch_settings import set_setting
from libs.mq.permissions import BROKER_SERVICES, definitions, user_name
from libs.mq.topology import Topology
from tests.support.db import one
from tests.support.stack import running_stack
from tests.support.wait import eventually
from tools.desktop_sim import TIMING_PROFILES, SimClient, SimOptions


def _have_rabbitmqctl() -> bool:
    """The broker users are created with `rabbitmqctl` (the local broker has no management plugin): root only."""
    return os.geteuid() == 0 and shutil.which("rabbitmqctl") is not None and "AMQP_URL" in os.environ and \
        urlsplit(os.environ["AMQP_URL"]).hostname in {"127.0.0.1", "localhost"}


pytestmark = [pytest.mark.timeout(150),
              pytest.mark.skipif(not _have_rabbitmqctl(), reason="needs root and rabbitmqctl of the local broker")]

ALL = ("outbox-pump", "dispatch-coordinator", "dispatch-hub", "collect-now-api", "ingest-shard-workers",
       "projection-worker", "reconciler")


def _db_as(url: str, user: str, password: str) -> str:
    return make_conninfo(url, user=user, password=password)


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _rabbitmqctl(*args: str) -> str:
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@contextlib.contextmanager
def broker_users(topology: Topology, user_prefix: str) -> Iterator[dict[str, str]]:
    """A user per broker-using service, imported as `monitorctl broker-definitions` would print them; deleted on
    the way out (one `rabbitmqctl` call each way: each costs ~2 s of Erlang start-up)."""
    passwords = {service: secrets.token_hex(16) for service in BROKER_SERVICES}
    names = [user_name(user_prefix, service) for service in BROKER_SERVICES]
    try:
        # rabbitmqctl reads the file as the rabbitmq user (the Debian wrapper switches to it): a readable file
        # outside pytest's private folder, removed right after.
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="broker-definitions-") as document:
            json.dump(definitions(topology.prefix, passwords, user_prefix=user_prefix), document)
            document.flush()
            os.chmod(document.name, 0o644)
            _rabbitmqctl("import_definitions", document.name)
        yield passwords
    finally:
        users = ", ".join(f'<<"{name}">>' for name in names)
        _rabbitmqctl("eval", f'[rabbit_auth_backend_internal:delete_user(U, <<"test">>) || U <- [{users}],'
                             ' rabbit_auth_backend_internal:exists(U)].')


@contextlib.asynccontextmanager
async def db_logins(pool: AsyncConnectionPool[Conn], role_prefix: str) -> AsyncIterator[dict[str, str]]:
    """The group roles with their grants in the test database (as the schema's owner would set them), and a login
    member of each, as a DBA creates them once per environment."""
    passwords = {service: secrets.token_hex(16) for service in SERVICES}
    logins = {service: f"{role_name(role_prefix, service)}_login" for service in SERVICES}
    try:
        async with pool.connection() as conn:
            await apply_roles(conn, role_prefix)
            for service, login in logins.items():
                await conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(login), sql.Literal(passwords[service]),
                    sql.Identifier(role_name(role_prefix, service))))
        yield {service: f"{logins[service]}:{passwords[service]}" for service in SERVICES}
    finally:
        async with pool.connection() as conn:
            for login in logins.values():
                await conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))
            await drop_roles(conn, role_prefix)


async def _refused(url: str, statement: str) -> str:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            await conn.execute(statement)
    return str(refused.value)


async def _publish_refused(url: str, exchange: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            target = await channel.get_exchange(exchange, ensure=False)
            await target.publish(aio_pika.Message(b"{}"), routing_key="shard.0")
            await channel.get_exchange(exchange, ensure=True)  # the refusal closes the channel: seen here at last
    finally:
        await connection.close()


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    raise AssertionError("a refused consumer got a message")


async def test_each_service_runs_under_its_own_role_and_user_and_a_forbidden_write_is_refused(
        settings: Settings, pool: AsyncConnectionPool[Conn], tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:8]
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, platforms=("openai",), due=False)
        for key, value in {"cluster_dispatch_per_minute": 5000, "tenant_dispatch_per_minute": 5000}.items():
            await set_setting(conn, key, value)
    tenant = seed["tenants"][0]
    client = tenant["clients"][0]
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    async with db_logins(pool, f"lp{unique}_") as logins:
        with broker_users(topology, f"lp{unique}-") as broker:
            db = {service: _db_as(settings.database_url, *login.split(":")) for service, login in logins.items()}
            mq = {service: _with_user(settings.amqp_url, user_name(f"lp{unique}-", service), password)
                  for service, password in broker.items()}
            per_service: dict[str, dict[str, str]] = {
                service: {"DATABASE_URL": db[service], **({"AMQP_URL": mq[service]} if service in mq else {})}
                for service in ALL}
            # collect-now-api has no broker user: an AMQP_URL it could use would be a bug; give it none that works.
            per_service["collect-now-api"]["AMQP_URL"] = _with_user(settings.amqp_url, "nobody", "nothing")
            async with running_stack(settings, tmp_path, services=ALL, per_service=per_service) as stack:
                desktop = SimClient(SimOptions(hub_url=stack.hub_url, token=client["token"],
                                               timings=TIMING_PROFILES["fast"], heartbeat_interval_s=1.0,
                                               idle_poll_s=None, seed=3))
                async with desktop:
                    await eventually(desktop.connected.is_set, timeout=15, message="the desktop client said hello")
                    async with aiohttp.ClientSession() as http, http.post(
                            f"{stack.api_url}/api/tenant/monitoring/brands/{tenant['brands'][0]['brand_id']}"
                            "/collect-now", json={"target_client_id": client["client_id"]},
                            headers={"Authorization": f"Bearer {stack.jwt(tenant)}"}) as resp:
                        accepted: dict[str, Any] = await resp.json()
                        assert resp.status == 202, accepted

                    async def succeeded() -> bool:
                        row = await one(pool, "SELECT status FROM monitoring_collect_requests WHERE id = %s",
                                        uuid.UUID(accepted["request_id"]))
                        return row["status"] == "succeeded"

                    await eventually(succeeded, timeout=40, message=f"the request succeeded\n{stack.logs()}")
                runs = await one(pool, "SELECT count(*) AS n FROM question_monitor_runs")
                assert runs["n"] >= 1, "ingest (under its role) wrote the run"
                errors = [line for name, proc in stack.procs.items() for line in proc.logs().splitlines()
                          if "permission denied" in line or "ACCESS_REFUSED" in line]
                assert not errors, "a service needed a privilege it was not granted:\n" + "\n".join(errors[:20])

            # Postgres refuses what each role was not granted.
            assert "question_monitor_runs" in await _refused(
                db["dispatch-hub"], "INSERT INTO question_monitor_runs (tenant_id) VALUES (1)")
            await _refused(db["dispatch-hub"], "SELECT * FROM outbox")  # insert-only: it cannot read the backlog
            await _refused(db["dispatch-hub"], "UPDATE ingest_applied_results SET result_id = result_id")
            await _refused(db["collect-now-api"], "DELETE FROM monitoring_citation_facts")
            await _refused(db["projection-worker"], "UPDATE desktop_tasks SET priority = 0")
            await _refused(db["outbox-pump"], "SELECT * FROM desktop_tasks")
            await _refused(db["ingest-shard-workers"], "TRUNCATE desktop_tasks")
            await _refused(db["dispatch-coordinator"], "CREATE TABLE intruder (id int)")
            await _refused(db["reconciler"], "ALTER TABLE outbox ADD COLUMN intruder int")
            # RabbitMQ refuses what each user was not permitted.
            await _publish_refused(mq["dispatch-hub"], topology.dispatch_exchange)
            await _publish_refused(mq["dispatch-hub"], topology.lifecycle_exchange)
            await _publish_refused(mq["outbox-pump"], topology.result_exchange)
            await _publish_refused(mq["projection-worker"], topology.dispatch_exchange)
            connection = await aio_pika.connect(mq["dispatch-hub"])
            try:
                channel = await connection.channel()
                with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                    queue = await channel.get_queue(topology.lifecycle_queue("coordinator"), ensure=False)
                    await asyncio.wait_for(queue.consume(_ignore), 10)
            finally:
                await connection.close()
