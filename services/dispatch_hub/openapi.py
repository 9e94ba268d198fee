"""OpenAPI 3.1 document of the desktop HTTP API, with schemas generated from the msgspec contracts (kept true by a
schemathesis run against the real process)."""

from __future__ import annotations

import functools
from typing import Any

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
from libs.openapi import errors, json_content, method_not_allowed, ops_paths, ref, response, schema_components

_SCHEMA_TYPES: tuple[Any, ...] = (
    LeaseRequest, LeaseResponse, ExtendRequest, ExtendResponse, CancelRequest, CancelResponse, ResultRequest,
    ResultResponse, ErrorBody, Hello, TaskAvailable, TaskControl, HeartbeatAck, ErrorEvent, Heartbeat,
)

_TEXT = {
    400: "Malformed body or parameter; `field` names the one at fault.",
    401: "Missing or unknown client token, or a disabled client (`client_disabled`).",
    404: "No such task for this client.",
    409: "The lease is no longer this token's (`stale_lease`).",
    503: "The broker did not confirm the result; retry.",
}


def _errors(*statuses: int, **descriptions: str) -> dict[str, Any]:
    """The statuses every desktop operation can answer (401, 500) plus `statuses`."""
    texts = {f"s{status}": text for status, text in _TEXT.items()}
    return errors(*sorted({401, 500, *statuses}), **{**texts, **descriptions})


def _body(name: str, *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": json_content(ref(name))}


_TASK_ID = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}
# The retired events endpoint answers 410 whatever the method.
_RETIRED_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


@functools.cache
def openapi_document() -> dict[str, Any]:
    components = schema_components(_SCHEMA_TYPES)
    security: list[dict[str, list[str]]] = [{"clientToken": []}]
    body_errors = (400, 413, 415)
    return {
        "openapi": "3.1.0",
        "info": {"title": "dispatch-hub desktop API", "version": "1.0.0",
                 "description": "Desktop gateway: WebSocket push plus pull-lease, extend, cancel and result. "
                                "Authenticated by a per-client token. Errors are `{\"error\", \"message\", "
                                "\"field\"}`. A method a path does not list answers 405 with an `Allow` header "
                                "(`components.responses.MethodNotAllowed`)."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": components,
            "responses": {"MethodNotAllowed": method_not_allowed()},
            "securitySchemes": {"clientToken": {"type": "http", "scheme": "bearer",
                                                "description": "the desktop client's token"}},
        },
        "security": security,
        "paths": {
            "/api/desktop/ws": {"get": {
                "operationId": "websocket",
                "summary": "WebSocket: server events `hello`, `task_available`, `task_control`, `heartbeat_ack`, "
                           "`error`; client messages `heartbeat` (text frames of at most 64 KiB; a larger frame "
                           "closes the socket with 1009). The handshake answers 101.",
                "responses": {"101": {"description": "Switching protocols"},
                              **_errors(400, 429, 503, s400="Not a WebSocket handshake (no `Upgrade: websocket`).",
                                        s429="Too many connection attempts from this address or client "
                                             "(`rate_limited`); `retry_after_s` says when to try again.",
                                        s503="This hub is shutting down; connect to another.")},
            }},
            "/api/desktop/monitor/lease": {"post": {
                "operationId": "leaseMonitorTasks",
                "summary": "Pull-lease the best queued tasks of this client (lane_weight, priority, enqueued_at)",
                "description": "One protocol for both execution paths: a task is either a desktop_tasks execution or "
                               "a lease of the legacy path on the business task (`execution_owner` in each leased "
                               "task). Extend, cancel and result are the same calls either way; `task_id` is opaque. "
                               "On the legacy path an interrupt is honoured only while the task is PREPARING or "
                               "NAVIGATING; past that the task runs to its result.",
                "requestBody": _body("LeaseRequest", required=False),
                "responses": {"200": response("LeaseResponse", "Leased tasks (empty when there is nothing)."),
                              **_errors(*body_errors, 404, s404="The client no longer exists.")},
            }},
            "/api/desktop/tasks/{task_id}/extend": {"post": {
                "operationId": "extendLease",
                "summary": "Extend the lease; may carry execution_phase and safe_point_interval_ms",
                "parameters": [_TASK_ID],
                "requestBody": _body("ExtendRequest"),
                "responses": {"200": response("ExtendResponse", "New expiry, plus any pending interrupt."),
                              **_errors(*body_errors, 404, 409)},
            }},
            "/api/desktop/tasks/{task_id}/cancel": {"post": {
                "operationId": "cancelTask",
                "summary": "Cancel / interrupt acknowledgement; stale generations are refused",
                "parameters": [_TASK_ID],
                "requestBody": _body("CancelRequest"),
                "responses": {"200": response("CancelResponse", "The execution was aborted."),
                              **_errors(*body_errors, 404, 409,
                                        s409="`stale_lease`; `stale_generation` with `current_generation` "
                                             "(the current interrupt is re-sent); or `no_interrupt_requested` "
                                             "(a preemption acknowledged where none was asked).")},
            }},
            "/api/desktop/tasks/{task_id}/result": {"post": {
                "operationId": "postResult",
                "summary": "Result callback; 202 only after the broker confirmed the message",
                "parameters": [_TASK_ID],
                "requestBody": _body("ResultRequest"),
                "responses": {"202": response("ResultResponse", "Queued for ingest."),
                              **_errors(*body_errors, 404, 409, 503,
                                        s404="No such task for this client, or its business task is gone.",
                                        s409="`stale_lease`, or `result_already_posted` (a different result on "
                                             "this lease; the same one again is accepted).")},
            }},
            "/api/desktop/events": {method: {
                "operationId": f"retiredEvents{method.capitalize()}",
                "summary": "Retired server-sent events endpoint",
                "security": [],
                "responses": {"410": response("ErrorBody", "Gone: use the WebSocket.")},
            } for method in _RETIRED_METHODS},
            **ops_paths("Readiness (Postgres reachable, broker connected)"),
        },
    }
