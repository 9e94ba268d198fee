"""dispatch-coordinator: leader-elected scheduler and budgeted dispatcher, with operator endpoints on :9101."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from libs.config import Settings
from libs.db.pool import PREPARE_ON_FIRST_USE
from libs.http import ApiError, json_response
from libs.leader import LeaderLock
from libs.mq.topology import Topology
from libs.outbox.relay import AmqpPublisher, OutboxRelay
from libs.runtime import SETTINGS, Lifetime, Service, add_broker_check, background
from libs.tasks.push_leases import PushLeaseIssuer
from services.dispatch_coordinator import admin, dispatcher
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from services.dispatch_coordinator.explain import explain_task

ROLE = "dispatch-coordinator"
SERVICE = Service(ROLE)
COORDINATOR = web.AppKey("coordinator", Coordinator)
LEADER = web.AppKey("leader", LeaderLock)
OPS_PREFIX = "/api/ops/"


def check_ops_token(settings: Settings, authorization: str) -> None:
    """The ops API is closed: a bearer token equal to OPS_API_TOKEN, or (no token configured) DEV_MODE."""
    expected = settings.ops_api_token
    if not expected:
        if settings.dev_mode:
            return
        raise ApiError(403, "ops_api_disabled", "the ops API is disabled: set OPS_API_TOKEN to enable it "
                                                "(DEV_MODE opens it without a token)")
    scheme, _, token = authorization.partition(" ")
    # Constant time: the comparison must not tell how much of a guessed token was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "send the ops token as `Authorization: Bearer <OPS_API_TOKEN>`")


@web.middleware
async def ops_auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> (
    web.StreamResponse
):
    """Every path under /api/ops/ (a route or not: unknown paths do not reveal which exist); /metrics, /healthz and
    /readyz stay open for Prometheus and the kubelet."""
    if (request.path + "/").startswith(OPS_PREFIX):
        check_ops_token(request.app[SETTINGS], request.headers.get("Authorization", ""))
    return await handler(request)


async def explain_handler(request: web.Request) -> web.Response:
    coordinator = request.app[COORDINATOR]
    async with coordinator.pool.connection() as conn:
        result = await explain_task(conn, request.match_info["task_id"], await coordinator.settings())
    if result is None:
        raise ApiError(404, "not_found", "no business task (or monitor execution) with that id", field="task_id")
    return json_response(result)


async def status_handler(request: web.Request) -> web.Response:
    coordinator = request.app[COORDINATOR]
    async with coordinator.pool.connection() as conn:
        result = await admin.status(conn)
    result["this_instance"] = {"instance_id": request.app[SETTINGS].instance_id,
                               "leader": request.app[LEADER].is_leader.is_set()}
    return json_response(result)


def build(settings: Settings) -> web.Application:
    settings.push_lease_key()  # fail closed: push-lease enabled without PUSH_LEASE_SECRET, no service
    settings.ops_token()  # fail closed: a short or placeholder OPS_API_TOKEN (outside DEV_MODE), no service
    app = SERVICE.app(settings, start)
    app.middlewares.append(ops_auth)  # inside json_errors: refusals are JSON
    app.router.add_get("/api/ops/tasks/{task_id}/explain", explain_handler)
    app.router.add_get("/api/ops/dispatch/status", status_handler)
    background(app, "dispatch-leader", lambda stop: app[LEADER].run(stop, app[COORDINATOR].lead))
    return app


async def start(life: Lifetime) -> None:
    settings = life.settings
    # dispatch pass, scanner, maintenance, ops endpoints; plus the leader lock and LISTEN connections.
    pool = await life.pool(min_size=1, max_size=max(4, settings.db_pool_max),
                           prepare_threshold=PREPARE_ON_FIRST_USE,  # the high pass runs once per click
                           warm_up=dispatcher.WARM_UP)
    amqp = await life.broker()
    topology = Topology(settings.mq_prefix, settings.ingest_shards)
    push_key = settings.push_lease_key()
    push_leases = PushLeaseIssuer(push_key, ttl_s=settings.push_lease_ttl_seconds) if push_key is not None else None
    relay = None
    if settings.coordinator_relay:
        # Publishes this process's own high TaskAvailable events right after the pass commits.
        publisher = await life.start(AmqpPublisher(
            settings.amqp_url, topology, timeout=settings.coordinator_relay_lease_seconds / 2,
            name=f"{ROLE}-relay-{settings.instance_id}"))
        relay = OutboxRelay(pool, publisher, claimed_by=f"{ROLE}:{settings.instance_id}",
                            backoff_base_ms=settings.outbox_backoff_base_ms,
                            backoff_max_ms=settings.outbox_backoff_max_ms)
    life.app[COORDINATOR] = Coordinator(
        pool, CoordinatorConfig(database_url=settings.database_url, topology=topology,
                                instance_id=settings.instance_id,
                                relay_lease_seconds=settings.coordinator_relay_lease_seconds,
                                push_leases=push_leases), amqp, relay)
    # The pool runs the leader's work: bound to the leader term while this replica leads (libs/leader.py).
    life.app[LEADER] = LeaderLock(settings.database_url, ROLE, holder=settings.instance_id, fenced=[pool])
    add_broker_check(life.app, amqp.connected.is_set)


def main() -> None:
    SERVICE.serve(build)
