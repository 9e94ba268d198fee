"""collect-now's `Idempotency-Key` (docs/api.md, Idempotency): the first answer replayed byte for byte, the same key
with another request refused (422), a key in flight answered 409, keys scoped to their tenant and user, stored in
the click's own transaction, expired ones purged; and RFC 9457 problems with request ids on the way."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from typing import Any

from libs.config import Settings
from libs.db.pool import Conn
from services.collect_now_api.queries import TRY_LOCK_IDEMPOTENCY_KEY
from services.collect_now_api.service import purge_idempotency_keys
from tests.support.collect_now import api_client, fetch_all, fetch_one, make_world


def collect_path(brand_id: int | str) -> str:
    return f"/api/tenant/monitoring/brands/{brand_id}/collect-now"


async def post(http: Any, brand_id: int, headers: dict[str, str], key: str | None, body: dict[str, Any]) -> (
    tuple[int, bytes, Any]
):
    sent = {**headers, **({"Idempotency-Key": key} if key is not None else {})}
    resp = await http.post(collect_path(brand_id), json=body, headers=sent)
    return resp.status, await resp.read(), resp


async def request_count(conn: Conn) -> int:
    return int((await fetch_one(conn, "SELECT count(*) AS n FROM monitoring_collect_requests"))["n"])


async def test_the_first_answer_is_replayed_and_another_request_with_the_key_refused(settings: Settings,
                                                                                      pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, brands=2, questions=2, keywords_per_brand=2)
    brand = world.brand
    key = str(uuid.uuid4())
    async with api_client(settings) as http:
        keyword = {"keyword_id": brand["keyword_ids"][0]}
        status, first, resp = await post(http, world.brand_id, world.auth(), key, keyword)
        assert status == 202 and "Idempotent-Replayed" not in resp.headers
        # The same key and request, spelled differently: the first answer, status and bytes unchanged.
        again = await http.post(collect_path(world.brand_id), data=b'{ "keyword_id" : %d }' % brand["keyword_ids"][0],
                                headers={**world.auth(), "Idempotency-Key": key, "Content-Type": "application/json"})
        assert (again.status, await again.read()) == (202, first)
        assert again.headers["Idempotent-Replayed"] == "true"

        # The same key with another body, or at another brand: 422, and nothing written.
        for brand_id, body in ((world.brand_id, {"keyword_id": brand["keyword_ids"][1]}),
                               (world.tenant["brands"][1]["brand_id"], {"keyword_id": brand["keyword_ids"][0]})):
            status, _, resp = await post(http, brand_id, world.auth(), key, body)
            problem = await resp.json()
            assert (status, problem["error"], problem["field"]) == (422, "idempotency_key_reused", "Idempotency-Key")
            assert resp.content_type == "application/problem+json"
            assert problem["type"] == "urn:monitoring-dispatch:problem:idempotency_key_reused"
            assert problem["status"] == 422 and problem["detail"] == problem["message"]
            assert problem["request_id"] == resp.headers["X-Request-Id"]

        # Keys are the caller's: the same key from another user of the tenant, or from another tenant, is a new
        # request of theirs, never the first caller's answer.
        other_user_status, other_user, _ = await post(http, world.brand_id, world.auth(user_id=4242), key,
                                                      {"keyword_id": brand["keyword_ids"][0]})
        other_brand = world.seed["tenants"][1]["brands"][0]
        other_tenant_status, other_tenant, _ = await post(http, other_brand["brand_id"], world.auth(tenant_index=1),
                                                          key, {"keyword_id": other_brand["keyword_ids"][0]})
        assert other_user_status == other_tenant_status == 202
        ids = {json.loads(b)["request_id"] for b in (first, other_user, other_tenant)}
        assert len(ids) == 3

        # A key beside the implicit window: a request with a new key that the window finds answers the window's
        # replay (200), and that answer is what the key replays from then on.
        other_keyword = {"keyword_id": brand["keyword_ids"][1]}
        status, _, _ = await post(http, world.brand_id, world.auth(), None, other_keyword)
        assert status == 202
        second_key = str(uuid.uuid4())
        status, windowed, _ = await post(http, world.brand_id, world.auth(), second_key,
                                         {"keyword_id": brand["keyword_ids"][1]})
        assert status == 200 and b'"idempotent_replay":true' in windowed
        assert (await post(http, world.brand_id, world.auth(), second_key,
                           {"keyword_id": brand["keyword_ids"][1]}))[:2] == (200, windowed)

        # A malformed key is refused before anything happens.
        for bad in ("x" * 256, "key with spaces", "clé"):
            resp = await http.post(collect_path(world.brand_id), json={}, headers={**world.auth(),
                                                                                   "Idempotency-Key": bad})
            problem = await resp.json()
            assert (resp.status, problem["field"]) == (400, "Idempotency-Key"), bad
    async with pool.connection() as conn:
        assert await request_count(conn) == 4  # first, other user, other tenant, implicit
        # Each new request's key was written by the transaction that wrote the request: the same now() (the
        # transaction's start) stamped both rows. (A window replay's key names the request it replayed.)
        same_tx = await fetch_all(conn, "SELECT k.created_at = r.created_at AS same "
                                        "FROM collect_now_idempotency_keys k JOIN monitoring_collect_requests r "
                                        "ON r.id = k.collect_request_id WHERE k.response_status = 202")
        assert [row["same"] for row in same_tx] == [True, True, True]
        keys = await fetch_all(conn, "SELECT tenant_id, user_id, response_status FROM collect_now_idempotency_keys "
                                     "ORDER BY created_at")
        assert [(k["tenant_id"], k["response_status"]) for k in keys] == [
            (world.tenant_id, 202), (world.tenant_id, 202), (world.seed["tenants"][1]["tenant_id"], 202),
            (world.tenant_id, 200)]
        # Retention: an expired key is no longer replayed, and the purge deletes it.
        await conn.execute("UPDATE collect_now_idempotency_keys SET expires_at = now() - interval '1 second' "
                           "WHERE idempotency_key = %s AND user_id = %s", (second_key, world.tenant["user_id"]))
    assert await purge_idempotency_keys(pool, batch=1) == 1
    async with pool.connection() as conn:
        remaining = await fetch_all(conn, "SELECT idempotency_key FROM collect_now_idempotency_keys")
        assert second_key not in {r["idempotency_key"] for r in remaining} and len(remaining) == 3


async def test_a_refused_request_stores_no_key_and_its_retry_is_decided_afresh(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    key = str(uuid.uuid4())
    async with api_client(settings) as http:
        status, _, _ = await post(http, world.brand_id, world.auth(), key, {"question_ids": [999_999]})
        assert status == 404
        status, _, _ = await post(http, world.brand_id, world.auth(), key, {})  # another body: not "reused"
        assert status == 202
    async with pool.connection() as conn:
        assert await request_count(conn) == 1


async def test_a_key_in_flight_is_answered_409(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    key = str(uuid.uuid4())
    principal = world.principal()
    async with api_client(settings) as http, pool.connection() as holder:
        # Another request with this key is in its transaction: it holds the key's lock.
        async with holder.transaction():
            await holder.execute(TRY_LOCK_IDEMPOTENCY_KEY, {"tenant_id": principal.tenant_id,
                                                            "user_id": principal.user_id, "idempotency_key": key})
            status, _, resp = await post(http, world.brand_id, world.auth(), key, {})
            problem = await resp.json()
            assert (status, problem["error"], resp.headers["Retry-After"]) == (409, "idempotency_key_in_use", "1")
        status, _, _ = await post(http, world.brand_id, world.auth(), key, {})
        assert status == 202
    async with pool.connection() as conn:
        assert await request_count(conn) == 1


async def test_concurrent_requests_with_one_key_on_two_replicas_make_one_request(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=2)
    key = str(uuid.uuid4())
    # Two replicas (each its own pool and tenant gate), four requests each, all at once.
    roomy = replace(settings, collect_now_tenant_max_in_flight=4)
    async with api_client(roomy) as first, api_client(roomy) as second:
        answers = await asyncio.gather(*(post(http, world.brand_id, world.auth(), key, {})
                                         for _ in range(4) for http in (first, second)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {202, 409}, statuses
    accepted = {body for status, body, _ in answers if status == 202}
    assert len(accepted) == 1, accepted  # the winner's answer, and replays of exactly it
    print(f"\n8 concurrent requests with one key on two replicas: {statuses.count(202)} x 202 (1 new + replays), "
          f"{statuses.count(409)} x 409 idempotency_key_in_use")
    async with pool.connection() as conn:
        assert await request_count(conn) == 1
        assert len(await fetch_all(conn, "SELECT 1 FROM collect_now_idempotency_keys")) == 1
