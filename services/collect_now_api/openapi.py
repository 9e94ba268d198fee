"""The OpenAPI 3.1 document of collect-now-api, generated from the msgspec contracts (kept true by tests and a
schemathesis run against the real process)."""

from __future__ import annotations

import functools
from typing import Any

from libs.contracts.http import CollectNowRequest, CollectNowResponse, CollectRequestStatus, ErrorBody
from libs.openapi import errors, json_content, method_not_allowed, ops_paths, ref, schema_components
from services.collect_now_api.handlers import CURSOR_PATTERN, DEFAULT_TASK_PAGE, MAX_ID, MAX_TASK_PAGE

COLLECT_NOW_PATH = "/api/tenant/monitoring/brands/{brand_id}/collect-now"
REQUEST_STATUS_PATH = "/api/tenant/monitoring/collect-requests/{request_id}"


@functools.cache
def openapi_document() -> dict[str, Any]:
    components = schema_components((CollectNowRequest, CollectNowResponse, CollectRequestStatus, ErrorBody))
    auth = errors(401, s401="Missing, malformed, expired or wrongly signed gateway token.")
    server = errors(500)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "collect-now-api",
            "version": "1.0.0",
            "description": "Tenant API for \"collect now\". Authenticated by the tenant-api gateway's JWT (claims "
                           "tenant_id, workspace_id, user_id, exp). Errors are `{\"error\", \"message\", \"field\"}`. "
                           "A method a path does not list answers 405 with an `Allow` header "
                           "(`components.responses.MethodNotAllowed`).",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": components,
            "responses": {"MethodNotAllowed": method_not_allowed()},
            "securitySchemes": {"gatewayJwt": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}},
        },
        "paths": {
            COLLECT_NOW_PATH: {
                "post": {
                    "operationId": "collectNow",
                    "summary": "Collect a brand's monitoring questions now, ahead of and preempting scheduled work",
                    "description": (
                        "Promotes the scope's business tasks (the brand's or keyword's questions x the tenant's "
                        "enabled platforms, today in the tenant's time zone) to the high lane on the chosen "
                        "desktop client, cancels that client's queued scheduled executions and asks its running "
                        "ones to yield. Idempotent per (user, brand, scope) within the idempotency window "
                        "(200 with idempotent_replay=true). A newer request for the same client supersedes the "
                        "older one. When no client is online the request is accepted unbound "
                        "(target_client_id null) and any client that connects before the TTL can take it. "
                        "A scope over the operator's limit (dispatch setting collect_now_max_scope_tasks, 500 by "
                        "default) is refused with 422 `scope_too_large`."),
                    "security": [{"gatewayJwt": []}],
                    "parameters": [{"name": "brand_id", "in": "path", "required": True,
                                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID}}],
                    "requestBody": {"required": False, "content": json_content(ref("CollectNowRequest"))},
                    "responses": {
                        "202": {"description": "Accepted: a new request.",
                                "content": json_content(ref("CollectNowResponse"))},
                        "200": {"description": "Idempotent replay of the same request made within the window.",
                                "content": json_content(ref("CollectNowResponse"))},
                        **errors(400, 404, 413, 415, 422, 429,
                                 s400="Malformed body or brand_id, or a keyword, question or platform that is not "
                                      "the brand's or the tenant's (`field` names it).",
                                 s404="The brand does not exist in the caller's tenant and workspace.",
                                 s422="Nothing to collect (`empty_scope`: no enabled questions or platforms), or "
                                      "too much (`scope_too_large`, with `scope_task_count` and "
                                      "`max_scope_tasks`).",
                                 s429="Rate limited: `too_many_active_requests` (active requests per tenant), "
                                      "`too_many_requests` (requests per user per hour) or `tenant_busy` (other "
                                      "clicks of the tenant still in flight); `retry_after_s` and the "
                                      "`Retry-After` header say when to try again."),
                        **auth, **server,
                    },
                },
            },
            REQUEST_STATUS_PATH: {
                "get": {
                    "operationId": "getCollectRequest",
                    "summary": "Progress of a collect-now request (for polling): preempted, started, first "
                               "dispatch and result, TTL remaining, and a page of its tasks",
                    "security": [{"gatewayJwt": []}],
                    "parameters": [
                        {"name": "request_id", "in": "path", "required": True,
                         "schema": {"type": "string", "format": "uuid"}},
                        {"name": "limit", "in": "query", "required": False,
                         "description": "Tasks per page.",
                         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TASK_PAGE,
                                    "default": DEFAULT_TASK_PAGE}},
                        {"name": "cursor", "in": "query", "required": False,
                         "description": "The previous page's `next_cursor`, unchanged (opaque).",
                         "schema": {"type": "string", "pattern": CURSOR_PATTERN}},
                    ],
                    "responses": {
                        "200": {"description": "The request's status; `next_cursor` is null on the last page.",
                                "content": json_content(ref("CollectRequestStatus"))},
                        **errors(400, 404, s400="request_id is not a UUID, or limit or cursor is invalid "
                                                "(`field` names it).",
                                 s404="No such request in the caller's tenant and workspace."),
                        **auth, **server,
                    },
                },
            },
            **ops_paths("Readiness (Postgres reachable)"),
        },
    }
