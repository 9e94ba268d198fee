"""HTTP and WebSocket routes of the desktop API (docs/architecture.md, Interfaces)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
from aiohttp import WSMsgType, web

from libs.contracts.common import ContractError, decode_json
from libs.contracts.http import CancelRequest, ExtendRequest, LeaseRequest, ResultRequest
from libs.contracts.wire import (
    CAPABILITIES_HEADER,
    CAPABILITIES_QUERY,
    SUPPORTED_MAJORS,
    ErrorEvent,
    Heartbeat,
    HeartbeatAck,
    client_message_decoder,
    subprotocol,
)
from libs.http import ApiError, json_response, mark_upgraded, read_body
from libs.telemetry import metrics
from services.dispatch_hub import leases
from services.dispatch_hub.auth import ClientAuthenticator, ClientPrincipal
from services.dispatch_hub.connections import Connection
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.leases import HubContext
from services.dispatch_hub.logic import (
    IPNetwork,
    ProtocolChoice,
    TokenBuckets,
    address_bucket,
    choose_protocol,
    client_address,
)
from services.dispatch_hub.openapi import openapi_document

log = logging.getLogger("hub.http")

AUTH = web.AppKey("auth", ClientAuthenticator)
GATEWAY = web.AppKey("gateway", Gateway)
CONTEXT = web.AppKey("hub_context", HubContext)
MAX_BODY = web.AppKey("max_body", int)
# A client message is at most MAX_WS_MESSAGE bytes. Frames up to MAX_WS_FRAME are still read and answered (an
# `error` event `frame_too_large`, the socket stays open); a larger one aiohttp refuses from its header, before
# buffering the payload, and closes the socket with 1009 (docs/security.md, WebSocket frames).
MAX_WS_MESSAGE = 64 * 1024
MAX_WS_FRAME = 4 * MAX_WS_MESSAGE


@dataclass(slots=True)
class UpgradeLimits:
    """WebSocket upgrade budgets: per source address (checked before the token is looked up) and per client.
    Behind trusted proxies (HUB_TRUSTED_PROXIES) the source address is the client's, from X-Forwarded-For."""

    by_address: TokenBuckets
    by_client: TokenBuckets
    trusted_proxies: tuple[IPNetwork, ...] = ()

    def address_of(self, request: web.Request) -> str:
        """The budget key of the upgrade's source: its address (IPv4) or /64 (IPv6)."""
        return address_bucket(client_address(request.remote, request.headers.getall("X-Forwarded-For", ()),
                                             self.trusted_proxies))

    def share_among(self, replicas: int) -> None:
        """The budgets hold for the fleet: this replica takes its share (the replicas alive, from their sweeps)."""
        self.by_address.share_among(replicas)
        self.by_client.share_among(replicas)

    def check(self, buckets: TokenBuckets, key: str, what: str) -> None:
        wait = buckets.take(key, time.monotonic())
        if wait is not None:
            metrics.edge_rejected_total.inc(service="dispatch-hub", reason=f"upgrade_rate_{what}")
            raise ApiError(429, "rate_limited", f"too many WebSocket connections from this {what}; retry in "
                           f"{math.ceil(wait)} s", retry_after_s=math.ceil(wait))


UPGRADE_LIMITS = web.AppKey("upgrade_limits", UpgradeLimits)
HANDSHAKES = web.AppKey("handshakes", asyncio.Semaphore)  # HUB_HANDSHAKE_CONCURRENCY
_KINDS = {WSMsgType.TEXT: "text", WSMsgType.BINARY: "binary", WSMsgType.PING: "ping", WSMsgType.PONG: "pong"}


async def _principal(request: web.Request) -> ClientPrincipal:
    return await request.app[AUTH].authenticate(request.headers.get("Authorization"))


def _task_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["task_id"])
    except ValueError:
        raise ApiError(404, "not_found", "no such task for this client") from None


async def lease_handler(request: web.Request) -> web.Response:
    principal = await _principal(request)
    body = await read_body(request, LeaseRequest, max_bytes=request.app[MAX_BODY], allow_empty=True)
    return json_response(await leases.lease(request.app[CONTEXT], principal, body))


async def extend_handler(request: web.Request) -> web.Response:
    principal = await _principal(request)
    task_id = _task_id(request)
    body = await read_body(request, ExtendRequest, max_bytes=request.app[MAX_BODY])
    return json_response(await leases.extend(request.app[CONTEXT], principal, task_id, body))


async def cancel_handler(request: web.Request) -> web.Response:
    principal = await _principal(request)
    task_id = _task_id(request)
    body = await read_body(request, CancelRequest, max_bytes=request.app[MAX_BODY])
    return json_response(await leases.cancel(request.app[CONTEXT], principal, task_id, body))


async def result_handler(request: web.Request) -> web.Response:
    principal = await _principal(request)
    task_id = _task_id(request)
    body = await read_body(request, ResultRequest, max_bytes=request.app[MAX_BODY])
    return json_response(await leases.result(request.app[CONTEXT], principal, task_id, body), status=202)


async def events_gone(_: web.Request) -> web.Response:
    raise ApiError(410, "gone", "server-sent events are retired; connect to GET /api/desktop/ws (WebSocket)")


async def openapi_handler(_: web.Request) -> web.Response:
    return json_response(openapi_document())


class _Typed(msgspec.Struct):
    type: str


def decode_client_message(data: str) -> Heartbeat:
    """Client -> server messages must name their `type` (a bare object is not taken as a heartbeat)."""
    raw = data.encode()
    if len(raw) > MAX_WS_MESSAGE:
        raise ContractError("frame_too_large", f"the frame is {len(raw)} bytes; a message is at most "
                            f"{MAX_WS_MESSAGE} bytes (frames over {MAX_WS_FRAME} bytes close the socket with 1009)")
    decode_json(raw, _Typed, max_bytes=MAX_WS_MESSAGE)
    return decode_json(raw, Heartbeat, max_bytes=MAX_WS_MESSAGE, decoder=client_message_decoder)


def _error_event(exc: ContractError | None = None, *, code: str = "", message: str = "",
                 field: str | None = None) -> str:
    if exc is not None:
        code, message, field = exc.code, exc.message, exc.field
    return msgspec.json.encode(ErrorEvent(error=code, message=message, field=field)).decode()


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    limits = request.app[UPGRADE_LIMITS]
    limits.check(limits.by_address, limits.address_of(request), "address")
    protocol = choose_protocol(request.headers.getall("Sec-WebSocket-Protocol", ()))
    if protocol.major is None:  # before the token lookup: a refused version costs no query
        log.info("websocket upgrade refused: no protocol major this hub serves was offered",
                 extra={"offered": ",".join(request.headers.getall("Sec-WebSocket-Protocol", ()))[:200]})
        raise ApiError(400, "unsupported_protocol_version", "this hub speaks the desktop protocol as the WebSocket "
                       f"subprotocol(s) {', '.join(map(subprotocol, SUPPORTED_MAJORS))}; offer one of them (or none: "
                       "major 1)", field="Sec-WebSocket-Protocol")
    # One of HUB_HANDSHAKE_CONCURRENCY handshakes at a time, until the hello and replay are queued (a storm's
    # handshakes in turn, not all at once in front of the live sockets' events and lease calls).
    handshakes = request.app[HANDSHAKES]
    metrics.desktop_ws_handshakes_waiting.inc()
    try:
        await handshakes.acquire()
    finally:
        metrics.desktop_ws_handshakes_waiting.dec()
    handshaking = True
    try:
        principal = await _principal(request)  # 401 JSON before the upgrade
        limits.check(limits.by_client, str(principal.client_id), "client")
        gateway = request.app[GATEWAY]
        if gateway.closing:
            raise ApiError(503, "shutting_down", "this hub is shutting down; reconnect")
        ws, conn = await _upgrade(request, protocol, principal, gateway)
    except BaseException:
        handshakes.release()
        raise
    client_id = principal.client_id
    try:
        first = await gateway.attach(conn)
        conn.go_live(first)
        handshakes.release()
        handshaking = False
        async for msg in ws:
            conn.touch()
            metrics.websocket_messages_total.inc(direction="in", kind=_KINDS.get(msg.type, "other"))
            if msg.type == WSMsgType.TEXT:
                try:
                    heartbeat = decode_client_message(msg.data)
                except ContractError as exc:
                    conn.deliver(_error_event(exc))
                    continue
                if heartbeat.platform_health is not None:
                    unknown = await request.app[CONTEXT].platforms.unknown_codes(
                        request.app[CONTEXT].pool, heartbeat.platform_health)
                    if unknown:
                        conn.deliver(_error_event(code="unknown_platform", field="platform_health",
                                                  message=f"no AI platform has the code(s) {', '.join(unknown)}"))
                        continue
                    gateway.heartbeats.report_health(client_id, dict(heartbeat.platform_health))
                gateway.heartbeats.touch(client_id)
                conn.deliver(msgspec.json.encode(HeartbeatAck(server_time=datetime.now(UTC))).decode())
            elif msg.type == WSMsgType.PING:
                gateway.heartbeats.touch(client_id)
                await ws.pong(msg.data)
            elif msg.type == WSMsgType.PONG:
                gateway.heartbeats.touch(client_id)
            elif msg.type == WSMsgType.BINARY:
                conn.deliver(_error_event(code="invalid_message", message="send JSON text frames", field="type"))
            elif msg.type == WSMsgType.ERROR:
                log.info("websocket error", extra={"client_id": str(client_id), "error": str(ws.exception())})
                break
    finally:
        if handshaking:
            handshakes.release()
        # aiohttp cancels the handler when the peer goes away: the cleanup runs as its own task so
        # unbinding and marking offline always complete (shutdown waits for it before closing the pool).
        await asyncio.shield(gateway.spawn_cleanup(_close_and_detach(gateway, conn)))
    return ws


async def _upgrade(request: web.Request, protocol: ProtocolChoice, principal: ClientPrincipal,
                   gateway: Gateway) -> tuple[web.WebSocketResponse, Connection]:
    """The 101 and the socket's Connection (not yet attached)."""
    # autoping off: pings and pongs reach this loop, so both count as heartbeats.
    # aiohttp refuses a message of max_msg_size bytes or more (1009); the cap is "at most MAX_WS_FRAME", hence + 1.
    # The chosen subprotocol is echoed in the 101 (none when the client offered none).
    # compress off: permessage-deflate is declined (docs/desktop-protocol.md, Connecting). Node's `ws`, which the
    # TypeScript SDK uses, offers it by default, and aiohttp accepts an offer unless told not to: each socket
    # would then hold a zlib compressor (~256 KiB: gigabytes over a hub's 10,000 sockets) and every event would
    # be compressed on the event loop, for frames of a few hundred bytes that barely shrink.
    ws = web.WebSocketResponse(autoping=False, max_msg_size=MAX_WS_FRAME + 1, compress=False,
                               protocols=(protocol.subprotocol,) if protocol.subprotocol else ())
    try:
        await ws.prepare(request)
    except ConnectionResetError:
        # The client gave up before its upgrade was answered (its handshake timeout, at a reconnect storm): as
        # when aiohttp cancels a handler whose client went away, a 499, not a 500 with a traceback to log.
        raise asyncio.CancelledError from None
    mark_upgraded()
    conn = Connection(ws, principal, capabilities=gateway.grant(
        [*request.headers.getall(CAPABILITIES_HEADER, ()), *request.query.getall(CAPABILITIES_QUERY, ())]))
    conn.start()
    return ws, conn


async def _close_and_detach(gateway: Gateway, conn: Connection) -> None:
    await conn.stop()
    if not conn.ws.closed:
        with contextlib.suppress(Exception):
            await conn.ws.close()
    await gateway.detach(conn)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/desktop/ws", websocket_handler)
    app.router.add_post("/api/desktop/monitor/lease", lease_handler)
    app.router.add_post("/api/desktop/tasks/{task_id}/extend", extend_handler)
    app.router.add_post("/api/desktop/tasks/{task_id}/cancel", cancel_handler)
    app.router.add_post("/api/desktop/tasks/{task_id}/result", result_handler)
    app.router.add_route("*", "/api/desktop/events", events_gone)
    app.router.add_get("/openapi.json", openapi_handler)
