"""/openapi.json is kept true: every route of the app is documented, and real responses match the schemas."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from libs.config import Settings
from libs.dispatch_settings import set_setting
from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH
from tests.support.collect_now import api_client, make_world

DOC_URI = "urn:collect-now-api:openapi"


def validate(doc: dict[str, Any], path: str, method: str, status: int, body: Any) -> None:
    operation = doc["paths"][path][method]
    assert str(status) in operation["responses"], f"{method.upper()} {path} answered undocumented {status}"
    content = operation["responses"][str(status)]["content"]
    # Answers are JSON, errors RFC 9457 problems (the one content type each declares).
    expected = "application/problem+json" if status >= 400 else "application/json"
    assert set(content) == {expected}, content
    schema = content[expected]["schema"]
    registry: Registry[Any] = Registry().with_resource(DOC_URI, Resource.from_contents(
        doc, default_specification=DRAFT202012))
    ref = schema["$ref"] if "$ref" in schema else None
    root = {"$ref": DOC_URI + ref} if ref else schema
    Draft202012Validator(root, registry=registry).validate(body)


async def test_every_route_is_documented_and_real_responses_match(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, tenants=2, questions=2, keywords_per_brand=2)
        await set_setting(conn, "max_requests_per_user_per_hour", 3)
        await set_setting(conn, "collect_now_max_scope_tasks", 5)  # a keyword's 3 tasks fit, the brand's 6 do not
    brand = world.brand
    collect = COLLECT_NOW_PATH.replace("{brand_id}", str(world.brand_id))
    async with api_client(settings) as http:
        doc_resp = await http.get("/openapi.json")
        doc = await doc_resp.json()
        assert doc_resp.status == 200

        routes = {(r.resource.canonical, r.method.lower()) for r in http.app.router.routes()  # type: ignore[union-attr]
                  if r.method != "HEAD"}
        documented = {(path, method) for path, item in doc["paths"].items() for method in item}
        assert routes == documented

        seen: list[tuple[str, str, int, Any]] = []

        async def call(method: str, template: str, url: str, **kwargs: Any) -> Any:
            resp = await http.request(method, url, **kwargs)
            body = await resp.json()
            seen.append((template, method.lower(), resp.status, body))
            return body

        accepted = await call("POST", COLLECT_NOW_PATH, collect, json={"keyword_id": brand["keyword_ids"][0]},
                              headers=world.auth())
        await call("POST", COLLECT_NOW_PATH, collect, json={"keyword_id": brand["keyword_ids"][0]},
                   headers=world.auth())  # replay: 200
        await call("POST", COLLECT_NOW_PATH, collect, json={"keyword_id": "x"}, headers=world.auth())
        await call("POST", COLLECT_NOW_PATH, collect, json={})  # 401
        await call("POST", COLLECT_NOW_PATH, collect, json={}, headers=world.auth(tenant_index=1))  # 404
        await call("POST", COLLECT_NOW_PATH, collect, data=b"{" + b" " * 70_000 + b"}",
                   headers={**world.auth(), "Content-Type": "application/json"})  # 413
        await call("POST", COLLECT_NOW_PATH, collect, data=b"keyword_id=1",
                   headers={**world.auth(), "Content-Type": "application/x-www-form-urlencoded"})  # 415
        await call("POST", COLLECT_NOW_PATH, collect, json={"keyword_id": brand["keyword_ids"][1]},
                   headers=world.auth())
        await call("POST", COLLECT_NOW_PATH, collect, json={}, headers=world.auth())  # 422: 6 tasks, 5 at most
        await call("POST", COLLECT_NOW_PATH, collect, json={"question_ids": brand["question_ids"][:1]},
                   headers=world.auth())
        await call("POST", COLLECT_NOW_PATH, collect, json={"question_ids": brand["question_ids"][1:]},
                   headers=world.auth())  # 429: 3 per hour
        status_url = REQUEST_STATUS_PATH.replace("{request_id}", accepted["request_id"])
        await call("GET", REQUEST_STATUS_PATH, status_url, headers=world.auth())
        first_page = await call("GET", REQUEST_STATUS_PATH, status_url, params={"limit": "1"}, headers=world.auth())
        assert len(first_page["tasks"]) == 1 and first_page["next_cursor"] is not None
        await call("GET", REQUEST_STATUS_PATH, status_url, params={"cursor": first_page["next_cursor"]},
                   headers=world.auth())
        await call("GET", REQUEST_STATUS_PATH, status_url, params={"limit": "0"}, headers=world.auth())  # 400
        await call("GET", REQUEST_STATUS_PATH, status_url, params={"cursor": "x"}, headers=world.auth())  # 400
        await call("GET", REQUEST_STATUS_PATH, status_url, headers=world.auth(tenant_index=1))  # 404
        await call("GET", REQUEST_STATUS_PATH, REQUEST_STATUS_PATH.replace("{request_id}", "x"), headers=world.auth())
        await call("GET", REQUEST_STATUS_PATH, status_url)  # 401

    statuses = {(path, method, status) for path, method, status, _ in seen}
    assert statuses == {
        (COLLECT_NOW_PATH, "post", 202), (COLLECT_NOW_PATH, "post", 200), (COLLECT_NOW_PATH, "post", 400),
        (COLLECT_NOW_PATH, "post", 401), (COLLECT_NOW_PATH, "post", 404), (COLLECT_NOW_PATH, "post", 413),
        (COLLECT_NOW_PATH, "post", 415), (COLLECT_NOW_PATH, "post", 422), (COLLECT_NOW_PATH, "post", 429),
        (REQUEST_STATUS_PATH, "get", 200), (REQUEST_STATUS_PATH, "get", 404), (REQUEST_STATUS_PATH, "get", 400),
        (REQUEST_STATUS_PATH, "get", 401),
    }
    for path, method, status, body in seen:
        validate(doc, path, method, status, body)
    refused = {body["error"] for _, _, status, body in seen if status in (422, 429)}
    assert refused == {"scope_too_large", "too_many_requests"}
    # The validator is not vacuous: a response missing a required field is refused.
    broken = {k: v for k, v in seen[0][3].items() if k != "request_id"}
    try:
        validate(doc, COLLECT_NOW_PATH, "post", 202, broken)
    except Exception as exc:
        assert "request_id" in str(exc)
    else:
        raise AssertionError("a 202 body without request_id passed the schema")
