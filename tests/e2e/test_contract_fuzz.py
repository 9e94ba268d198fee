"""schemathesis against the real collect-now-api and dispatch-hub processes: each served /openapi.json is exact.

Every operation gets examples, coverage cases (boundaries, missing and wrong-typed fields, undeclared methods) and
fuzzed cases in positive and negative modes, with every schemathesis check on: no 5xx, only declared statuses,
content types and headers, bodies that match their schemas, schema-valid requests accepted, invalid ones refused,
credentials not ignored, 405 with `Allow` for undeclared methods. The cases sent per operation are summed up at the
end of the pytest run.

Random task ids only reach the refusals of extend, cancel and result, so their success paths are fuzzed on real
leases too (tests/support/lease_fuzz.py): each case on a fresh lease of a fuzzing client's own, its lease fields
mostly the lease's and sometimes mutated, every schemathesis check plus the answer the sent values call for, a
JSON error naming the problem for every 4xx, and the database and published results consistent afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import msgspec
import psycopg
import pytest
import schemathesis
from psycopg import sql
from psycopg.conninfo import make_conninfo
from schemathesis import Case, CheckContext, GenerationMode, Response
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import positive_data_acceptance, unsupported_method

from libs.config import Settings
from libs.contracts.http import ErrorBody
from libs.db.pool import make_pool
from libs.mq.topology import Topology
from services.collect_now_api.openapi import openapi_document as collect_now_document
from services.dispatch_hub.openapi import openapi_document as hub_document
from tests.support.collect_now import JWT_SECRET, World, make_world
from tests.support.desktop import dispatch_execution
from tests.support.env import Backends
from tests.support.fuzz_report import error_lines, fuzz_report
from tests.support.lease_fuzz import (
    BODY_FIELDS,
    CANCEL,
    EXTEND,
    RESULT,
    RealLeases,
    check_answer,
    check_effect,
    expected_answer,
    fill,
    plan_for,
)
from tests.support.procs import ServiceProcess, service_env
from tools.contracts_docs import CONTRACTS_DIR

MAX_EXAMPLES = 50


@dataclass
class Target:
    process: ServiceProcess
    headers: dict[str, str]
    world: World


class FuzzCounts:
    """Cases sent and failing per operation and service, added to the terminal summary at the end of the run."""

    def __init__(self) -> None:
        self.sent: dict[str, Counter[str]] = {}
        self.failed: dict[str, Counter[str]] = {}
        self.statuses: dict[tuple[str, str], Counter[int]] = {}

    def count(self, service: str, case: Case) -> None:
        self.sent.setdefault(service, Counter())[case.operation.label] += 1

    def answered(self, service: str, case: Case, status: int) -> None:
        self.statuses.setdefault((service, case.operation.label), Counter())[status] += 1

    def fail(self, service: str, case: Case) -> None:
        self.failed.setdefault(service, Counter())[case.operation.label] += 1

    def lines(self) -> list[str]:
        out = []
        for service, counts in self.sent.items():
            failed = self.failed.get(service, Counter())
            out.append(f"{service}: {sum(counts.values())} cases over {len(counts)} operations, "
                       f"{sum(failed.values())} failing")
            for label, sent in sorted(counts.items()):
                answers = ", ".join(f"{status} x{n}" for status, n in
                                    sorted(self.statuses.get((service, label), Counter()).items()))
                out.append(f"  {sent:5d} sent  {failed[label]:3d} failing  {label}  ({answers})")
        return out


COUNTS = FuzzCounts()


@pytest.fixture
def summary(request: pytest.FixtureRequest) -> FuzzCounts:
    fuzz_report(request.config).provide("contract fuzz (schemathesis)", COUNTS.lines)
    return COUNTS


CONFIG = schemathesis.Config.from_dict({
    "generation": {"max-examples": MAX_EXAMPLES, "mode": "all", "database": "none"},
    "checks": {"enabled": True},
    "suppress-health-check": ["all"],
    "request-timeout": 15,
})
# The documents as the services build them (no I/O); test_the_served_documents_are_these checks that each
# process serves exactly this.
COLLECT_NOW_SCHEMA = schemathesis.openapi.from_dict(collect_now_document(), config=CONFIG)
HUB_SCHEMA = schemathesis.openapi.from_dict(hub_document(), config=CONFIG)


# ---- one database, broker prefix and pair of processes for the whole module -------------------------------

@pytest.fixture(scope="module")
def module_settings(backend: Backends, template_db: str, _broker_prefixes: list[Topology]) -> Iterator[Settings]:
    name = f"mon_fuzz_{uuid.uuid4().hex[:12]}"
    admin = make_conninfo(backend.database_url, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                     sql.Identifier(template_db)))
    topology = Topology(prefix=f"t{uuid.uuid4().hex[:10]}.", ingest_shards=4)
    _broker_prefixes.append(topology)
    try:
        yield Settings(database_url=make_conninfo(backend.database_url, dbname=name), amqp_url=backend.amqp_url,
                       mq_prefix=topology.prefix, ingest_shards=topology.ingest_shards,
                       gateway_jwt_secret=JWT_SECRET, shutdown_grace_seconds=5)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


async def _seed(settings: Settings) -> World:
    pool = make_pool(settings, name="fuzz-seed", min_size=1, max_size=1)
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            world = await make_world(conn, tenants=2, questions=3, keywords_per_brand=2)
            # Queued work for the hub's client, so leases answer real tasks.
            for index in range(6):
                await dispatch_execution(conn, tenant=world.tenant, platform_id=world.platform_ids[index % 3],
                                         client_id=world.client_id(), question_index=index // 3)
    finally:
        await pool.close()
    return world


@pytest.fixture(scope="module")
def world(module_settings: Settings) -> World:
    return asyncio.run(_seed(module_settings))


@contextlib.contextmanager
def _running(name: str, env: dict[str, str], log_dir: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess(name, env, log_dir=log_dir)
    proc.start()
    try:
        yield proc
    finally:
        code = proc.stop()
    assert code == 0, proc.logs()[-3000:]
    # A refusal is an answer, never a crash: nothing unhandled, nothing logged as an error.
    assert error_lines(proc.logs()) == []


@pytest.fixture(scope="module")
def collect_now_target(module_settings: Settings, world: World, tmp_path_factory: pytest.TempPathFactory) -> (
    Iterator[Target]
):
    with _running("collect-now-api", service_env(module_settings),
                  tmp_path_factory.mktemp("collect-now")) as proc:
        yield Target(proc, world.auth(), world)


@pytest.fixture(scope="module")
def hub_target(module_settings: Settings, world: World, tmp_path_factory: pytest.TempPathFactory) -> (
    Iterator[Target]
):
    with _running("dispatch-hub", service_env(module_settings), tmp_path_factory.mktemp("hub")) as proc:
        yield Target(proc, {"Authorization": f"Bearer {world.tenant['clients'][0]['token']}"}, world)


# The one refusal of a schema-valid collect-now that no schema can express: an Idempotency-Key whose first answer
# (a 2xx this test saw) was to another brand or body (hypothesis repeats simple keys). It is allowed only there; any
# other 4xx to a schema-valid request is a contract failure (a keyword, question or platform that is not there
# answers 404, which the check accepts).
_STORED_KEYS: dict[str, str] = {}


def _request_of(case: Case) -> str:
    return json.dumps([case.path_parameters, case.body], sort_keys=True, default=str)


def _accepts_valid_data(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    key = (case.headers or {}).get("Idempotency-Key")
    if isinstance(key, str):
        stored = _STORED_KEYS.get(key)
        if 200 <= response.status_code < 300:
            _STORED_KEYS.setdefault(key, _request_of(case))
        elif response.status_code == 422 and stored is not None and stored != _request_of(case):
            assert response.json()["error"] == "idempotency_key_reused", response.text
            return None
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result


def test_the_served_documents_are_these(collect_now_target: Target, hub_target: Target) -> None:
    """What each process serves is the document fuzzed here and the one committed under contracts/openapi/."""
    for target, document, committed in (
            (collect_now_target, collect_now_document(), "openapi/collect-now-api.json"),
            (hub_target, hub_document(), "openapi/dispatch-hub.json")):
        with urllib.request.urlopen(target.process.url + "/openapi.json", timeout=5) as resp:
            served = json.loads(resp.read())
        assert served == json.loads(json.dumps(document))
        assert served == json.loads((CONTRACTS_DIR / committed).read_text()), (
            f"contracts/{committed} is not what the service serves: run `make contracts`")


@COLLECT_NOW_SCHEMA.parametrize()
def test_collect_now_api_matches_its_openapi_document(case: Case, collect_now_target: Target,
                                                      summary: FuzzCounts) -> None:
    summary.count("collect-now-api", case)
    try:
        response = case.call_and_validate(
            base_url=collect_now_target.process.url, headers=collect_now_target.headers,
            excluded_checks=[positive_data_acceptance], additional_checks=[_accepts_valid_data])
        summary.answered("collect-now-api", case, response.status_code)
    except BaseException:
        summary.fail("collect-now-api", case)
        raise


# Checks that cannot hold for an operation by its nature (every other check runs on it).
_NOT_APPLICABLE: dict[str, list[Any]] = {
    # A plain HTTP request is no WebSocket handshake, so a schema-valid one is refused (400); the socket itself
    # is fuzzed in test_ws_fuzz.py.
    "/api/desktop/ws": [positive_data_acceptance],
    # Retired: 410 Gone is its only answer, for every method, including ones OpenAPI cannot list (QUERY), for which
    # a 405 would claim the resource still exists.
    "/api/desktop/events": [positive_data_acceptance, unsupported_method],
}


@HUB_SCHEMA.parametrize()
def test_dispatch_hub_matches_its_openapi_document(case: Case, hub_target: Target, summary: FuzzCounts) -> None:
    summary.count("dispatch-hub", case)
    try:
        response = case.call_and_validate(base_url=hub_target.process.url, headers=hub_target.headers,
                                          excluded_checks=_NOT_APPLICABLE.get(case.operation.path, []))
        summary.answered("dispatch-hub", case, response.status_code)
    except BaseException:
        summary.fail("dispatch-hub", case)
        raise


# ---- extend, cancel and result on real leases -------------------------------------------------------------

# Cases per operation on real leases: schema-valid ones (the success paths) and schema-invalid ones.
VALID_CASES = 50
INVALID_CASES = 10
REAL_LEASES = "dispatch-hub, real leases"
# Error codes that name the body field at fault whenever the body is a JSON object.
_FIELD_ERRORS = {"missing_field", "invalid_field", "unknown_type"}


@pytest.fixture(scope="module")
def real_leases(module_settings: Settings, world: World, hub_target: Target) -> Iterator[RealLeases]:
    leases = RealLeases(module_settings, hub_target.process.url, world.seed["tenants"][1], world.platform_ids)
    try:
        yield leases
    finally:
        leases.close()


def _error_names_the_problem(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx is a JSON error body with a code and a message; a field it names is one of the body's."""
    if not 400 <= response.status_code < 500:
        return None
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/problem+json"), f"{response.status_code} answered as {content_type!r}"
    error = msgspec.convert(response.json(), ErrorBody)
    assert error.error and error.message, f"{response.status_code} names no problem: {response.text}"
    fields = BODY_FIELDS[case.operation.path]
    if error.field is not None:
        assert re.split(r"[.\[ ]", error.field)[0] in fields, f"{error.field!r} is no field of the body"
    elif error.error in _FIELD_ERRORS:
        assert not isinstance(case.body, dict), f"{error.error} names no field: {response.text}"
    return None


def _invalid_by_its_body(case: Case) -> bool:
    body = case.meta.components.get(ParameterLocation.BODY) if case.meta is not None else None
    return body is not None and body.mode.is_negative


# Schema-valid and schema-invalid cases in separate seeded runs, so that each gets its share.
@pytest.mark.parametrize("valid", [True, False], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", [EXTEND, CANCEL, RESULT])
def test_task_calls_on_real_leases_match_the_openapi_document(path: str, valid: bool, real_leases: RealLeases,
                                                              summary: FuzzCounts) -> None:
    operation = HUB_SCHEMA[path]["POST"]
    cases = operation.as_strategy(GenerationMode.POSITIVE if valid else GenerationMode.NEGATIVE)
    if not valid:
        # Invalid by the body: the credentials and the task id are filled in, so a case invalid by those alone
        # would be a valid one.
        cases = cases.filter(_invalid_by_its_body)
    statuses: Counter[int] = Counter()

    def send(case: Case) -> Response:
        summary.count(REAL_LEASES, case)
        response = case.call_and_validate(base_url=real_leases.base_url, headers=real_leases.headers,
                                          additional_checks=[_error_names_the_problem])
        summary.answered(REAL_LEASES, case, response.status_code)
        statuses[response.status_code] += 1
        return response

    @hypothesis.seed(20260611)
    @hypothesis.settings(max_examples=VALID_CASES if valid else INVALID_CASES, database=None, deadline=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=cases)
    def one_case(case: Case) -> None:
        plan = plan_for(path, case)
        lease = real_leases.lease(generation=plan.initial_generation, interrupt=plan.interrupted)
        try:
            fill(case, plan, lease, headers=real_leases.headers, other_clients_task=real_leases.other_clients_task)
            expected = expected_answer(path, case, lease, max_body=real_leases.max_body)
            before = real_leases.state(lease.task_id)
            response = send(case)
            answer = response.json()
            if expected is not None:
                assert (response.status_code, answer.get("error")) == expected, (case, answer)
                check_answer(path, lease, response.status_code, answer)
            check_effect(path, response.status_code, case.body, before, real_leases.state(lease.task_id))
            if path == RESULT and response.status_code == 202 and plan.again != "none":
                # A lease takes one result: the same body again is answered as the first was, another is refused.
                if plan.again == "other":
                    case.body = {**case.body, "status": "failed" if case.body["status"] == "succeeded" else
                                 "succeeded"}
                again = send(case)
                if plan.again == "same":
                    assert (again.status_code, again.json()) == (202, answer)
                else:
                    assert (again.status_code, again.json()["error"]) == (409, "result_already_posted")
        except BaseException:
            summary.fail(REAL_LEASES, case)
            raise
        finally:
            real_leases.release(lease)

    one_case()
    assert real_leases.invariants() == []
    assert not any(status >= 500 for status in statuses), statuses
    if valid:  # the success paths were fuzzed, not only the refusals
        assert sum(n for status, n in statuses.items() if status < 300) >= VALID_CASES // 4, statuses
