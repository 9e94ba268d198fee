"""Fixtures: a fresh database per test (cloned from a migrated template) and a unique broker prefix."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import aio_pika
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.db.pool import Conn, make_pool
from libs.mq.topology import Topology, delete_all
from tests.support.env import Backends, backends
from tests.support.templates import prepare_template


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = str(item.path)
        if "/integration/" in path:
            item.add_marker(pytest.mark.integration)
        elif "/e2e/" in path:
            item.add_marker(pytest.mark.e2e)
        elif "/faults/" in path:
            item.add_marker(pytest.mark.faults)
    # The infrastructure faults stop or alarm servers (their own, scripts/fault-servers.sh): last, whatever runs them.
    items.sort(key=lambda item: "/faults/" in str(item.path))


@pytest.fixture(scope="session")
def backend() -> Iterator[Backends]:
    with backends() as found:
        yield found


def _admin(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(make_conninfo(url, dbname="postgres"), autocommit=True)


@pytest.fixture(scope="session")
def template_db(backend: Backends) -> Iterator[str]:
    """A migrated template named after the migrations' checksums; rebuilt only when they change.
    Templates of other migration sets that no running session holds are dropped."""
    with _admin(backend.database_url) as conn:
        # The connection, and with it the hold on this template, lasts the session.
        yield prepare_template(conn, backend.database_url)


@pytest.fixture
def database_url(backend: Backends, template_db: str) -> Iterator[str]:
    name = f"mon_t_{uuid.uuid4().hex[:12]}"
    with _admin(backend.database_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                     sql.Identifier(template_db)))
    try:
        yield make_conninfo(backend.database_url, dbname=name)
    finally:
        with _admin(backend.database_url) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def _broker_prefixes(backend: Backends) -> Iterator[list[Topology]]:
    """Every prefixed topology a test used; deleted again at the end of the session, so tests that
    start services (which declare their own queues) leave nothing behind on the broker."""
    used: list[Topology] = []
    yield used
    if used:
        asyncio.run(_delete_topologies(backend.amqp_url, used))


async def _delete_topologies(amqp_url: str, topologies: list[Topology]) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        async with connection.channel() as channel:
            for topology in topologies:
                await asyncio.wait_for(delete_all(channel, topology), 60)
    finally:
        await connection.close()


@pytest.fixture
def topology(_broker_prefixes: list[Topology]) -> Topology:
    created = Topology(prefix=f"t{uuid.uuid4().hex[:10]}.", ingest_shards=4)
    _broker_prefixes.append(created)
    return created


@pytest.fixture
def settings(database_url: str, backend: Backends, topology: Topology) -> Settings:
    return Settings(
        database_url=database_url,
        amqp_url=backend.amqp_url,
        mq_prefix=topology.prefix,
        ingest_shards=topology.ingest_shards,
        gateway_jwt_secret="test-secret-0123456789-abcdefghijklmnop",
        db_pool_min=1,
        db_pool_max=4,
        shutdown_grace_seconds=5,
    )


@pytest.fixture
async def pool(settings: Settings) -> AsyncIterator[AsyncConnectionPool[Conn]]:
    pool = make_pool(settings, name="tests", min_size=1, max_size=4)
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def amqp(backend: Backends, topology: Topology) -> AsyncIterator[aio_pika.abc.AbstractRobustConnection]:
    connection = await aio_pika.connect_robust(backend.amqp_url)
    try:
        yield connection
    finally:
        async with connection.channel() as channel:
            await delete_all(channel, topology)
        await connection.close()
