"""schemathesis against the real collect-now-api and dispatch-hub processes: each served /openapi.json is exact.

Every operation gets examples, coverage cases (boundaries, missing and wrong-typed fields, undeclared methods) and
fuzzed cases in positive and negative modes, with every schemathesis check on: no 5xx, only declared statuses,
content types and headers, bodies that match their schemas, schema-valid requests accepted, invalid ones refused,
credentials not ignored, 405 with `Allow` for undeclared methods. The cases sent per operation are summed up at the
end of the pytest run.
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

import psycopg
import pytest
import schemathesis
from psycopg import sql
from psycopg.conninfo import make_conninfo
from schemathesis import Case, CheckContext, Response
from schemathesis.specs.openapi.checks import positive_data_acceptance, unsupported_method

from libs.config import Settings
from libs.db.pool import make_pool
from libs.mq.topology import Topology
from services.collect_now_api.openapi import openapi_document as collect_now_document
from services.dispatch_hub.openapi import openapi_document as hub_document
from tests.support.collect_now import JWT_SECRET, World, make_world
from tests.support.desktop import dispatch_execution
from tests.support.env import Backends
from tests.support.fuzz_report import error_lines, fuzz_report
from tests.support.procs import ServiceProcess, service_env

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


# Refusals no schema can express: the ids are well-formed but name nothing of this brand or tenant (the data
# decides, not the shape). Every other 400 to a schema-valid request is a contract failure.
_REFERENCE_FIELDS = {"keyword_id", "question_ids", "ai_platform_ids"}
_REFERENCE_MESSAGE = re.compile(r"does not belong to brand|are not enabled")


def _accepts_valid_data(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    if response.status_code == 400 and response.headers.get("content-type", [""])[0].startswith("application/json"):
        body = response.json()
        if body.get("field") in _REFERENCE_FIELDS and _REFERENCE_MESSAGE.search(body.get("message", "")):
            return None
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result


def test_the_served_documents_are_these(collect_now_target: Target, hub_target: Target) -> None:
    for target, document in ((collect_now_target, collect_now_document()), (hub_target, hub_document())):
        with urllib.request.urlopen(target.process.url + "/openapi.json", timeout=5) as resp:
            assert json.loads(resp.read()) == json.loads(json.dumps(document))


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
