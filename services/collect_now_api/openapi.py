"""The OpenAPI 3.1 document of collect-now-api, generated from the msgspec contracts (kept true by tests and a
schemathesis run against the real process)."""

from __future__ import annotations

import functools
from typing import Any

from libs.contracts.http import (
    TENANT_API_VERSION,
    CollectNowRequest,
    CollectNowResponse,
    CollectRequestStatus,
    ErrorBody,
)
from libs.openapi import document, errors, ops_paths, path_parameter, request_body, response, schema_components
from services.collect_now_api.handlers import (
    CURSOR_PATTERN,
    DEFAULT_TASK_PAGE,
    IDEMPOTENCY_KEY_HEADER,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_ID,
    MAX_TASK_PAGE,
)

COLLECT_NOW_PATH = "/api/tenant/monitoring/brands/{brand_id}/collect-now"
REQUEST_STATUS_PATH = "/api/tenant/monitoring/collect-requests/{request_id}"


@functools.cache
def openapi_document() -> dict[str, Any]:
    return document(
        title="collect-now-api",
        version=TENANT_API_VERSION,
        description="Tenant API for \"collect now\". Authenticated by the tenant-api gateway's JWT (claims "
                    "tenant_id, workspace_id, user_id, exp).",
        schemas=schema_components((CollectNowRequest, CollectNowResponse, CollectRequestStatus, ErrorBody)),
        security_schemes={"gatewayJwt": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}},
        paths={
            COLLECT_NOW_PATH: {"post": _collect_now_operation()},
            REQUEST_STATUS_PATH: {"get": _request_status_operation()},
            **ops_paths("Readiness (Postgres reachable)"),
        },
    )


def _auth_and_server_errors() -> dict[str, Any]:
    """The answers every tenant operation can give: 401 (the gateway token), 500, and 503 (the database busy or
    unreachable: `busy`, `database_unavailable`; retry after Retry-After)."""
    return {**errors(401, s401="Missing, malformed, expired or wrongly signed gateway token."), **errors(500),
            **errors(503, s503="The database was busy (`busy`) or could not be reached (`database_unavailable`); "
                               "nothing was applied that a retry would repeat: retry after Retry-After.")}


def _collect_now_operation() -> dict[str, Any]:
    """POST collect-now: promote a brand's (or keyword's) questions to the high lane."""
    return {
        "operationId": "collectNow",
        "summary": "Collect a brand's monitoring questions now, ahead of and preempting scheduled work",
        "description": (
            "Promotes the scope's business tasks (the brand's or keyword's questions x the tenant's "
            "enabled platforms, today in the tenant's time zone) to the high lane on the chosen "
            "desktop client, cancels that client's queued scheduled executions and asks its running "
            "ones to yield. Idempotent per (user, brand, scope) within the idempotency window "
            "(200 with idempotent_replay=true), and per `Idempotency-Key` for the key's retention (24 h by "
            "default): the same key of the same user answers the first answer again, status and body unchanged, "
            "with `Idempotent-Replayed: true`; the same key with another brand or body is refused (422 "
            "`idempotency_key_reused`), and while the key's first request is still in flight a second one is "
            "answered 409 `idempotency_key_in_use` (retry to get the answer). A newer request for the same "
            "client supersedes the "
            "older one. When no client is online the request is accepted unbound "
            "(target_client_id null) and any client that connects before the TTL can take it. "
            "A scope over the operator's limit (dispatch setting collect_now_max_scope_tasks, 500 by "
            "default) is refused with 422 `scope_too_large`."),
        "security": [{"gatewayJwt": []}],
        "parameters": [path_parameter("brand_id", {"type": "integer", "minimum": 1, "maximum": MAX_ID}),
                       {"name": IDEMPOTENCY_KEY_HEADER, "in": "header", "required": False,
                        "description": "A key of the caller's choosing (a UUID) that makes retries of this request "
                                       "safe: the first answer to it is replayed.",
                        "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY_PATTERN}}],
        "requestBody": request_body("CollectNowRequest", required=False),
        "responses": {
            "202": _with_replayed_header(response("CollectNowResponse", "Accepted: a new request (or, with "
                                                  "`Idempotent-Replayed: true`, an Idempotency-Key's first answer).")),
            "200": _with_replayed_header(response("CollectNowResponse", "Idempotent replay of the same request made "
                                                  "within the window.")),
            **_collect_now_errors(),
            **_auth_and_server_errors(),
        },
    }


def _with_replayed_header(answer: dict[str, Any]) -> dict[str, Any]:
    answer["headers"] = {"Idempotent-Replayed": {
        "required": False, "description": "`true` on an Idempotency-Key's replay", "schema": {"const": "true"}}}
    return answer


def _collect_now_errors() -> dict[str, Any]:
    return errors(400, 404, 409, 413, 415, 422, 429,
                  s400="Malformed body, brand_id or Idempotency-Key (`field` names it).",
                  s404="`not_found`: the brand does not exist in the caller's tenant and workspace, or the body "
                       "names a keyword, question or platform that is not the brand's or not enabled for the "
                       "tenant (`field` names it).",
                  s409="`idempotency_key_in_use`: another request with this Idempotency-Key is still in flight; "
                       "retry after Retry-After to get its answer.",
                  s422="Nothing to collect (`empty_scope`: no enabled questions or platforms), too much "
                       "(`scope_too_large`, with `scope_task_count` and `max_scope_tasks`), or an "
                       "Idempotency-Key already used for another request (`idempotency_key_reused`).",
                  s429="Rate limited: `too_many_active_requests` (active requests per tenant), "
                       "`too_many_requests` (requests per user per hour) or `tenant_busy` (other "
                       "clicks of the tenant still in flight); `retry_after_s` and the "
                       "`Retry-After` header say when to try again.")


def _request_status_operation() -> dict[str, Any]:
    """GET a collect-now request: its progress and a page of its tasks."""
    return {
        "operationId": "getCollectRequest",
        "summary": "Progress of a collect-now request (for polling): preempted, started, first "
                   "dispatch and result, TTL remaining, and a page of its tasks",
        "security": [{"gatewayJwt": []}],
        "parameters": [
            path_parameter("request_id", {"type": "string", "format": "uuid"}),
            {"name": "limit", "in": "query", "required": False,
             "description": "Tasks per page.",
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TASK_PAGE, "default": DEFAULT_TASK_PAGE}},
            {"name": "cursor", "in": "query", "required": False,
             "description": "The previous page's `next_cursor`, unchanged (opaque).",
             "schema": {"type": "string", "pattern": CURSOR_PATTERN}},
        ],
        "responses": {
            "200": response("CollectRequestStatus", "The request's status; `next_cursor` is null on the last page."),
            **errors(400, 404, s400="request_id is not a UUID, or limit or cursor is invalid (`field` names it).",
                     s404="No such request in the caller's tenant and workspace."),
            **_auth_and_server_errors(),
        },
    }
