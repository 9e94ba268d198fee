"""OpenAPI 3.1 document of the desktop HTTP API, with schemas generated from the msgspec contracts (kept true by a
schemathesis run against the real process)."""

from __future__ import annotations

import functools
from typing import Any

from libs.contracts.http import (
    DESKTOP_HTTP_API_VERSION,
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
from libs.openapi import document, errors, ops_paths, path_parameter, request_body, response, schema_components

_SCHEMA_TYPES: tuple[Any, ...] = (
    LeaseRequest, LeaseResponse, ExtendRequest, ExtendResponse, CancelRequest, CancelResponse, ResultRequest,
    ResultResponse, ErrorBody, Hello, TaskAvailable, TaskControl, HeartbeatAck, ErrorEvent, Heartbeat,
)

_TEXT = {
    400: "Malformed body or parameter; `field` names the one at fault.",
    401: "Missing or unknown client token, or a disabled client (`client_disabled`).",
    404: "No such task for this client.",
    409: "The lease is no longer this token's (`stale_lease`).",
    503: "The database was busy (`busy`) or could not be reached (`database_unavailable`), or (a result) the broker "
         "did not confirm it (`broker_unavailable`); retry after Retry-After.",
}


def _errors(*statuses: int, **descriptions: str) -> dict[str, Any]:
    """The statuses every desktop operation can answer (401, 500, 503: the database busy or unreachable) plus
    `statuses`."""
    texts = {f"s{status}": text for status, text in _TEXT.items()}
    return errors(*sorted({401, 500, 503, *statuses}), **{**texts, **descriptions})


_TASK_ID = path_parameter("task_id", {"type": "string", "format": "uuid"})
# The retired events endpoint answers 410 whatever the method.
_RETIRED_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


@functools.cache
def openapi_document() -> dict[str, Any]:
    return document(
        title="dispatch-hub desktop API",
        version=DESKTOP_HTTP_API_VERSION,
        description="Desktop gateway: WebSocket push plus pull-lease, extend, cancel and result. "
                    "Authenticated by a per-client token.",
        schemas=schema_components(_SCHEMA_TYPES),
        security_schemes={"clientToken": {"type": "http", "scheme": "bearer",
                                          "description": "the desktop client's token"}},
        security=[{"clientToken": []}],
        paths={
            "/api/desktop/ws": {"get": _websocket_operation()},
            "/api/desktop/monitor/lease": {"post": _lease_operation()},
            "/api/desktop/tasks/{task_id}/extend": {"post": _extend_operation()},
            "/api/desktop/tasks/{task_id}/cancel": {"post": _cancel_operation()},
            "/api/desktop/tasks/{task_id}/result": {"post": _result_operation()},
            "/api/desktop/events": _retired_events_path(),
            **ops_paths("Readiness (Postgres reachable, broker connected)"),
        },
    )


# What any operation with a JSON body can answer besides its own statuses.
_BODY_ERRORS = (400, 413, 415)


def _websocket_operation() -> dict[str, Any]:
    return {
        "operationId": "websocket",
        "summary": "WebSocket: server events `hello`, `task_available`, `task_control`, `heartbeat_ack`, "
                   "`error`; client messages `heartbeat` (text frames of at most 64 KiB; a larger one up to "
                   "256 KiB is answered by an `error` event `frame_too_large`, one over 256 KiB closes the "
                   "socket with 1009). The handshake answers 101.",
        "responses": {"101": {"description": "Switching protocols"},
                      **_errors(400, 429, 503, s400="Not a WebSocket handshake (no `Upgrade: websocket`), or "
                                     "`unsupported_protocol_version`: the `Sec-WebSocket-Protocol` offers name no "
                                     "protocol major this hub serves (docs/desktop-protocol.md).",
                                s429="Too many connection attempts from this address or client "
                                     "(`rate_limited`); `retry_after_s` says when to try again.",
                                s503="This hub is shutting down; connect to another.")},
    }


def _lease_operation() -> dict[str, Any]:
    return {
        "operationId": "leaseMonitorTasks",
        "summary": "Pull-lease the best queued tasks of this client (lane_weight, priority, enqueued_at)",
        "description": "One protocol for both execution paths: a task is either a desktop_tasks execution or "
                       "a lease of the legacy path on the business task (`execution_owner` in each leased "
                       "task). Extend, cancel and result are the same calls either way; `task_id` is opaque. "
                       "On the legacy path an interrupt is honoured only while the task is PREPARING or "
                       "NAVIGATING; past that the task runs to its result.",
        "requestBody": request_body("LeaseRequest", required=False),
        "responses": {"200": response("LeaseResponse", "Leased tasks (empty when there is nothing)."),
                      **_errors(*_BODY_ERRORS, 404, s404="The client no longer exists.")},
    }


def _task_operation(operation_id: str, summary: str, body: str, responses: dict[str, Any]) -> dict[str, Any]:
    """A call on one leased task (`/api/desktop/tasks/{task_id}/...`) with a required JSON body."""
    return {"operationId": operation_id, "summary": summary, "parameters": [_TASK_ID],
            "requestBody": request_body(body), "responses": responses}


def _extend_operation() -> dict[str, Any]:
    return _task_operation(
        "extendLease", "Extend the lease; may carry execution_phase and safe_point_interval_ms", "ExtendRequest",
        {"200": response("ExtendResponse", "New expiry, plus any pending interrupt."),
         **_errors(*_BODY_ERRORS, 404, 409)})


def _cancel_operation() -> dict[str, Any]:
    return _task_operation(
        "cancelTask", "Cancel / interrupt acknowledgement; stale generations are refused", "CancelRequest",
        {"200": response("CancelResponse", "The execution was aborted."),
         **_errors(*_BODY_ERRORS, 404, 409,
                   s409="`stale_lease`; `stale_generation` with `current_generation` "
                        "(the current interrupt is re-sent); or `no_interrupt_requested` "
                        "(a preemption acknowledged where none was asked).")})


def _result_operation() -> dict[str, Any]:
    return _task_operation(
        "postResult", "Result callback; 202 only after the broker confirmed the message", "ResultRequest",
        {"202": response("ResultResponse", "Queued for ingest."),
         **_errors(*_BODY_ERRORS, 404, 409, 503,
                   s404="No such task for this client, or its business task is gone.",
                   s409="`stale_lease`, or `result_already_posted` (a different result on "
                        "this lease; the same one again is accepted).")})


def _retired_events_path() -> dict[str, Any]:
    """The retired server-sent events endpoint: 410 for every method, without credentials."""
    return {method: {
        "operationId": f"retiredEvents{method.capitalize()}",
        "summary": "Retired server-sent events endpoint",
        "security": [],
        "responses": errors(410, s410="Gone: use the WebSocket."),
    } for method in _RETIRED_METHODS}
