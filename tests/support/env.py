"""Where the tests find Postgres and RabbitMQ: DATABASE_URL/AMQP_URL, else testcontainers."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from libs.db.migrate import load_migrations


@dataclass(frozen=True)
class Backends:
    database_url: str  # a maintenance URL (any database); tests create their own
    amqp_url: str


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        import docker

        docker.from_env().ping()
        return True
    except Exception:
        return False


@contextmanager
def backends() -> Iterator[Backends]:
    db = os.environ.get("DATABASE_URL")
    mq = os.environ.get("AMQP_URL")
    if db and mq:
        yield Backends(db, mq)
        return
    if not _docker_available():
        raise RuntimeError(
            "set DATABASE_URL and AMQP_URL (e.g. postgresql://postgres@127.0.0.1:5432/test and "
            "amqp://guest:guest@127.0.0.1:5672/), or run Docker so testcontainers can start them")
    from testcontainers.postgres import PostgresContainer
    from testcontainers.rabbitmq import RabbitMqContainer

    with PostgresContainer("postgres:15", driver=None) as pg, RabbitMqContainer("rabbitmq:3.10") as rmq:
        params = rmq.get_connection_params()
        amqp = f"amqp://guest:guest@{params.host}:{params.port}/"
        yield Backends(db or pg.get_connection_url(), mq or amqp)


def schema_fingerprint() -> str:
    digest = hashlib.sha256()
    for migration in load_migrations():
        digest.update(f"{migration.version}:{migration.checksum};".encode())
    return digest.hexdigest()[:12]
