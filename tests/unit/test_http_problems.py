"""Every HTTP API's error answers are RFC 9457 problems that keep the old `error` code, and every answer carries a
request id (the caller's well-formed one, else a new one) that the logs and the problem name too."""

from __future__ import annotations

import json
import logging
import uuid

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from libs.contracts.http import ErrorBody
from libs.http import ApiError, json_response, make_app
from libs.telemetry.logging import JsonFormatter

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _app() -> web.Application:
    app = make_app()
    log = logging.getLogger("test.handler")

    async def refuse(_: web.Request) -> web.Response:
        log.info("refusing")
        raise ApiError(429, "too_many_requests", "slow down", "user_id", retry_after_s=3)

    async def fine(_: web.Request) -> web.Response:
        return json_response({"ok": True})

    app.router.add_get("/refuse", refuse)
    app.router.add_get("/fine", fine)
    return app


async def test_a_problem_keeps_the_error_code_and_names_the_request_and_trace() -> None:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.get("/refuse", headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
        assert resp.status == 429 and resp.content_type == "application/problem+json"
        problem = await resp.json()  # aiohttp's json() reads +json types, as clients reading `error` do
    assert problem == {
        "type": "urn:monitoring-dispatch:problem:too_many_requests", "title": "Too many requests", "status": 429,
        "detail": "slow down", "instance": f"urn:monitoring-dispatch:request:{resp.headers['X-Request-Id']}",
        "request_id": resp.headers["X-Request-Id"], "trace_id": TRACE_ID,
        "error": "too_many_requests", "message": "slow down", "field": "user_id", "retry_after_s": 3}
    assert resp.headers["Retry-After"] == "3"
    assert msgspec.convert(problem, ErrorBody).status == 429


async def test_router_answers_are_problems_too() -> None:
    async with TestClient(TestServer(_app())) as client:
        missing = await client.get("/nowhere")
        wrong_method = await client.post("/fine")
        for resp, status, code in ((missing, 404, "not_found"), (wrong_method, 405, "method_not_allowed")):
            problem = await resp.json()
            assert (resp.status, resp.content_type, problem["error"], problem["status"]) == (
                status, "application/problem+json", code, status)
            assert problem["request_id"] == resp.headers["X-Request-Id"]
            assert "trace_id" not in problem  # no trace: the member is left out, never made up
        assert wrong_method.headers["Allow"]


@pytest.mark.parametrize("sent,kept", [
    ("4f1c2b7e-2f0a-4a4e-9d6b-2d1c4a0f9e11", True),
    ("01HZX3Q9M8K2V7T4R6P5N1B0C9", True),
    ("Root=1-67891233-abcdef012345678912345678", True),
    ("", False),
    ("x" * 129, False),
    ("has space", False),
    ("line\\nbreak", False),
    ("-starts-with-a-dash", False),
    ("naïve", False),
], ids=["uuid", "ulid", "dotted", "empty", "too-long", "space", "escape", "dash", "non-ascii"])
async def test_a_well_formed_request_id_is_kept_and_any_other_replaced(sent: str, kept: bool) -> None:
    async with TestClient(TestServer(_app())) as client:
        headers = {"X-Request-Id": sent} if sent.isascii() else {}
        resp = await client.get("/fine", headers=headers)
        assert resp.status == 200
    if kept:
        assert resp.headers["X-Request-Id"] == sent
    else:
        assert resp.headers["X-Request-Id"] != sent
        uuid.UUID(resp.headers["X-Request-Id"])


async def test_the_request_id_is_in_every_log_line_of_the_request(caplog: pytest.LogCaptureFixture) -> None:
    formatter = JsonFormatter("test")
    with caplog.at_level(logging.INFO):
        async with TestClient(TestServer(_app())) as client:
            resp = await client.get("/refuse", headers={"X-Request-Id": "gw-42"})
    lines = [json.loads(formatter.format(r)) for r in caplog.records if r.name in ("test.handler", "http")]
    assert {line["event"] for line in lines} == {"refusing", "http.problem"}
    assert {line["http_request_id"] for line in lines} == {"gw-42"} == {resp.headers["X-Request-Id"]}
    outside = json.loads(formatter.format(logging.LogRecord("x", logging.INFO, "", 0, "after", None, None)))
    assert "http_request_id" not in outside
