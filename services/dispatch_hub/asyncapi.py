"""AsyncAPI 3.0 document of the desktop WebSocket (`GET /api/desktop/ws`), generated from the msgspec contracts as the
OpenAPI documents are: every server and client message, the upgrade (headers, subprotocol, refusals), close codes,
heartbeat and replay rules. Committed as `contracts/asyncapi/desktop.json` (docs/desktop-protocol.md says it in
prose); `python -m services.dispatch_hub.asyncapi` writes it again, `--check` fails when the committed one differs.

The desktop HTTP bodies a socket client sends and reads (lease, extend, cancel, result) ride along in
`components.schemas`, so a client generates all its types from this one file (sdk/typescript does); the hub's
OpenAPI document stays the authority on those calls."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.config import Settings
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
from libs.contracts.wire import (
    CAPABILITIES_HEADER,
    CAPABILITIES_QUERY,
    FIELDS_SINCE,
    HUB_DRAINING_CLOSE,
    PROTOCOL_VERSION,
    PUSH_LEASE,
    SUPPORTED_MAJORS,
    ErrorEvent,
    Heartbeat,
    HeartbeatAck,
    Hello,
    TaskAvailable,
    TaskControl,
    subprotocol,
)
from libs.openapi import schema_components
from services.dispatch_hub.connections import TOO_SLOW_CLOSE
from services.dispatch_hub.gateway import (
    CLIENT_DISABLED_CLOSE,
    GOING_AWAY,
    HEARTBEAT_TIMEOUT_CLOSE,
    REPLACED_CLOSE,
    REPLAY_LIMIT,
    TOKEN_ROTATED_CLOSE,
)
from services.dispatch_hub.http_api import MAX_WS_FRAME, MAX_WS_MESSAGE

COMMITTED = Path(__file__).resolve().parents[2] / "contracts" / "asyncapi" / "desktop.json"

SERVER_MESSAGES: tuple[type, ...] = (Hello, TaskAvailable, TaskControl, HeartbeatAck, ErrorEvent)
CLIENT_MESSAGES: tuple[type, ...] = (Heartbeat,)
HTTP_BODIES: tuple[type, ...] = (LeaseRequest, LeaseResponse, ExtendRequest, ExtendResponse, CancelRequest,
                                 CancelResponse, ResultRequest, ResultResponse, ErrorBody)


@dataclass(frozen=True, slots=True)
class CloseCode:
    code: int
    name: str
    meaning: str
    client_action: str
    reconnect: bool


# Every code a socket of this hub can end with, and what a client does about it (docs/desktop-protocol.md).
CLOSE_CODES: tuple[CloseCode, ...] = (
    CloseCode(1000, "normal", "closed normally (by the client, or the hub answering a client's close)",
              "nothing; connect again when there is a reason to", True),
    CloseCode(GOING_AWAY, "going_away", "the hub is shutting down (a deploy, a scale-in)",
              "reconnect at once to any hub (the first attempt without delay, then backoff)", True),
    CloseCode(1002, "protocol_error", "a frame broke RFC 6455", "fix the client; reconnect with backoff", True),
    CloseCode(1003, "unsupported_data", "a frame type the hub does not take", "fix the client; reconnect with backoff",
              True),
    CloseCode(1006, "dropped", "no close frame: the connection was lost", "reconnect with backoff", True),
    CloseCode(1007, "invalid_payload", "a text frame that is not UTF-8", "fix the client; reconnect with backoff",
              True),
    CloseCode(1008, "policy_violation", "a frame the hub refused by policy", "fix the client; reconnect with backoff",
              True),
    CloseCode(1009, "message_too_big", f"a frame over {MAX_WS_FRAME // 1024} KiB, the transport cap (a message over "
              f"{MAX_WS_MESSAGE // 1024} KiB within the cap gets an `error` event `frame_too_large` instead)",
              "fix the client; reconnect with backoff", True),
    CloseCode(1010, "mandatory_extension", "the client required an extension the hub does not negotiate",
              "fix the client", False),
    CloseCode(1011, "internal_error", "the hub failed unexpectedly", "reconnect with backoff", True),
    CloseCode(TOO_SLOW_CLOSE, "too_slow", "the client read too slowly and its outbound queue overflowed",
              "reconnect with backoff; the replay resends what is queued", True),
    CloseCode(TOKEN_ROTATED_CLOSE, "token_rotated", "the client's token was rotated",
              "stop; re-provision the new token (reconnecting with the old one is refused with 401)", False),
    CloseCode(CLIENT_DISABLED_CLOSE, "client_disabled", "an operator disabled the client",
              "stop; do not reconnect", False),
    CloseCode(HEARTBEAT_TIMEOUT_CLOSE, "heartbeat_timeout", "no heartbeat, ping or pong within the hub's timeout",
              "reconnect with backoff; heartbeat at the hello's interval", True),
    CloseCode(REPLACED_CLOSE, "replaced", "a newer socket with the same token replaced this one",
              "stop: two processes share one token", False),
    CloseCode(HUB_DRAINING_CLOSE, "draining", "the hub is draining (SIGTERM: a rolling restart, a scale-in); "
              "its reason reads `draining; reconnect after <N> ms`, N drawn per socket from 0 to "
              "HUB_DRAIN_RECONNECT_SPREAD_MS",
              "wait N ms, then reconnect to any hub (backoff after that); the replay carries what was dispatched "
              "meanwhile", True),
)

# Answers to the upgrade other than 101 (a JSON error body, `error` as named here).
HANDSHAKE_REFUSALS: tuple[tuple[int, str, str, str], ...] = (
    (400, "unsupported_protocol_version", "the offered subprotocols name no major this hub serves",
     "offer a served major (the message lists them) or upgrade the client; do not retry unchanged"),
    (400, "http_error", "not a WebSocket handshake", "fix the client"),
    (401, "unauthorized", "missing, unknown or rotated token", "stop; re-provision the token"),
    (401, "client_disabled", "an operator disabled the client", "stop"),
    (429, "rate_limited", "too many upgrades from this address or client", "wait Retry-After seconds, then retry"),
    (503, "shutting_down", "this hub is shutting down", "reconnect (to another hub) with backoff"),
)


def asyncapi_document(settings: Settings | None = None) -> dict[str, Any]:
    """The whole document; defaults (heartbeat interval and timeout) from `settings` (the built-in defaults when
    None, which is what is committed)."""
    settings = settings or Settings()
    schemas = _schemas()
    server_names = [cls.__name__ for cls in SERVER_MESSAGES]
    client_names = [cls.__name__ for cls in CLIENT_MESSAGES]
    messages = {name: _message(name, schemas[name]) for name in (*server_names, *client_names)}
    channel_messages = {name: {"$ref": f"#/components/messages/{name}"} for name in messages}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "dispatch-hub desktop protocol",
            "version": f"{PROTOCOL_VERSION}.0",
            "description": _INFO,
            "x-protocol-version": PROTOCOL_VERSION,
            "x-supported-majors": list(SUPPORTED_MAJORS),
        },
        "defaultContentType": "application/json",
        "servers": {
            "hub": {"host": "{host}", "protocol": "wss", "description": "a dispatch-hub replica (any: a client "
                    "reconnects to whichever the load balancer picks)",
                    "variables": {"host": {"default": "localhost:8082"}},
                    "security": [{"$ref": "#/components/securitySchemes/clientToken"}]},
        },
        "channels": {
            "desktop": {
                "address": "/api/desktop/ws",
                "title": "The desktop client's socket",
                "description": _CHANNEL,
                "messages": channel_messages,
                "bindings": {"ws": {"method": "GET", "headers": _upgrade_headers(), "query": _upgrade_query(),
                                    "bindingVersion": "0.1.0"}},
                "x-handshake-refusals": [{"status": status, "error": error, "meaning": meaning, "client_action": act}
                                         for status, error, meaning, act in HANDSHAKE_REFUSALS],
                "x-close-codes": [{"code": c.code, "name": c.name, "meaning": c.meaning,
                                   "client_action": c.client_action, "reconnect": c.reconnect} for c in CLOSE_CODES],
                "x-heartbeat": {
                    "interval_s": "hello.heartbeat_interval_s",
                    "default_interval_s": int(settings.hub_ping_interval_s),
                    "timeout_s": settings.heartbeat_timeout_seconds,
                    "rule": "Send a `heartbeat` every `heartbeat_interval_s` seconds (it is answered by "
                            "`heartbeat_ack`); a WebSocket ping or pong also counts. A socket silent for longer than "
                            f"the timeout ({settings.heartbeat_timeout_seconds} s by default) is closed with "
                            f"{HEARTBEAT_TIMEOUT_CLOSE}. The hub pings a socket silent for one interval.",
                },
                "x-replay": {
                    "limit": REPLAY_LIMIT,
                    "rule": _REPLAY,
                },
            },
        },
        "operations": {
            **{f"send{name}": {"action": "send", "channel": {"$ref": "#/channels/desktop"},
                               "summary": _SEND_SUMMARY[name],
                               "messages": [{"$ref": f"#/channels/desktop/messages/{name}"}]}
               for name in server_names},
            "receiveHeartbeat": {
                "action": "receive", "channel": {"$ref": "#/channels/desktop"},
                "summary": "A client's heartbeat: keeps the client online and reports its platform logins.",
                "messages": [{"$ref": "#/channels/desktop/messages/Heartbeat"}],
                "reply": {"channel": {"$ref": "#/channels/desktop"},
                          "messages": [{"$ref": "#/channels/desktop/messages/HeartbeatAck"},
                                       {"$ref": "#/channels/desktop/messages/ErrorEvent"}]},
            },
        },
        "components": {
            "schemas": schemas,
            "messages": messages,
            "securitySchemes": {"clientToken": {"type": "httpApiKey", "in": "header", "name": "Authorization",
                                                "description": "`Bearer <client token>` on the upgrade"}},
        },
    }


def _schemas() -> dict[str, Any]:
    schemas = schema_components((*SERVER_MESSAGES, *CLIENT_MESSAGES, *HTTP_BODIES))
    for struct, fields in FIELDS_SINCE.items():
        for name, since in fields.items():
            schemas[struct]["properties"][name]["x-since"] = since
    for cls in HTTP_BODIES:
        schemas[cls.__name__].setdefault(
            "description", "A desktop HTTP body (the dispatch-hub OpenAPI document is authoritative).")
    return dict(sorted(schemas.items()))


def _message(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    tag = schema["properties"]["type"]["enum"][0]
    return {"name": tag, "title": name, "summary": _MESSAGE_SUMMARY[name],
            "payload": {"$ref": f"#/components/schemas/{name}"}}


def _upgrade_query() -> dict[str, Any]:
    return {"type": "object", "properties": {
        CAPABILITIES_QUERY: {"type": "string", "x-since": "1.3",
                             "description": f"As the {CAPABILITIES_HEADER} header, for a client that cannot set "
                                            "headers (a browser-side WebSocket); the two are merged."}}}


def _upgrade_headers() -> dict[str, Any]:
    offered = " or ".join(f"`{subprotocol(m)}`" for m in SUPPORTED_MAJORS)
    return {"type": "object", "required": ["Authorization"], "properties": {
        "Authorization": {"type": "string", "pattern": "^Bearer .+$", "description": "the client's token"},
        "Sec-WebSocket-Protocol": {
            "type": "string",
            "description": f"The protocol majors the client speaks, as subprotocols ({offered}), comma-separated; "
                           "the hub picks the highest it serves and echoes it in the 101. None offered: major 1 (a "
                           "client from before versioning). Only unserved majors offered: 400 "
                           "`unsupported_protocol_version`."},
        "traceparent": {"type": "string", "description": "W3C trace context (optional)"},
        CAPABILITIES_HEADER: {"type": "string", "x-since": "1.3",
                              "description": "Optional behaviours the client asks for, comma-separated (unknown ones "
                                             f"are ignored): `{PUSH_LEASE}` (task_available may carry the lease "
                                             "itself). The hello's `capabilities` lists what the hub granted."},
    }}


_INFO = ("The desktop client's WebSocket to a dispatch-hub: the hub pushes `task_available` and `task_control` "
         "events (forwarded unchanged from RabbitMQ) after a `hello` and a replay from the database; the client "
         "heartbeats. Work itself is taken and ended over HTTP (pull-lease, extend, cancel, result; schemas in "
         "components), or, for a client granted `push_lease` on its upgrade, arrives leased on `task_available`. "
         "Versioned `MAJOR.MINOR`: within a major every change is additive (a new field with a default, "
         "a new message type, control or error code a client ignores when it does not know it), so a client decodes "
         "with unknown fields allowed and unknown message types skipped. Fields carry `x-since` when they arrived "
         "after 1.0. docs/desktop-protocol.md is the prose version, with sequence diagrams.")

_CHANNEL = ("One socket per client process (at most two per token per hub; a third replaces the oldest with 4409). "
            "Server messages are text frames of one JSON object with a `type`. A client message is at most "
            f"{MAX_WS_MESSAGE // 1024} KiB; a bigger one up to {MAX_WS_FRAME // 1024} KiB gets an `error` event, a "
            "bigger frame closes the socket with 1009. Binary frames get `error` `invalid_message`.")

_REPLAY = ("On every (re)connect the hub sends `hello` first, then replays from the database what the client must "
           "know: the live leases pushed to it without a result yet (same token and epoch: never a second lease), "
           "then its queued executions as `task_available` in lane order (`lane_weight DESC, priority DESC, "
           f"enqueued_at ASC`, at most {REPLAY_LIMIT}), then every outstanding interrupt on its running executions "
           "as `task_control`; `hello.replayed_available` / `replayed_controls` count them. Live events that arrive "
           "meanwhile are held back and sent after the replay, so one can arrive twice and none is lost. A client "
           "drops what it knew of queued work at a hello (the replay is the truth) and treats `task_available` as a "
           "hint: the lease decides. After a broker reconnect the hub replays again on open sockets, without a "
           "hello.")

_SEND_SUMMARY = {
    "Hello": "First frame of every socket: who the client is, the hub's time, the heartbeat interval, the client's "
             "interrupt generation, the protocol version, and how many replayed events follow.",
    "TaskAvailable": "An execution for this client: queued (a hint: lease it by pull), or, to a client granted "
                     "`push_lease`, already leased to it (`lease_token` set: start at once, extend and post the "
                     "result with that token; one that is never extended expires and is requeued).",
    "TaskControl": "An interrupt request (yield at the next safe point and acknowledge with cancel), or the server "
                   "ended an execution (`cancelled`, `lease_revoked`: stop it, no callback).",
    "HeartbeatAck": "Answer to a heartbeat.",
    "ErrorEvent": "A client message was refused (the socket stays open); `field` names the part at fault.",
}

_MESSAGE_SUMMARY = {
    **_SEND_SUMMARY,
    "Heartbeat": "Client -> hub: alive, with the client's whole view of its platform logins (replacing the stored "
                 "one), its local queue depth and the running task's phase.",
}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=COMMITTED)
    parser.add_argument("--check", action="store_true", help="fail when the file differs from the generated one")
    args = parser.parse_args(argv)
    text = render(asyncapi_document())
    if args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is not what the contracts generate; run `make asyncapi`", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
