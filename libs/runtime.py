"""Running a service: uvloop, SIGTERM -> graceful drain, background loops that stop the service if they die, and
what a service opens for its lifetime (`Service`, `Lifetime`): opened in order, closed in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Protocol, TypeVar

import psycopg
import uvloop
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aiohttp import web
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from libs.config import ConfigError, Settings
from libs.db.migrate import load_migrations
from libs.db.pool import DEFAULT_PREPARE_THRESHOLD, Conn, WarmUp, make_pool
from libs.db.write_health import WriterHealth, publishing
from libs.gc_control import freeze_after_startup, watch_gc_pauses
from libs.http import add_readiness_check, make_app
from libs.mq.connection import connect as mq_connect
from libs.telemetry import metrics
from libs.telemetry.logging import configure_logging
from libs.telemetry.tracing import configure_tracing

log = logging.getLogger("runtime")

STOP_EVENT = web.AppKey("stop_event", asyncio.Event)
Worker = Callable[[asyncio.Event], Awaitable[None]]


def background(app: web.Application, name: str, worker: Worker) -> None:
    """Run `worker(stop)` for the app's lifetime; on shutdown set `stop` and wait for it to drain.

    A worker that dies unexpectedly takes the process down (Kubernetes restarts it) instead of
    leaving a half-alive service.
    """

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        stop = app[STOP_EVENT]

        async def guarded() -> None:
            try:
                await worker(stop)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background worker crashed; stopping the service", extra={"worker": name})
                os.kill(os.getpid(), signal.SIGTERM)

        task = asyncio.create_task(guarded(), name=name)
        yield
        stop.set()
        grace = app[SETTINGS].shutdown_grace_seconds
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=grace)
        except TimeoutError:
            log.warning("worker did not drain within the grace period; cancelling", extra={"worker": name})
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    app.cleanup_ctx.append(ctx)


SETTINGS = web.AppKey("settings", Settings)
# Connections the kernel queues until the service accepts them (capped by net.core.somaxconn). aiohttp's 128
# overflowed when a hub restart reconnected its clients at once: the dropped handshakes waited out the clients'
# SYN retransmits (1, 3, 7, 15 s) and timed out (docs/benchmarks.md, "Hub at scale").
LISTEN_BACKLOG = 4096


def base_app(settings: Settings, app: web.Application) -> web.Application:
    app[SETTINGS] = settings
    app[STOP_EVENT] = asyncio.Event()
    return app


def pool_ready_check(pool: AsyncConnectionPool[Conn]) -> Callable[[], Awaitable[None]]:
    """Postgres answers `SELECT 1` on a pooled connection. A pooled connection found dead (the database restarted or
    failed over while it sat idle) has probably taken the pool's other idle ones with it: they are checked and
    replaced, and the probe tries once more, so a database that is back answers ready at the first probe."""

    async def select_one(timeout: float) -> None:
        async with pool.connection(timeout=timeout) as conn:
            await conn.execute("SELECT 1")

    async def check() -> None:
        try:
            await select_one(2.0)
        except PoolTimeout:
            raise  # no connection at all: the database is away (the pool keeps reconnecting)
        except psycopg.OperationalError:
            await pool.check()
            await select_one(1.0)

    return check


def schema_ready_check(pool: AsyncConnectionPool[Conn], expected_version: int) -> Callable[[], Awaitable[None]]:
    """Not ready while the database's schema is older than the migrations this code ships (a rollout whose
    migration has not run yet): such a replica would fail on the first statement that needs the new schema."""

    async def check() -> None:
        async with pool.connection(timeout=2.0) as conn:
            cur = await conn.execute("SELECT coalesce(max(version), 0) AS version FROM schema_migrations")
            row = await cur.fetchone()
        version = int(row["version"]) if row else 0
        if version < expected_version:
            raise SchemaBehind(f"the database schema is at migration {version}; this code needs {expected_version}")

    return check


class SchemaBehind(RuntimeError):
    """The database has not been migrated to what this code expects."""


def add_pool_check(app: web.Application, pool: AsyncConnectionPool[Conn]) -> None:
    """Readiness: Postgres answers, and its schema is at least the newest migration of this code."""
    add_readiness_check(app, "postgres", pool_ready_check(pool))
    migrations = load_migrations()
    add_readiness_check(app, "schema", schema_ready_check(pool, max((m.version for m in migrations), default=0)))


def add_consumer_check(app: web.Application, connection: AbstractRobustConnection, subscribed: asyncio.Event,
                       what: str) -> None:
    """Ready when the broker connection is up and the consumer has subscribed to its queues. A robust connection
    is not `is_closed` while it reconnects (only once closed for good): `connected` is what says it is up."""

    async def check() -> None:
        if connection.is_closed or not connection.connected.is_set():
            raise ConnectionError("broker connection lost")
        if not subscribed.is_set():
            raise ConnectionError(f"{what} not subscribed yet")

    add_readiness_check(app, "rabbitmq", check)


def add_broker_check(app: web.Application, ready: Callable[[], bool],
                     failure: str = "broker connection not ready") -> None:
    """Readiness: the broker side of the service (a connection, a publisher) says it is ready."""

    async def check() -> None:
        if not ready():
            raise ConnectionError(failure)

    add_readiness_check(app, "rabbitmq", check)


def serve(service: str, build: Callable[[Settings], web.Application]) -> None:
    """Entry point for every service: configure, build the app, serve until SIGTERM/SIGINT."""
    try:
        settings = Settings.from_env(service)
    except ConfigError as exc:
        raise SystemExit(f"{service}: configuration error: {exc}") from None
    configure_logging(service, settings.log_level)
    metrics.set_service_name(service)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        configure_tracing(service, instance_id=settings.instance_id)  # before build: its apps get server spans
        app = build(settings)
    except ConfigError as exc:
        # Fail closed (a missing or placeholder secret): one clear line, a non-zero exit, no traceback.
        log.critical("refusing to start: %s", exc, extra={"error": str(exc)})
        raise SystemExit(2) from None
    freeze_after_startup(app)
    watch_gc_pauses()
    log.info("starting", extra={"port": settings.http_port, "instance_id": settings.instance_id})
    web.run_app(
        app,
        host=settings.http_host,
        port=settings.http_port,
        shutdown_timeout=settings.shutdown_grace_seconds,
        print=None,
        access_log=None,
        loop=loop,
        handle_signals=True,
        backlog=LISTEN_BACKLOG,
    )


T = TypeVar("T")


class Startable(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...


S = TypeVar("S", bound=Startable)


class Consumer(Protocol):
    """A queue consumer: `subscribed` is set once it consumes all its queues; `run` consumes until `stop`."""

    subscribed: asyncio.Event

    async def run(self, stop: asyncio.Event) -> None: ...


class Lifetime:
    """What one service opens while its app starts; each is closed, in the reverse order, when the app stops (and
    what was opened is closed when a later start-up step fails). The pool and the broker connection carry the
    service's name, as Postgres `application_name` and the RabbitMQ connection name."""

    def __init__(self, app: web.Application, service: str, stack: AsyncExitStack) -> None:
        self.app = app
        self.service = service
        self._stack = stack

    @property
    def settings(self) -> Settings:
        return self.app[SETTINGS]

    @property
    def instance_name(self) -> str:
        """`<service>-<instance_id>`: how this replica names itself to the broker."""
        return f"{self.service}-{self.settings.instance_id}"

    async def pool(self, *, min_size: int, max_size: int, prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD,
                   warm_up: WarmUp = ()) -> AsyncConnectionPool[Conn]:
        """The service's Postgres pool, open, with its readiness checks (`add_pool_check`)."""
        pool = make_pool(self.settings, name=self.service, min_size=min_size, max_size=max_size,
                         prepare_threshold=prepare_threshold, warm_up=warm_up)
        await pool.open(wait=True, timeout=30)
        self._stack.push_async_callback(pool.close)
        add_pool_check(self.app, pool)
        return pool

    async def broker(self, declare: Callable[[AbstractChannel], Awaitable[object]] | None = None) -> (
        AbstractRobustConnection
    ):
        """A robust RabbitMQ connection named `<service>-<instance_id>`; `declare` declares what it consumes
        (on a channel closed right after)."""
        connection = await mq_connect(self.settings.amqp_url, name=self.instance_name,
                                      heartbeat_s=self.settings.amqp_heartbeat_s)
        self._stack.push_async_callback(connection.close)
        if declare is not None:
            async with connection.channel() as channel:
                await declare(channel)
        return connection

    async def start(self, resource: S) -> S:
        """`resource.start()` now, `resource.close()` when the service stops."""
        await resource.start()
        self._stack.push_async_callback(resource.close)
        return resource

    async def enter(self, context: AbstractAsyncContextManager[T]) -> T:
        """An async context entered now and left when the service stops."""
        return await self._stack.enter_async_context(context)

    def on_stop(self, callback: Callable[[], Awaitable[None]]) -> None:
        """`callback()` when the service stops, before what was opened until now closes."""
        self._stack.push_async_callback(callback)

    async def consume(self, connection: AbstractRobustConnection, consumer: Consumer, queues: str,
                      health: WriterHealth, pool: AsyncConnectionPool[Conn]) -> Worker:
        """A consumer that writes to Postgres as the service's loop (what `start` returns to `worker_app`): ready
        once `connection` is open and it has subscribed to `queues` (`add_consumer_check`), its writer health
        published (`publishing`) for as long as the service runs."""
        add_consumer_check(self.app, connection, consumer.subscribed, queues)
        await self.enter(publishing(health, pool, self.settings.write_health_publish_s))
        return consumer.run


StartUp = Callable[[Lifetime], Awaitable[None]]
MAIN_LOOP: web.AppKey[Worker] = web.AppKey("main_loop")


@dataclass(frozen=True, slots=True)
class Service:
    """One service: its name (the settings' port variable, the logs' and metrics' service label, the pool's and
    broker connection's names) and how its app is put together."""

    name: str

    def app(self, settings: Settings, start: StartUp, *, http: web.Application | None = None) -> web.Application:
        """The service's app (`http`, else a plain `make_app()`): `start` opens what it needs while the app starts
        (before any background loop), all of it closed in reverse order when it stops (after the loops drained)."""
        app = base_app(settings, make_app() if http is None else http)

        async def lifetime(app: web.Application) -> AsyncIterator[None]:
            async with AsyncExitStack() as stack:
                await start(Lifetime(app, self.name, stack))
                yield

        app.cleanup_ctx.append(lifetime)
        return app

    def worker_app(self, settings: Settings, start: Callable[[Lifetime], Awaitable[Worker]]) -> web.Application:
        """The app of a service whose work is one loop: the one `start` returns, run in the background (named after
        the service) once `start` has opened everything, stopped and drained before any of it closes."""

        async def open_and_keep_loop(life: Lifetime) -> None:
            life.app[MAIN_LOOP] = await start(life)

        app = self.app(settings, open_and_keep_loop)
        background(app, self.name, lambda stop: app[MAIN_LOOP](stop))
        return app

    def serve(self, build: Callable[[Settings], web.Application]) -> None:
        serve(self.name, build)
