"""Pieces both services' OpenAPI 3.1 documents share: schemas from msgspec contracts made exact, error answers,
and the operational routes every service serves (`libs.http.add_ops_routes`)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import inspect as mi

REF = "#/components/schemas/{name}"
PROBLEM_CONTENT_TYPE = "application/problem+json"
REQUEST_ID_HEADER = "X-Request-Id"
HEADER_REF = "#/components/headers/{name}"

ERROR_BODY = "ErrorBody"

# Why each status can be answered, unless an operation says more.
STATUS_TEXT: dict[int, str] = {
    400: "Malformed body, query or path parameter; `field` names the one at fault.",
    401: "Missing or invalid credentials.",
    404: "Not found.",
    405: "Method not allowed; the `Allow` header lists the methods the path takes.",
    409: "Conflict with the resource's current state.",
    410: "Gone.",
    413: "Body over the size limit.",
    415: "Body sent with a content type other than application/json.",
    422: "Well-formed but not processable.",
    429: "Rate limited; `retry_after_s` says when to try again.",
    500: "Unexpected error (logged server-side).",
    503: "Temporarily unavailable; retry.",
}


# What every document's `info.description` ends with: the error body, the request id and the 405 answer.
CONVENTIONS = ("Errors are RFC 9457 problems (`application/problem+json`, schema `ErrorBody`): `type`, `title`, "
               "`status`, `detail`, `instance`, plus the stable code `error` (what a client branches on), "
               "`message`, `field` when one field is at fault, `request_id` and `trace_id`. Every answer carries "
               "`X-Request-Id`: the caller's when it sent a well-formed one (1 to 128 of `A-Za-z0-9._:=-`, "
               "starting alphanumeric), else a new one. A method a path does not list answers 405 with an `Allow` "
               "header (`components.responses.MethodNotAllowed`).")


def document(*, title: str, version: str, description: str, schemas: dict[str, Any],
             security_schemes: dict[str, Any], paths: dict[str, Any],
             security: list[dict[str, list[str]]] | None = None) -> dict[str, Any]:
    """An OpenAPI 3.1 document: `version` is the API's (`info.version`), `description` is followed by
    `CONVENTIONS`; `security`, when given, is the default of every operation. Every answer of every operation
    declares the `X-Request-Id` header."""
    for item in paths.values():
        for operation in item.values():
            for answer in operation["responses"].values():
                answer.setdefault("headers", {})[REQUEST_ID_HEADER] = {"$ref": HEADER_REF.format(name="RequestId")}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": f"{description} {CONVENTIONS}"},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        # Each service serves its own API (and this document): paths are relative to wherever it is reached.
        "servers": [{"url": "/", "description": "the service that serves this document"}],
        "components": {
            "schemas": schemas,
            "responses": {"MethodNotAllowed": method_not_allowed()},
            "headers": {"RequestId": REQUEST_ID_HEADER_SCHEMA},
            "securitySchemes": security_schemes,
        },
    }
    if security is not None:
        doc["security"] = security
    doc["paths"] = paths
    return doc


REQUEST_ID_HEADER_SCHEMA: dict[str, Any] = {
    "required": True, "description": "this request's id: the caller's `X-Request-Id` when well-formed, else a new "
                                     "UUID; also `request_id` in a problem body and `http_request_id` in the logs",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:=-]{0,127}$"}}


def ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(name=name)}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def problem_content() -> dict[str, Any]:
    return {PROBLEM_CONTENT_TYPE: {"schema": ref(ERROR_BODY)}}


def response(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": json_content(ref(name))}


def request_body(name: str, *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": json_content(ref(name))}


def path_parameter(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def errors(*statuses: int, **descriptions: str) -> dict[str, Any]:
    """ErrorBody answers for `statuses`; `descriptions` (keyed `s404=...`) replace the generic text."""
    out: dict[str, Any] = {}
    for status in statuses:
        text = descriptions.get(f"s{status}", STATUS_TEXT[status])
        out[str(status)] = {"description": text, "content": problem_content()}
        if status in _RETRY_AFTER:
            out[str(status)]["headers"] = {"Retry-After": _RETRY_AFTER[status]}
    return out


# `libs.http.error_response` sets Retry-After from `retry_after_s`, which every 429 carries (and some 503s).
_RETRY_AFTER: dict[int, dict[str, Any]] = {
    409: {"required": False, "description": "seconds to wait, when a retry can succeed",
          "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    429: {"required": True, "description": "seconds to wait, as `retry_after_s`",
          "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    503: {"required": False, "description": "seconds to wait, when known",
          "schema": {"type": "string", "pattern": "^[0-9]+$"}},
}


def schema_components(types: tuple[Any, ...]) -> dict[str, Any]:
    """msgspec's JSON Schemas for `types` (and what they reference), with every `datetime` field marked
    `format: date-time`: these services only ever send times with an offset (from `timestamptz` or
    `datetime.now(UTC)`), and msgspec leaves the format out because a naive datetime would be allowed."""
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    for info in _struct_infos(types):
        schema = components.get(info.cls.__name__)
        if schema is None:
            continue
        for field in info.fields:
            if _is_datetime(field.type):
                _mark_date_time(schema["properties"][field.encode_name])
    return components


def _struct_infos(types: tuple[Any, ...]) -> list[mi.StructType]:
    found: dict[type, mi.StructType] = {}

    def walk(info: mi.Type) -> None:
        if isinstance(info, mi.StructType):
            if info.cls in found:
                return
            found[info.cls] = info
            for field in info.fields:
                walk(field.type)
        elif isinstance(info, mi.UnionType):
            for member in info.types:
                walk(member)
        elif isinstance(info, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
            walk(info.item_type)
        elif isinstance(info, mi.DictType):
            walk(info.value_type)

    for info in mi.multi_type_info(types):
        walk(info)
    return list(found.values())


def _is_datetime(info: mi.Type) -> bool:
    if isinstance(info, mi.DateTimeType):
        return True
    return isinstance(info, mi.UnionType) and any(isinstance(t, mi.DateTimeType) for t in info.types)


def _mark_date_time(schema: dict[str, Any]) -> None:
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string":
            branch["format"] = "date-time"


def method_not_allowed() -> dict[str, Any]:
    """`components.responses.MethodNotAllowed`: what any path answers for a method it does not list (an operation
    cannot declare it, as no listed method answers it)."""
    return {"description": STATUS_TEXT[405], "content": problem_content(),
            "headers": {"Allow": {"required": True, "description": "the methods the path takes",
                                  "schema": {"type": "string", "minLength": 1}},
                        REQUEST_ID_HEADER: {"$ref": HEADER_REF.format(name="RequestId")}}}


def _plain(description: str, schema: dict[str, Any], content_type: str = "application/json") -> dict[str, Any]:
    return {"description": description, "content": {content_type: {"schema": schema}}}


HEALTH_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
READY_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["status", "checks"],
    "properties": {
        "status": {"enum": ["ok", "unavailable"]},
        # Only "ok" or "failing": the reason is logged, never answered (it can name hosts or SQL).
        "checks": {"type": "object", "additionalProperties": {"enum": ["ok", "failing"]}},
    },
}


def ops_paths(ready_summary: str) -> dict[str, Any]:
    """`/openapi.json`, `/healthz`, `/readyz`, `/metrics`: open (no credentials), GET only."""
    unsecured: list[dict[str, list[str]]] = []
    return {
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document", "security": unsecured,
                                  "responses": {"200": _plain("OpenAPI 3.1 document", {"type": "object"})}}},
        "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness", "security": unsecured,
                             "responses": {"200": _plain("Alive", HEALTH_SCHEMA)}}},
        "/readyz": {"get": {"operationId": "readyz", "summary": ready_summary, "security": unsecured,
                            "responses": {"200": _plain("Ready: every check is ok", READY_SCHEMA),
                                          "503": _plain("Not ready: at least one check is failing", READY_SCHEMA)}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics", "security": unsecured,
                             "responses": {"200": _plain("Prometheus text exposition", {"type": "string"},
                                                         "text/plain")}}},
    }
