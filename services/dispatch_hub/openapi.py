"""OpenAPI 3.1 document of the desktop HTTP API, with schemas generated from the msgspec contracts."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from libs.contracts.http import (
    CancelRequest,
    CancelResponse,
    ErrorBody,
    ExtendRequest,
    ExtendResponse,
    LeaseRequest,
    LeaseResponse,
    ResultRequest,
    ResultResponse,
)
from libs.contracts.wire import ErrorEvent, Heartbeat, HeartbeatAck, Hello, TaskAvailable, TaskControl

_REF = "#/components/schemas/{name}"
_SCHEMA_TYPES: tuple[Any, ...] = (
    LeaseRequest, LeaseResponse, ExtendRequest, ExtendResponse, CancelRequest, CancelResponse, ResultRequest,
    ResultResponse, ErrorBody, Hello, TaskAvailable, TaskControl, HeartbeatAck, ErrorEvent, Heartbeat,
)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(name=name)}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "malformed body; `field` names the field at fault", 401: "missing or unknown client token",
            404: "no such task for this client", 409: "the lease is no longer this token's (`stale_lease`)",
            413: "body too large", 503: "the broker did not confirm; retry"}
    return {str(c): _json("ErrorBody", text[c]) for c in codes}


_TASK_ID = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}


@functools.cache
def openapi_document() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(_SCHEMA_TYPES, ref_template=_REF)
    security: list[dict[str, list[str]]] = [{"clientToken": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "dispatch-hub desktop API", "version": "1.0.0",
                 "description": "Desktop gateway: WebSocket push plus pull-lease, extend, cancel and result "
                                "(DESIGN.md §6). Authenticated by a per-client token."},
        "components": {
            "schemas": components,
            "securitySchemes": {"clientToken": {"type": "http", "scheme": "bearer",
                                                "description": "the desktop client's token"}},
        },
        "security": security,
        "paths": {
            "/api/desktop/ws": {"get": {
                "summary": "WebSocket: server events `hello`, `task_available`, `task_control`, `heartbeat_ack`, "
                           "`error`; client messages `heartbeat`. The handshake answers 101.",
                "responses": {"101": {"description": "switching protocols"}, **_errors(401)},
            }},
            "/api/desktop/monitor/lease": {"post": {
                "summary": "Pull-lease the best queued tasks of this client (lane_weight, priority, enqueued_at)",
                "requestBody": {"required": False, "content": {"application/json": {"schema": _ref("LeaseRequest")}}},
                "responses": {"200": _json("LeaseResponse", "leased tasks (empty when there is nothing)"),
                              **_errors(400, 401, 413)},
            }},
            "/api/desktop/tasks/{task_id}/extend": {"post": {
                "summary": "Extend the lease; may carry execution_phase and safe_point_interval_ms",
                "parameters": [_TASK_ID],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ExtendRequest")}}},
                "responses": {"200": _json("ExtendResponse", "new expiry, plus any pending interrupt"),
                              **_errors(400, 401, 404, 409, 413)},
            }},
            "/api/desktop/tasks/{task_id}/cancel": {"post": {
                "summary": "Cancel / interrupt acknowledgement (seed §13.4); stale generations are refused",
                "parameters": [_TASK_ID],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("CancelRequest")}}},
                "responses": {"200": _json("CancelResponse", "the execution was aborted"),
                              **_errors(400, 401, 404, 413),
                              "409": _json("ErrorBody", "`stale_lease`, or `stale_generation` with "
                                                        "`current_generation` (the current interrupt is re-sent)")},
            }},
            "/api/desktop/tasks/{task_id}/result": {"post": {
                "summary": "Result callback; 202 only after the broker confirmed the message",
                "parameters": [_TASK_ID],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ResultRequest")}}},
                "responses": {"202": _json("ResultResponse", "queued for ingest"),
                              **_errors(400, 401, 404, 409, 413, 503)},
            }},
            "/api/desktop/events": {"get": {
                "summary": "Retired server-sent events endpoint",
                "security": [],
                "responses": {"410": _json("ErrorBody", "gone: use the WebSocket")},
            }},
        },
    }
