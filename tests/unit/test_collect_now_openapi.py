"""The OpenAPI document of collect-now-api is well-formed and its schemas are valid JSON Schema."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from services.collect_now_api.openapi import COLLECT_NOW_PATH, REQUEST_STATUS_PATH, openapi_document

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
    assert doc["info"]["title"] and doc["info"]["version"]
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
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    for status in ("400", "401", "404", "413", "429"):
        response = doc["paths"][COLLECT_NOW_PATH]["post"]["responses"][status]
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
