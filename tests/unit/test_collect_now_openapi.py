"""The OpenAPI documents of collect-now-api and dispatch-hub are well-formed, their schemas are valid JSON Schema,
and they declare what the handlers take (pages, limits, date-times)."""

from __future__ import annotations

import re
from typing import Any

from jsonschema import Draft202012Validator

from libs.contracts.http import TENANT_API_VERSION
from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH, openapi_document
from services.dispatch_hub.openapi import openapi_document as hub_document

METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        found = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return found + [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


def test_document_is_openapi_3_1_shaped() -> None:
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1.")
    assert doc["info"]["title"] and doc["info"]["version"] == TENANT_API_VERSION != "1.0.0"
    header = next(p for p in doc["paths"][COLLECT_NOW_PATH]["post"]["parameters"] if p["in"] == "header")
    assert header["name"] == "Idempotency-Key" and header["required"] is False
    assert set(doc["paths"]) >= {COLLECT_NOW_PATH, REQUEST_STATUS_PATH}
    operation_ids = []
    for path, item in doc["paths"].items():
        assert path.startswith("/")
        for method, operation in item.items():
            assert method in METHODS
            operation_ids.append(operation["operationId"])
            assert operation["responses"], f"{method} {path} documents no response"
            for status, response in operation["responses"].items():
                assert status.isdigit() and response["description"]
            for parameter in operation.get("parameters", []):
                assert parameter["in"] in {"path", "query", "header", "cookie"}
                if parameter["in"] == "path":
                    assert parameter["required"] is True and "{" + parameter["name"] + "}" in path
    assert len(operation_ids) == len(set(operation_ids))
    for scheme in (s for op in (doc["paths"][COLLECT_NOW_PATH]["post"], doc["paths"][REQUEST_STATUS_PATH]["get"])
                   for req in op["security"] for s in req):
        assert scheme in doc["components"]["securitySchemes"]


def test_every_reference_resolves_and_every_schema_is_valid() -> None:
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    assert {"CollectNowRequest", "CollectNowResponse", "CollectRequestStatus", "ErrorBody"} <= set(schemas)
    for ref in _refs(doc):
        kind, name = ref.removeprefix("#/components/").split("/")
        assert name in doc["components"][kind], ref
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    for status in ("400", "401", "404", "409", "413", "422", "429"):
        response = doc["paths"][COLLECT_NOW_PATH]["post"]["responses"][status]
        problem = {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
        assert response["content"] == {"application/problem+json": problem}
    # Every answer of every operation declares its request id.
    for item in doc["paths"].values():
        for operation in item.values():
            for response in operation["responses"].values():
                assert response["headers"]["X-Request-Id"] == {"$ref": "#/components/headers/RequestId"}
    assert {"type", "title", "status", "detail"} <= set(schemas["ErrorBody"]["required"])


def _date_time_fields(schema: dict[str, Any]) -> set[str]:
    out = set()
    for name, prop in schema.get("properties", {}).items():
        if any(b.get("format") == "date-time" for b in prop.get("anyOf", [prop])):
            out.add(name)
    return out


def test_times_are_date_times_and_pages_and_limits_are_declared() -> None:
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    assert _date_time_fields(schemas["CollectRequestStatus"]) == {
        "first_dispatched_at", "first_result_at", "ttl_expires_at", "created_at", "updated_at"}
    assert _date_time_fields(schemas["CollectNowResponse"]) == {"ttl_expires_at"}
    assert "next_cursor" in schemas["CollectRequestStatus"]["properties"]
    assert {"scope_task_count", "max_scope_tasks"} <= set(schemas["ErrorBody"]["properties"])
    status = doc["paths"][REQUEST_STATUS_PATH]["get"]
    query = {p["name"]: p["schema"] for p in status["parameters"] if p["in"] == "query"}
    assert query["limit"] == {"type": "integer", "minimum": 1, "maximum": 500, "default": 100}
    assert re.fullmatch(query["cursor"]["pattern"].strip("^$"), str(2**63 - 1))
    assert "422" in doc["paths"][COLLECT_NOW_PATH]["post"]["responses"]
    brand_id = doc["paths"][COLLECT_NOW_PATH]["post"]["parameters"][0]["schema"]
    assert brand_id == {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
    allow = doc["components"]["responses"]["MethodNotAllowed"]["headers"]["Allow"]
    assert allow["required"] is True


def test_the_hub_document_is_as_well_formed() -> None:
    doc = hub_document()
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        kind, name = ref.removeprefix("#/components/").split("/")
        assert name in doc["components"][kind], ref
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert _date_time_fields(schemas["LeasedTask"]) == {"lease_expires_at"}
    for path in ("/api/desktop/monitor/lease", "/api/desktop/tasks/{task_id}/result"):
        assert {"400", "401", "413", "415", "500"} <= set(doc["paths"][path]["post"]["responses"])
    assert {"101", "400", "401", "429", "503"} <= set(doc["paths"]["/api/desktop/ws"]["get"]["responses"])
