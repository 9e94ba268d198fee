"""Real leases for fuzzing the success paths of the desktop task calls (extend, cancel, result) against a running
dispatch-hub (tests/e2e/test_contract_fuzz.py).

A fuzzing client of its own: for each generated case one queued execution is seeded for it and leased through the
hub's HTTP API, and the case's path parameter and lease fields are filled from that lease most of the time and
mutated some of the time (`LeasePlan`). What a schema-valid request must then be answered follows from what was
sent (`expected_answer`), a refusal must change nothing and an acceptance must change what it says
(`check_effect`), and after the run the fuzzing client's rows and the results it published are read back
(`RealLeases.invariants`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any, TypeVar

import aio_pika
import msgspec
import psycopg
import requests
from psycopg.rows import dict_row
from schemathesis import Case

from libs.config import Settings
from libs.contracts.http import CancelRequest, ExtendRequest, ResultRequest
from libs.db.pool import Conn
from libs.demo import create_client
from libs.mq.topology import Topology
from services.dispatch_hub.logic import LEASE_TOKEN_PREFIX, PREEMPT_REASON, result_id_for
from tests.support.desktop import dispatch_execution, request_interrupt

T = TypeVar("T")

LEASE = "/api/desktop/monitor/lease"
EXTEND = "/api/desktop/tasks/{task_id}/extend"
CANCEL = "/api/desktop/tasks/{task_id}/cancel"
RESULT = "/api/desktop/tasks/{task_id}/result"
BODY_FIELDS: dict[str, frozenset[str]] = {
    path: frozenset(body.__struct_fields__)
    for path, body in ((EXTEND, ExtendRequest), (CANCEL, CancelRequest), (RESULT, ResultRequest))}


@dataclass(frozen=True)
class Lease:
    task_id: uuid.UUID
    token: str
    epoch: int
    # The execution's interrupt generation: what a preempt acknowledgement carries.
    generation: int
    # The server asked the running execution to yield (what collect-now writes on a running scheduled execution).
    interrupt: bool


# What a case may change of the real lease: one of its values (the task id, the token, and on a cancel the interrupt
# generation or the reason) to the value named; `generated` keeps what schemathesis generated.
# `reason:unasked`: a cancel acknowledging a preemption on an execution no interrupt was requested for.
MUTATIONS = ("task:unknown", "task:other_client", "task:generated", "token:other_secret", "token:older_epoch",
             "token:newer_epoch", "token:generated")
CANCEL_MUTATIONS = ("generation:older", "generation:newer", "generation:generated", "reason:unasked")
# The share of cases on the real lease's own values.
UNMUTATED = 0.55


@dataclass(frozen=True)
class LeasePlan:
    """How one case is set up and filled: the real lease's values, or one of them mutated."""

    mutation: str | None  # None: every value the lease's own; else one of MUTATIONS (or CANCEL_MUTATIONS)
    # On an interrupted execution, cancel's reason is the preempt acknowledgement (otherwise the generated reason).
    preempt: bool
    initial_generation: int
    # The server asks the running execution to yield once it is leased (never for `reason:unasked`).
    interrupt: bool
    again: str  # none | same | other: after a 202 result, the same body posted again, or another one

    @property
    def interrupted(self) -> bool:
        return self.interrupt and self.mutation != "reason:unasked"

    def value(self, what: str) -> str:
        """`real`, or the mutation of `what` (task, token, generation or reason) this plan makes."""
        if self.mutation is not None and self.mutation.startswith(f"{what}:"):
            return self.mutation.split(":", 1)[1]
        return "real"


def plan_for(path: str, case: Case) -> LeasePlan:
    """The plan of a case: a pseudo-random function of the generated case, seeded by its content. (Drawn by
    hypothesis next to the case, the plan would mostly repeat: it reuses the choices of earlier examples. Derived
    from the case, it varies with it, and is the same whenever hypothesis runs the case again.)"""
    digest = hashlib.sha256(repr((path, case.path_parameters, case.body)).encode()).digest()
    rng = random.Random(digest)
    mutations = MUTATIONS + (CANCEL_MUTATIONS if path == CANCEL else ())
    return LeasePlan(mutation=None if rng.random() < UNMUTATED else rng.choice(mutations),
                     preempt=rng.random() < 0.5, initial_generation=rng.randrange(4), interrupt=rng.random() < 0.5,
                     again=rng.choice(("none", "same", "other")))


def _token(kind: str, lease: Lease) -> str:
    secret = lease.token.rsplit(".", 1)[1]
    return {"real": lease.token,
            "other_secret": f"{LEASE_TOKEN_PREFIX}.{lease.epoch}.{'x' * len(secret)}",
            "older_epoch": f"{LEASE_TOKEN_PREFIX}.{lease.epoch - 1}.{secret}",
            "newer_epoch": f"{LEASE_TOKEN_PREFIX}.{lease.epoch + 1}.{secret}"}[kind]


def fill(case: Case, plan: LeasePlan, lease: Lease, *, headers: dict[str, str], other_clients_task: uuid.UUID) -> (
    None
):
    """The client's credentials and the lease's values (or the plan's mutations of them) in the case; fields a
    negative case left out stay out, a body that is not an object stays as generated. (Credentials are fuzzed by
    schemathesis's own auth checks; a case is schema-invalid by its body or path here, never by a missing token.)"""
    case.headers = {**case.headers, **headers}
    task = {"real": lease.task_id, "unknown": uuid.uuid4(), "other_client": other_clients_task}.get(plan.value("task"))
    if task is not None:
        case.path_parameters = {**case.path_parameters, "task_id": str(task)}
    if not isinstance(case.body, dict):
        return
    body = dict(case.body)
    if "lease_token" in body and plan.value("token") != "generated":
        body["lease_token"] = _token(plan.value("token"), lease)
    if "interrupt_generation" in body and plan.value("generation") != "generated":
        body["interrupt_generation"] = {"real": lease.generation, "older": lease.generation - 1,
                                        "newer": lease.generation + 1}[plan.value("generation")]
    if "reason" in body and ((plan.preempt and lease.interrupt) or plan.value("reason") == "unasked"):
        body["reason"] = PREEMPT_REASON
    case.body = body


def _same_task(value: Any, task_id: uuid.UUID) -> bool:
    try:
        return uuid.UUID(str(value)) == task_id
    except ValueError:
        return False


def expected_answer(path: str, case: Case, lease: Lease, *, max_body: int) -> tuple[int, str | None] | None:
    """(status, error code) a schema-valid request on this lease must be answered; None for a schema-invalid one
    (the negative checks and the error-body check judge it) or a body near the size limit."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    body = case.body
    if len(json.dumps(body).encode()) > max_body // 2:
        return None
    if not _same_task(case.path_parameters.get("task_id"), lease.task_id):
        return 404, "not_found"
    if body["lease_token"] != lease.token:
        return 409, "stale_lease"
    if path == EXTEND:
        return 200, None
    if path == RESULT:
        return 202, None
    if body["reason"] == PREEMPT_REASON:
        if not lease.interrupt:
            return 409, "no_interrupt_requested"
        if body["interrupt_generation"] < lease.generation:
            return 409, "stale_generation"
    return 200, None


def check_answer(path: str, lease: Lease, status: int, answer: Any) -> None:
    """What an accepted call answers about this lease."""
    if path == EXTEND and status == 200:
        assert (answer["interrupt_requested"], answer["interrupt_generation"]) == (lease.interrupt, lease.generation)
    elif path == RESULT and status == 202:
        assert answer == {"accepted": True, "result_id": str(result_id_for(lease.task_id, lease.epoch))}
    elif path == CANCEL and status == 409 and answer["error"] == "stale_generation":
        assert answer["current_generation"] == lease.generation


def check_effect(path: str, status: int, body: Any, before: dict[str, Any], after: dict[str, Any]) -> None:
    """A refusal leaves the execution as it was; an acceptance did what it answered."""
    if status >= 400:
        assert after == before, f"a {status} changed the execution: {before} -> {after}"
    elif path == EXTEND:
        assert after["status"] == "in_progress" and after["lease_token_hash"] == before["lease_token_hash"]
        assert after["lease_expires_at"] >= before["lease_expires_at"]
        assert after["execution_phase"] == (body.get("execution_phase") or before["execution_phase"])
    elif path == CANCEL:
        assert after["status"] == "aborted" and after["lease_token_hash"] is None and after["finished_at"], after
    elif path == RESULT:
        assert after["status"] == "in_progress" and after["result_received_at"] and after["result_digest"], after


_STATE = """
SELECT status, lease_epoch, lease_token_hash, lease_expires_at, execution_phase, result_digest, result_received_at,
       finished_at
FROM desktop_tasks WHERE id = %(id)s
"""

# Every row of the fuzzing client (and the one execution of the other client) in a state the calls cannot leave
# it in. In this run nothing but the hub writes them (no coordinator, ingest or reconciler), so an execution is
# in progress (a posted result waits for ingest) or aborted, never anything else.
_VIOLATIONS = """
SELECT 'an in_progress execution without its lease (token, expiry, epoch)' AS problem, d.id::text AS what
FROM desktop_tasks d WHERE d.target_client_id = %(client)s AND d.status = 'in_progress'
  AND (d.lease_token_hash IS NULL OR d.lease_expires_at IS NULL OR d.leased_at IS NULL OR d.lease_epoch < 1)
UNION ALL
SELECT 'an ended execution still holding a lease token, or without finished_at', d.id::text
FROM desktop_tasks d WHERE d.target_client_id = %(client)s AND d.status NOT IN ('queued', 'in_progress', 'unknown')
  AND (d.lease_token_hash IS NOT NULL OR d.finished_at IS NULL)
UNION ALL
SELECT 'an execution neither in progress nor aborted', d.id::text || ' ' || d.status
FROM desktop_tasks d WHERE d.target_client_id = %(client)s AND d.status NOT IN ('in_progress', 'aborted')
UNION ALL
SELECT 'a result claim without its result received, or a result received without its claim', d.id::text
FROM desktop_tasks d
WHERE d.target_client_id = %(client)s AND (d.result_digest IS NULL) <> (d.result_received_at IS NULL)
UNION ALL
SELECT 'a received result on an execution that is no longer in progress', d.id::text || ' ' || d.status
FROM desktop_tasks d WHERE d.target_client_id = %(client)s AND d.result_received_at IS NOT NULL
  AND d.status <> 'in_progress'
UNION ALL
SELECT 'not one attempt per lease', d.id::text || ' epoch ' || d.lease_epoch || ', attempts ' || count(a.id)
FROM desktop_tasks d LEFT JOIN desktop_task_attempts a ON a.task_id = d.id
WHERE d.target_client_id = %(client)s GROUP BY d.id HAVING count(a.id) <> d.lease_epoch
UNION ALL
SELECT 'the current attempt disagrees with its execution', d.id::text || ' ' || d.status || '/' || a.status
FROM desktop_tasks d JOIN desktop_task_attempts a ON a.task_id = d.id AND a.lease_epoch = d.lease_epoch
WHERE d.target_client_id = %(client)s AND a.status <> d.status
UNION ALL
SELECT 'more leases in progress than the client may hold', c.id::text
FROM desktop_clients c WHERE c.id = %(client)s AND c.max_concurrent_monitor < (
    SELECT count(*) FROM desktop_tasks d
    WHERE d.target_client_id = c.id AND d.status = 'in_progress' AND d.result_received_at IS NULL)
UNION ALL
SELECT 'a business task in a status the desktop path cannot give it here', t.id::text || ' ' || t.status
FROM monitoring_collect_tasks t JOIN desktop_tasks d ON d.monitor_task_id = t.id
WHERE d.target_client_id = %(client)s
  AND (t.status NOT IN ('pending', 'failed') OR (t.status = 'failed') <> (t.completed_at IS NOT NULL)
       OR t.dispatch_attempts < 0 OR t.legacy_lease_id IS NOT NULL OR t.execution_owner <> 'desktop_tasks'
       OR (t.status = 'failed' AND d.status IN ('queued', 'in_progress', 'unknown')))
UNION ALL
SELECT 'another client''s execution was touched', d.id::text || ' ' || d.status
FROM desktop_tasks d WHERE d.id = %(other_task)s AND (d.status <> 'queued' OR d.lease_epoch <> 0)
"""

_RECEIVED = """
SELECT id::text AS task_id, lease_epoch FROM desktop_tasks
WHERE target_client_id = %(client)s AND result_received_at IS NOT NULL
"""


class RealLeases:
    """The fuzzing client of one tenant: a queued execution seeded and leased through the hub for each case."""

    def __init__(self, settings: Settings, base_url: str, tenant: dict[str, Any], platform_ids: list[int]) -> None:
        self.base_url = base_url
        self.max_body = settings.max_body_bytes
        self._amqp_url = settings.amqp_url
        self._topology = Topology(prefix=settings.mq_prefix, ingest_shards=settings.ingest_shards)
        self._tenant = tenant
        self._platform_ids = platform_ids
        self._seeded = 0
        self.leased = 0
        # (task_id, lease_epoch) of every result message of this client on the ingest queues
        self.published: Counter[tuple[str, int]] = Counter()
        self._session = requests.Session()
        self._runner = asyncio.Runner()
        self._conn: Conn = self._run(psycopg.AsyncConnection.connect(
            settings.database_url, autocommit=True, row_factory=dict_row))
        ids = {"tenant_id": tenant["tenant_id"], "workspace_id": tenant["workspace_id"], "user_id": tenant["user_id"]}
        self.client_id, token = self._run(create_client(self._conn, name="fuzz-real-leases", **ids))
        other_client, _ = self._run(create_client(self._conn, name="fuzz-other-client", **ids))
        self.headers = {"Authorization": f"Bearer {token}"}
        self.other_clients_task = self._seed(other_client, generation=0)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(coro)

    def close(self) -> None:
        self._session.close()
        self._run(self._conn.close())
        self._runner.close()

    def _seed(self, client_id: uuid.UUID, *, generation: int) -> uuid.UUID:
        """A queued execution of a business task of its own (question x platform x day, so no two share a key)."""
        index, self._seeded = self._seeded, self._seeded + 1
        platforms, questions = len(self._platform_ids), len(self._tenant["brands"][0]["question_ids"])
        seeded = self._run(dispatch_execution(
            self._conn, tenant=self._tenant, client_id=client_id, platform_id=self._platform_ids[index % platforms],
            question_index=(index // platforms) % questions, generation=generation,
            business_date=date.today() - timedelta(days=index // (platforms * questions))))
        task_id: uuid.UUID = seeded["task_id"]
        return task_id

    def post(self, path: str, task_id: uuid.UUID | None, body: dict[str, Any]) -> requests.Response:
        url = self.base_url + (path.format(task_id=task_id) if task_id is not None else path)
        return self._session.post(url, json=body, headers=self.headers, timeout=15)

    def lease(self, *, generation: int, interrupt: bool) -> Lease:
        """Seed one queued execution, lease it through the hub; an interrupt requested on it once running."""
        task_id = self._seed(self.client_id, generation=generation)
        answer = self.post(LEASE, None, {"max_tasks": 1})
        assert answer.status_code == 200, answer.text
        tasks = answer.json()["tasks"]
        assert [t["task_id"] for t in tasks] == [str(task_id)], tasks
        assert tasks[0]["interrupt_generation"] == generation
        self.leased += 1
        if interrupt:
            generation += 1
            self._run(request_interrupt(self._conn, task_id=task_id, generation=generation))
        return Lease(task_id=task_id, token=tasks[0]["lease_token"], epoch=int(tasks[0]["lease_epoch"]),
                     generation=generation, interrupt=interrupt)

    def state(self, task_id: uuid.UUID) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            cur = await self._conn.execute(_STATE, {"id": task_id})
            row = await cur.fetchone()
            assert row is not None
            return dict(row)
        return self._run(read())

    def release(self, lease: Lease) -> None:
        """The client's slot back for the next case: a lease still held without a result is cancelled (through
        the hub, with its own token)."""
        row = self.state(lease.task_id)
        if row["status"] == "in_progress" and row["result_received_at"] is None:
            answer = self.post(CANCEL, lease.task_id, {"lease_token": lease.token, "reason": "fuzz case over",
                                                       "interrupt_generation": lease.generation})
            assert answer.status_code == 200, answer.text

    def _drain_results(self) -> None:
        """Take this client's result messages off the ingest queues (nothing consumes them in this run)."""
        async def drain() -> None:
            connection = await aio_pika.connect(self._amqp_url)
            try:
                channel = await connection.channel()
                for shard in range(self._topology.ingest_shards):
                    # basic.get does not work on a single-active-consumer quorum queue: a consumer takes what the
                    # queue holds (nothing is published while this runs).
                    queue = await channel.get_queue(self._topology.ingest_queue(shard))
                    waiting = queue.declaration_result.message_count or 0
                    if not waiting:
                        continue
                    async with queue.iterator(no_ack=True) as messages:
                        for _ in range(waiting):
                            message = await asyncio.wait_for(anext(messages), 10)
                            result = msgspec.json.decode(message.body)
                            if result["client_id"] == str(self.client_id):
                                self.published[(result["task_id"], int(result["lease_epoch"]))] += 1
            finally:
                await connection.close()
        self._run(drain())

    def invariants(self) -> list[str]:
        """Every violation in the fuzzing client's rows, and in the results published for them: one message per
        lease whose result was received, none for any other."""
        async def rows(statement: str) -> list[dict[str, Any]]:
            cur = await self._conn.execute(statement, {"client": self.client_id,
                                                       "other_task": self.other_clients_task})
            return [dict(r) for r in await cur.fetchall()]
        found = [f"{r['problem']}: {r['what']}" for r in self._run(rows(_VIOLATIONS))]
        self._drain_results()
        received = {(r["task_id"], int(r["lease_epoch"])) for r in self._run(rows(_RECEIVED))}
        found += [f"result published {n} times: {key}" for key, n in self.published.items() if n != 1]
        found += [f"result received, never published: {key}" for key in sorted(received - set(self.published))]
        found += [f"result published, never received: {key}" for key in sorted(set(self.published) - received)]
        return found
