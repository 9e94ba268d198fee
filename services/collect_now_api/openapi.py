"""The OpenAPI 3.1 document of collect-now-api, generated from the msgspec contracts (kept true by a test)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from libs.contracts.http import CollectNowRequest, CollectNowResponse, CollectRequestStatus, ErrorBody

COLLECT_NOW_PATH = "/api/tenant/monitoring/brands/{brand_id}/collect-now"
REQUEST_STATUS_PATH = "/api/tenant/monitoring/collect-requests/{request_id}"

_REF = "#/components/schemas/{name}"


def _json(schema_ref: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_REF.format(name="ErrorBody"), description)


def _plain(description: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"description": description, "content": {content_type: {"schema": {"type": "object"}
                                                                   if content_type == "application/json"
                                                                   else {"type": "string"}}}}


@functools.cache
def openapi_document() -> dict[str, Any]:
    (request_ref, response_ref, status_ref, _), components = msgspec.json.schema_components(
        [CollectNowRequest, CollectNowResponse, CollectRequestStatus, ErrorBody], ref_template=_REF)
    auth_errors = {
        "401": _error("Missing, malformed, expired or wrongly signed gateway token."),
        "500": _error("Unexpected error (logged)."),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "collect-now-api",
            "version": "1.0.0",
            "description": "Tenant API for \"collect now\" (seed §10, §13.1, §13.5). Authenticated by the "
                           "tenant-api gateway's JWT (claims tenant_id, workspace_id, user_id, exp). Errors are "
                           "`{\"error\", \"message\", \"field\"}`.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": components,
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
                        "(target_client_id null) and any client that connects before the TTL can take it."),
                    "security": [{"gatewayJwt": []}],
                    "parameters": [{"name": "brand_id", "in": "path", "required": True,
                                    "schema": {"type": "integer", "minimum": 1}}],
                    "requestBody": {"required": False,
                                    "content": {"application/json": {"schema": request_ref}}},
                    "responses": {
                        "202": {"description": "Accepted: a new request.",
                                "content": {"application/json": {"schema": response_ref}}},
                        "200": {"description": "Idempotent replay of the same request made within the window.",
                                "content": {"application/json": {"schema": response_ref}}},
                        "400": _error("Malformed body or a field that is invalid (`field` names it)."),
                        "404": _error("The brand does not exist in the caller's tenant and workspace."),
                        "413": _error("Body too large."),
                        "415": _error("Body is not application/json."),
                        "422": _error("Nothing to collect: no enabled questions or platforms in the scope."),
                        "429": _error("Rate limited: `too_many_active_requests` (active requests per tenant) or "
                                      "`too_many_requests` (requests per user per hour); `retry_after_s` says "
                                      "when to try again."),
                        **auth_errors,
                    },
                },
            },
            REQUEST_STATUS_PATH: {
                "get": {
                    "operationId": "getCollectRequest",
                    "summary": "Progress of a collect-now request (for polling): preempted, started, first "
                               "dispatch and result, TTL remaining, per-task status",
                    "security": [{"gatewayJwt": []}],
                    "parameters": [{"name": "request_id", "in": "path", "required": True,
                                    "schema": {"type": "string", "format": "uuid"}}],
                    "responses": {
                        "200": {"description": "The request's status.",
                                "content": {"application/json": {"schema": status_ref}}},
                        "400": _error("request_id is not a UUID."),
                        "404": _error("No such request in the caller's tenant."),
                        **auth_errors,
                    },
                },
            },
            "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                      "responses": {"200": _plain("OpenAPI 3.1 document")}}},
            "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness",
                                 "responses": {"200": _plain("Alive")}}},
            "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness (Postgres reachable)",
                                "responses": {"200": _plain("Ready"), "503": _plain("Not ready")}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": {"200": _plain("Prometheus text exposition", "text/plain")}}},
        },
    }
