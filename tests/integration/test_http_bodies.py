"""Request bodies are read whole, whatever the segmenting, and refused past the limit (also chunked ones).

A raw socket client sends the bytes so the test controls how the body is cut into TCP segments: aiohttp's
own client would send a small body in one write.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from libs.http import json_response, make_app, read_body

LIMIT = 4096


class Echo(msgspec.Struct):
    text: str


async def echo(request: web.Request) -> web.Response:
    body = await read_body(request, Echo, max_bytes=LIMIT)
    return json_response({"length": len(body.text)})


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = make_app(max_body_bytes=LIMIT)
    app.router.add_post("/echo", echo)
    async with TestServer(app) as srv:
        yield srv


async def send_raw(server: TestServer, head: bytes, pieces: list[bytes], gap_s: float = 0.05) -> tuple[int, bytes]:
    """Send the request head, then each piece of the body as its own write `gap_s` apart; the status and body."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(head)
        await writer.drain()
        for piece in pieces:
            await asyncio.sleep(gap_s)  # shapes the input into separate segments; nothing is waited for
            writer.write(piece)
            await writer.drain()
        # The server may answer before the body is complete (413): read the answer by its own length.
        response_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        lines = response_head.decode().split("\r\n")
        length = next(int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k.lower() == "content-length")
        answer = await asyncio.wait_for(reader.readexactly(length), timeout=10)
    finally:
        writer.close()
    return int(lines[0].split()[1]), answer


def head(server: TestServer, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /echo HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{framing}\r\n\r\n").encode()


def split(data: bytes, parts: int) -> list[bytes]:
    step = -(-len(data) // parts)
    return [data[i:i + step] for i in range(0, len(data), step)]


def chunked(pieces: list[bytes]) -> list[bytes]:
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces] + [b"0\r\n\r\n"]


async def test_a_body_sent_in_four_pieces_is_read_whole(server: TestServer) -> None:
    body = msgspec.json.encode({"text": "x" * 1000})
    status, answer = await send_raw(server, head(server, len(body)), split(body, 4))
    assert status == 200, answer
    assert msgspec.json.decode(answer) == {"length": 1000}


async def test_a_chunked_body_in_pieces_is_read_whole(server: TestServer) -> None:
    body = msgspec.json.encode({"text": "y" * 2000})
    status, answer = await send_raw(server, head(server, None), chunked(split(body, 5)))
    assert status == 200, answer
    assert msgspec.json.decode(answer) == {"length": 2000}


async def test_a_declared_length_over_the_limit_is_413(server: TestServer) -> None:
    status, answer = await send_raw(server, head(server, LIMIT + 1), [])
    assert status == 413
    assert msgspec.json.decode(answer)["error"] == "payload_too_large"


async def test_a_chunked_body_over_the_limit_is_413(server: TestServer) -> None:
    body = msgspec.json.encode({"text": "z" * (LIMIT + 10)})
    status, answer = await send_raw(server, head(server, None), chunked(split(body, 3)), gap_s=0.01)
    assert status == 413
    assert msgspec.json.decode(answer)["error"] == "payload_too_large"

