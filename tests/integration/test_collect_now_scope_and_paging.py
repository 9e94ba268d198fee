"""Collect-now's bounds: a request's status is its workspace's only, a scope over the operator's cap is refused
(422 `scope_too_large` with the count and the limit), and the status's task list comes a page at a time."""

from __future__ import annotations

from typing import Any

from libs.auth import TenantPrincipal
from libs.config import Settings
from libs.dispatch_settings import set_setting
from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH
from tests.support.collect_now import api_client, gateway_token, make_world


def collect_path(brand_id: int) -> str:
    return COLLECT_NOW_PATH.replace("{brand_id}", str(brand_id))


def status_path(request_id: str) -> str:
    return REQUEST_STATUS_PATH.replace("{request_id}", request_id)


def bearer(principal: TenantPrincipal) -> dict[str, str]:
    return {"Authorization": f"Bearer {gateway_token(principal)}"}


async def test_a_request_is_not_found_from_another_workspace_of_the_same_tenant(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    mine = world.principal()
    other_workspace = TenantPrincipal(mine.tenant_id, mine.workspace_id + 1000, mine.user_id)
    async with api_client(settings) as http:
        accepted = await (await http.post(collect_path(world.brand_id), json={}, headers=bearer(mine))).json()
        url = status_path(accepted["request_id"])
        assert (await http.get(url, headers=bearer(mine))).status == 200
        resp = await http.get(url, headers=bearer(other_workspace))
        body = await resp.json()
        assert (resp.status, body["error"]) == (404, "not_found") and "tasks" not in body
        # the brand, too, is its workspace's only
        foreign = await http.post(collect_path(world.brand_id), json={}, headers=bearer(other_workspace))
        assert foreign.status == 404


async def test_a_scope_over_the_cap_is_refused_with_the_count_and_the_limit(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=4)  # 4 questions x 3 platforms = 12 tasks
        await set_setting(conn, "collect_now_max_scope_tasks", 10)
    async with api_client(settings) as http:
        resp = await http.post(collect_path(world.brand_id), json={}, headers=world.auth())
        body = await resp.json()
        assert resp.status == 422 and body["error"] == "scope_too_large", body
        assert (body["scope_task_count"], body["max_scope_tasks"]) == (12, 10)
        assert "12" in body["message"] and "10" in body["message"]
        narrowed = await http.post(collect_path(world.brand_id), json={"question_ids": world.brand["question_ids"][:3]},
                                   headers=world.auth())
        assert narrowed.status == 202 and (await narrowed.json())["affected_task_count"] == 9
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) AS n FROM monitoring_collect_requests")
        assert (await cur.fetchone())["n"] == 1  # type: ignore[index]


async def test_the_task_list_comes_a_page_at_a_time(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=5)  # 15 tasks
    async with api_client(settings) as http:
        accepted = await (await http.post(collect_path(world.brand_id), json={}, headers=world.auth())).json()
        url = status_path(accepted["request_id"])
        whole = await (await http.get(url, headers=world.auth())).json()
        assert len(whole["tasks"]) == 15 and whole["next_cursor"] is None  # the default page (100) holds them all
        pages: list[list[dict[str, Any]]] = []
        cursor: str | None = None
        while True:
            params = {"limit": "4", **({"cursor": cursor} if cursor else {})}
            resp = await http.get(url, params=params, headers=world.auth())
            page = await resp.json()
            assert resp.status == 200, page
            pages.append(page["tasks"])
            assert page["requested_task_count"] == 15  # the request's own fields are on every page
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert [len(p) for p in pages] == [4, 4, 4, 3]
        assert [t["monitor_task_id"] for p in pages for t in p] == [t["monitor_task_id"] for t in whole["tasks"]]
        past_the_end = await (await http.get(url, params={"cursor": "9" * 19}, headers=world.auth())).json()
        assert past_the_end["tasks"] == [] and past_the_end["next_cursor"] is None
        for params, field in (({"limit": "0"}, "limit"), ({"limit": "501"}, "limit"), ({"limit": "ten"}, "limit"),
                              ({"limit": "-1"}, "limit"), ({"limit": "1.5"}, "limit"), ({"limit": ""}, "limit"),
                              ({"limit": " 4"}, "limit"), ({"cursor": "abc"}, "cursor"), ({"cursor": ""}, "cursor"),
                              ({"cursor": "-5"}, "cursor"), ({"cursor": "1" * 20}, "cursor")):
            resp = await http.get(url, params=params, headers=world.auth())
            body = await resp.json()
            assert (resp.status, body["error"], body["field"]) == (400, "invalid_field", field), (params, body)
        largest = await http.get(url, params={"limit": "500"}, headers=world.auth())
        assert largest.status == 200 and len((await largest.json())["tasks"]) == 15
