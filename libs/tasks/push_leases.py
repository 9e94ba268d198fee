"""Push-lease (docs/desktop-protocol.md "Push-lease"): the dispatch that creates an execution for a client that
announced `push_lease` also leases it, and `task_available` carries the lease, so the client starts without a lease
call. Every statement of it, whoever runs it:

    (coordinator) queued --(issue: at dispatch, same transaction)--> in_progress, epoch 1, attempt opened
    (hub) records what a socket announced; adds the token to the pushed `task_available`; replays live pushed leases

The token is never stored nor queued: it is derived, `lt1.{epoch}.{HMAC-SHA256(key, "{task_id}:{epoch}")}`, by the
coordinator (which stores only its hash, as the lease call does) and by the hub (which puts it on the event it sends
to the client), both holding PUSH_LEASE_SECRET. The same task and epoch give the same token: a replayed
`task_available` hands out the same lease, never a second one. A lease nobody extends expires after
PUSH_LEASE_TTL_SECONDS and the reconciler's expired-lease job requeues it, as any expired lease; fencing, extend,
cancel and result are the pull-lease's (libs/tasks/executions.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec

from libs.auth import hash_token
from libs.contracts.amqp import LifecycleEvent
from libs.contracts.http import BrandRef, PlatformRef, QuestionRef
from libs.contracts.wire import TaskAvailable, dispatch_decoder
from libs.db.pool import Conn
from libs.mq.topology import LIFECYCLE
from libs.outbox.writer import OutboxEvent
from libs.tasks.executions import OPEN_ATTEMPT_SQL, lease_set_sql
from libs.tasks.fragments import CLIENT_FREE_SLOTS_SQL, platform_mode_sql

# The prefix and shape of every lease token (services/dispatch_hub/logic.py: LEASE_TOKEN_PREFIX, lease_token_epoch):
# a pushed token is fenced by the hub exactly as a pulled one.
TOKEN_PREFIX = "lt1"
# A fresh execution's first lease.
FIRST_EPOCH = 1


class PushLease(msgspec.Struct, frozen=True, kw_only=True):
    """An execution leased at dispatch: what its `task_available` carries besides the token."""

    task_id: uuid.UUID
    tenant_id: int
    target_client_id: uuid.UUID
    monitor_task_id: int
    lane: str
    ai_platform_id: int
    collect_request_id: uuid.UUID | None
    lease_epoch: int
    lease_expires_at: datetime
    brand: BrandRef
    question: QuestionRef
    platform: PlatformRef


class PushedReplay(msgspec.Struct, frozen=True, kw_only=True):
    """A live pushed lease of a reconnecting client: its `task_available` again, token included."""

    target_client_id: uuid.UUID
    event: TaskAvailable


def derive_token(key: bytes, task_id: uuid.UUID, epoch: int) -> str:
    """The lease token of (task, epoch): the same for the coordinator and every hub that hold `key`."""
    mac = hmac.new(key, f"{task_id}:{epoch}".encode(), hashlib.sha256).digest()
    return f"{TOKEN_PREFIX}.{epoch}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


# ---- the dispatch (the coordinator) ----------------------------------------------------------------------------

# The executions just created (INSERT_EXECUTIONS, same transaction) of clients whose socket announced push_lease, as
# many per client as it has free slots (the lease call's capacity, services/dispatch_hub/queries.CLIENT_CAPACITY), best
# first: leased as MARK_LEASED would (epoch 1, the derived token's hash, PREPARING, an attempt), with the collect-now
# request marked running (libs/tasks/requests.MARK_RUNNING); the rest stay queued for a pull. The clients' rows are
# held FOR SHARE by the pass (LOCK_CLIENTS / LOCK_HIGH_CLIENTS), so what a socket announced cannot change before the
# commit. Executions of the legacy path never come here (legacy.offer).
ISSUE = f"""
WITH r AS (
    SELECT * FROM json_to_recordset(%(rows)s::json) AS r(id uuid, token_hash text)
), ranked AS (
    SELECT d.id, d.target_client_id, r.token_hash,
           row_number() OVER (PARTITION BY d.target_client_id
                              ORDER BY d.lane_weight DESC, d.priority DESC, d.enqueued_at, d.id) AS n
    FROM r JOIN desktop_tasks d ON d.id = r.id
    JOIN desktop_clients c ON c.id = d.target_client_id AND c.push_lease
    WHERE d.kind = 'monitor' AND d.status = 'queued' AND d.lease_epoch = 0
), free AS (
    SELECT c.id, {CLIENT_FREE_SLOTS_SQL} AS slots
    FROM desktop_clients c WHERE c.id IN (SELECT target_client_id FROM ranked)
), leased AS (
    UPDATE desktop_tasks d
    SET {lease_set_sql(str(FIRST_EPOCH), "k.token_hash")}
    FROM ranked k JOIN free f ON f.id = k.target_client_id
    WHERE d.id = k.id AND k.n <= f.slots AND d.status = 'queued'
    RETURNING d.id, d.monitor_task_id, d.tenant_id, d.target_client_id, d.lease_epoch, d.interrupt_generation,
              d.lease_expires_at, d.lane, d.ai_platform_id, d.collect_request_id, d.brand_id, d.question_id
), attempt AS (
    {OPEN_ATTEMPT_SQL}
), running AS (
    UPDATE monitoring_collect_requests SET status = 'running', updated_at = now()
    WHERE id IN (SELECT collect_request_id FROM leased) AND status IN ('accepted', 'dispatching')
)
SELECT l.id AS task_id, l.tenant_id, l.target_client_id, l.monitor_task_id, l.lane, l.ai_platform_id,
       l.collect_request_id, l.lease_epoch, l.lease_expires_at, b.id AS brand_id, b.name AS brand_name,
       q.id AS question_id, q.text AS question_text, p.code AS platform_code,
       {platform_mode_sql("l.monitor_task_id")} AS platform_mode
FROM leased l
JOIN brands b ON b.id = l.brand_id
JOIN monitoring_questions q ON q.id = l.question_id
JOIN ai_platforms p ON p.id = l.ai_platform_id
"""


def _lease(r: dict[str, Any]) -> PushLease:
    return PushLease(task_id=r["task_id"], tenant_id=int(r["tenant_id"]), target_client_id=r["target_client_id"],
                     monitor_task_id=int(r["monitor_task_id"]), lane=r["lane"], ai_platform_id=int(r["ai_platform_id"]),
                     collect_request_id=r["collect_request_id"], lease_epoch=int(r["lease_epoch"]),
                     lease_expires_at=r["lease_expires_at"],
                     brand=BrandRef(brand_id=int(r["brand_id"]), name=r["brand_name"]),
                     question=QuestionRef(question_id=int(r["question_id"]), text=r["question_text"]),
                     platform=PlatformRef(ai_platform_id=int(r["ai_platform_id"]), code=r["platform_code"],
                                          mode=r["platform_mode"]))


async def issue(conn: Conn, rows: Sequence[dict[str, Any]], *, key: bytes, ttl_s: int) -> list[PushLease]:
    """Lease, in the caller's transaction, the executions just created from `rows` (INSERT_EXECUTIONS rows, `id`
    and `target_client_id`) whose client takes push-lease and has a free slot; the leases, one round trip."""
    if not rows:
        return []
    payload = [{"id": str(r["id"]), "token_hash": hash_token(derive_token(key, r["id"], FIRST_EPOCH))}
               for r in rows]
    # Synced, not just fetched: in the caller's pipeline (libs/db/tx.pipelined_transaction) a fetch without a sync
    # leaves libpq reporting the transaction status from before its BEGIN, which the outbox writer refuses.
    async with conn.pipeline() as pipe:
        cur = await conn.execute(ISSUE, {"rows": msgspec.json.encode(payload).decode(), "ttl_s": ttl_s})
        await pipe.sync()
    return [_lease(r) for r in await cur.fetchall()]


def with_leases(events: list[OutboxEvent], leases: Iterable[PushLease]) -> list[OutboxEvent]:
    """`events` (the pass's dispatch events) with each pushed lease on its `task_available` (no token: the hub
    derives it), followed by the `task.leased` lifecycle event of each, as the lease call emits."""
    by_task = {lease.task_id: lease for lease in leases}
    if not by_task:
        return events
    out: list[OutboxEvent] = []
    for event in events:
        message = event.message
        lease = by_task.get(message.task_id) if isinstance(message, TaskAvailable) else None
        if lease is not None:
            event = msgspec.structs.replace(event, message=msgspec.structs.replace(
                message, lease_epoch=lease.lease_epoch, lease_expires_at=lease.lease_expires_at, brand=lease.brand,
                question=lease.question, platform=lease.platform))
        out.append(event)
    now = datetime.now(UTC)
    out.extend(OutboxEvent(exchange=LIFECYCLE, routing_key="task.leased", tenant_id=lease.tenant_id,
                           message=LifecycleEvent(event="task.leased", tenant_id=lease.tenant_id, occurred_at=now,
                                                  client_id=lease.target_client_id, task_id=lease.task_id,
                                                  monitor_task_id=lease.monitor_task_id,
                                                  ai_platform_id=lease.ai_platform_id, lane=lease.lane,
                                                  collect_request_id=lease.collect_request_id))
               for lease in by_task.values())
    return out


# ---- the key both hold ------------------------------------------------------------------------------------------

# A hub whose PUSH_LEASE_SECRET is not the leader's would hand clients tokens whose hash matches nothing: every pushed
# lease refused at its first extend, expired, requeued and pushed again. The leader publishes a fingerprint of its
# key with its state (`dispatch_coordinator_state`, key "leader"); a hub compares its own (`key_agreement`) and, on a
# mismatch, grants push_lease to no socket and clears it from its clients, so their work is pulled instead.
_FINGERPRINT_LABEL = b"push-lease key fingerprint v1"
_LEADER_KEY_FINGERPRINT = """
SELECT value ->> 'push_lease_key' AS fingerprint FROM dispatch_coordinator_state WHERE key = 'leader'
"""
# The capability taken back from a hub's clients when its key is not the leader's.
_CLEAR_CAPABILITY_OF_HUB = "UPDATE desktop_clients SET push_lease = false WHERE connected_hub = %(hub)s AND push_lease"


def key_fingerprint(key: bytes) -> str:
    """A short public name of a key (HMAC of a fixed label): equal keys give equal names, and it tells nothing of
    the key."""
    return hmac.new(key, _FINGERPRINT_LABEL, hashlib.sha256).hexdigest()[:16]


async def key_agreement(conn: Conn, key: bytes) -> str | None:
    """The leader's key fingerprint when it differs from `key`'s; None when they agree or the leader pushes nothing
    (push-lease off there, or no leader has published one yet: no lease is pushed that this hub could spoil)."""
    cur = await conn.execute(_LEADER_KEY_FINGERPRINT)
    row = await cur.fetchone()
    leader = row["fingerprint"] if row is not None else None
    return leader if leader is not None and leader != key_fingerprint(key) else None


async def clear_capability_of_hub(conn: Conn, hub_id: str) -> None:
    """push_lease taken back from every client connected to `hub_id` (its key is not the leader's)."""
    await conn.execute(_CLEAR_CAPABILITY_OF_HUB, {"hub": hub_id})


# ---- the socket (the hub) --------------------------------------------------------------------------------------

# What each attaching client's socket announced (the latest socket of a client decides); read by ISSUE.
RECORD_CAPABILITY = """
UPDATE desktop_clients c SET push_lease = a.push_lease
FROM unnest(%(ids)b::uuid[], %(push)b::boolean[]) AS a(id, push_lease)
WHERE c.id = a.id AND c.push_lease IS DISTINCT FROM a.push_lease
"""


async def record_capability(conn: Conn, announced: dict[uuid.UUID, bool]) -> None:
    """Store whether each client's socket announced push_lease (in the caller's pipeline or transaction)."""
    if announced:
        ids = sorted(announced, key=str)  # row locks in one order
        await conn.execute(RECORD_CAPABILITY, {"ids": ids, "push": [announced[i] for i in ids]})


def add_token(body: bytes, key: bytes) -> str | None:
    """The dispatch event `body` with its lease token, when it is a pushed `task_available`; None otherwise (it is
    forwarded unchanged). The substring test keeps every other event off the decoder."""
    if b'"lease_epoch"' not in body:
        return None
    try:
        event = dispatch_decoder.decode(body)
    except msgspec.MsgspecError:
        return None
    if not isinstance(event, TaskAvailable) or event.lease_epoch is None:
        return None
    token = derive_token(key, event.task_id, event.lease_epoch)
    return msgspec.json.encode(msgspec.structs.replace(event, lease_token=token)).decode()


# A reconnecting client's live leases that were pushed (hash of the derived token, checked by the caller) and not yet
# answered with a result: their `task_available` again, with the same token.
REPLAY_PUSHED = f"""
SELECT d.id, d.kind, d.target_client_id, d.priority, d.lane, d.scheduler_group_key, d.business_date,
       d.interrupt_generation, d.updated_at, d.monitor_task_id, d.collect_request_id, d.lease_epoch,
       d.lease_token_hash, d.lease_expires_at, b.id AS brand_id, b.name AS brand_name, q.id AS question_id,
       q.text AS question_text, p.id AS ai_platform_id, p.code AS platform_code,
       {platform_mode_sql("d.monitor_task_id")} AS platform_mode
FROM desktop_tasks d
JOIN brands b ON b.id = d.brand_id
JOIN monitoring_questions q ON q.id = d.question_id
JOIN ai_platforms p ON p.id = d.ai_platform_id
WHERE d.target_client_id = ANY(%(client_ids)s::uuid[]) AND d.kind = 'monitor' AND d.status = 'in_progress'
  AND d.lease_epoch = {FIRST_EPOCH} AND d.lease_expires_at > now() AND d.result_received_at IS NULL
ORDER BY d.target_client_id, d.lane_weight DESC, d.priority DESC, d.enqueued_at
"""


async def replay(conn: Conn, client_ids: Sequence[uuid.UUID], *, key: bytes) -> list[PushedReplay]:
    """The pushed leases still live for these clients, each as the `task_available` (token included) it came with;
    a lease taken by a pull call (a random token) is not among them."""
    if not client_ids:
        return []
    cur = await conn.execute(REPLAY_PUSHED, {"client_ids": list(client_ids)})
    out: list[PushedReplay] = []
    for r in await cur.fetchall():
        token = derive_token(key, r["id"], int(r["lease_epoch"]))
        if r["lease_token_hash"] != hash_token(token):
            continue
        out.append(PushedReplay(target_client_id=r["target_client_id"], event=TaskAvailable(
            kind=r["kind"], task_id=r["id"], target_client_id=r["target_client_id"], priority=int(r["priority"]),
            lane=r["lane"], scheduler_group_key=r["scheduler_group_key"], business_date=r["business_date"],
            interrupt_generation=int(r["interrupt_generation"]), updated_at=r["updated_at"],
            monitor_task_id=r["monitor_task_id"], collect_request_id=r["collect_request_id"], lease_token=token,
            lease_epoch=int(r["lease_epoch"]), lease_expires_at=r["lease_expires_at"],
            brand=BrandRef(brand_id=int(r["brand_id"]), name=r["brand_name"]),
            question=QuestionRef(question_id=int(r["question_id"]), text=r["question_text"]),
            platform=PlatformRef(ai_platform_id=int(r["ai_platform_id"]), code=r["platform_code"],
                                 mode=r["platform_mode"]))))
    return out


class PushLeaseIssuer:
    """The dispatcher's side, configured once (PUSH_LEASE_SECRET, PUSH_LEASE_TTL_SECONDS): lease what it just
    created for push clients and put the leases on its events."""

    def __init__(self, key: bytes, *, ttl_s: int) -> None:
        self.key = key
        self.ttl_s = ttl_s
        self.issued = 0

    async def lease_created(self, conn: Conn, rows: Sequence[dict[str, Any]],
                            events: list[OutboxEvent]) -> list[OutboxEvent]:
        """`events` with the leases issued for `rows` (just created, in the caller's transaction)."""
        leases = await issue(conn, rows, key=self.key, ttl_s=self.ttl_s)
        self.issued += len(leases)
        return with_leases(events, leases)
