"""`enqueue(conn, ...)`: the outbox row is written in the caller's transaction, committed with it."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from libs.contracts.amqp import MESSAGE_TYPES, message_type
from libs.db.pool import Conn
from libs.mq.topology import LOGICAL_EXCHANGES
from libs.outbox.tracing import current_traceparent

NOTIFY_CHANNEL = "outbox_pending"

_INSERT = """
INSERT INTO outbox (event_id, exchange, routing_key, message_type, payload, headers, ordering_key,
                    tenant_id, traceparent, max_attempts, priority)
VALUES (%(event_id)s, %(exchange)s, %(routing_key)s, %(message_type)s, %(payload)s, %(headers)s,
        %(ordering_key)s, %(tenant_id)s, %(traceparent)s, %(max_attempts)s, %(priority)s)
"""
# Writers of one ordering key take this lock until commit, so for one key id order = commit order.
_LOCK_ORDERING_KEY = "SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 7401))"
_NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"
# NOTIFY payloads: the pump wakes its priority loop only for PRIORITY_WAKE, a regular loop for anything.
REGULAR_WAKE = ""
PRIORITY_WAKE = "p"


def notify_payload(priority: bool) -> str:
    return PRIORITY_WAKE if priority else REGULAR_WAKE


async def enqueue(
    conn: Conn,
    *,
    exchange: str,
    routing_key: str,
    message: msgspec.Struct,
    ordering_key: str | None = None,
    tenant_id: int | None = None,
    notify: bool = False,
    max_attempts: int = 10,
    headers: dict[str, Any] | None = None,
    priority: int = 0,
) -> uuid.UUID:
    """Write one event into the outbox inside the caller's open transaction.

    `notify=True` wakes the pumps at commit (a cluster-wide lock at commit time, so only for
    latency-sensitive writes; bulk writers rely on the pump draining while there is work).
    `priority` > 0 (latency-sensitive events: high dispatch, collect-now control) is claimed before
    older normal events; per ordering key the publish order stays commit order.
    """
    if not conn.info.transaction_status:  # IDLE: no transaction open on this connection
        raise RuntimeError("outbox.enqueue must run inside the caller's transaction")
    if exchange not in LOGICAL_EXCHANGES:
        raise ValueError(f"unknown exchange {exchange!r}; expected one of {LOGICAL_EXCHANGES}")
    kind = message_type(message)
    if kind not in MESSAGE_TYPES:
        raise ValueError(f"message type {kind!r} has no contract")
    if ordering_key is not None:
        await conn.execute(_LOCK_ORDERING_KEY, {"key": ordering_key})
    event_id = uuid.uuid4()
    await conn.execute(
        _INSERT,
        {
            "event_id": event_id,
            "exchange": exchange,
            "routing_key": routing_key,
            "message_type": kind,
            "payload": msgspec.json.encode(message),
            "headers": msgspec.json.encode(headers or {}).decode(),
            "ordering_key": ordering_key,
            "tenant_id": tenant_id,
            "traceparent": current_traceparent(),
            "max_attempts": max_attempts,
            "priority": priority,
        },
    )
    if notify:
        await conn.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL, "payload": notify_payload(priority > 0)})
    return event_id


class OutboxEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event for `enqueue_many`."""

    exchange: str
    routing_key: str
    message: msgspec.Struct
    ordering_key: str | None = None
    tenant_id: int | None = None
    priority: int = 0
    # This event's own trace context (one writer's batch may serve several traces); default: the current span's.
    traceparent: str | None = None


_INSERT_MANY = """
INSERT INTO outbox (event_id, exchange, routing_key, message_type, payload, ordering_key, tenant_id, traceparent,
                    max_attempts, priority)
SELECT e.event_id, e.exchange, e.routing_key, e.message_type, e.payload, e.ordering_key, e.tenant_id,
       coalesce(e.traceparent, %(traceparent)s), %(max_attempts)s, e.priority
FROM unnest(%(event_ids)b::uuid[], %(exchanges)b::text[], %(routing_keys)b::text[], %(message_types)b::text[],
            %(payloads)b::bytea[], %(ordering_keys)b::text[], %(tenant_ids)b::bigint[], %(priorities)b::smallint[],
            %(traceparents)b::text[])
     WITH ORDINALITY AS e(event_id, exchange, routing_key, message_type, payload, ordering_key, tenant_id, priority,
                          traceparent, n)
ORDER BY e.n
"""
# Keys locked in one statement, in a fixed order, so two bulk writers can never deadlock on them.
_LOCK_ORDERING_KEYS = """
SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT hashtextextended(k, 7401) AS h
                                      FROM unnest(%(keys)b::text[]) AS k ORDER BY 1) keys
"""


async def enqueue_many(conn: Conn, events: list[OutboxEvent], *, notify: bool = False,
                       max_attempts: int = 10, priority: int | None = None) -> list[uuid.UUID]:
    """`enqueue` for a batch: one ordering-key lock statement and one INSERT, ids in list order.

    `priority` applies to every event when given; otherwise each event's own `priority` (default 0).

    Same guarantees as `enqueue` (inside the caller's transaction; per ordering key, id order is
    commit order). For bulk writers such as the dispatch coordinator.
    """
    if not events:
        return []
    if not conn.info.transaction_status:
        raise RuntimeError("outbox.enqueue_many must run inside the caller's transaction")
    kinds = []
    for event in events:
        if event.exchange not in LOGICAL_EXCHANGES:
            raise ValueError(f"unknown exchange {event.exchange!r}; expected one of {LOGICAL_EXCHANGES}")
        kind = message_type(event.message)
        if kind not in MESSAGE_TYPES:
            raise ValueError(f"message type {kind!r} has no contract")
        kinds.append(kind)
    keys = sorted({e.ordering_key for e in events if e.ordering_key is not None})
    if keys:
        await conn.execute(_LOCK_ORDERING_KEYS, {"keys": keys})
    event_ids = [uuid.uuid4() for _ in events]
    await conn.execute(_INSERT_MANY, {
        "event_ids": event_ids,
        "exchanges": [e.exchange for e in events],
        "routing_keys": [e.routing_key for e in events],
        "message_types": kinds,
        "payloads": [msgspec.json.encode(e.message) for e in events],
        "ordering_keys": [e.ordering_key for e in events],
        "tenant_ids": [e.tenant_id for e in events],
        "priorities": [e.priority if priority is None else priority for e in events],
        # NULL (no array) unless an event has its own: unnest pads it with NULLs, the default applies.
        "traceparents": [e.traceparent for e in events] if any(e.traceparent for e in events) else None,
        "traceparent": current_traceparent(),
        "max_attempts": max_attempts,
    })
    if notify:
        prioritised = any((e.priority if priority is None else priority) > 0 for e in events)
        await conn.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL, "payload": notify_payload(prioritised)})
    return event_ids
