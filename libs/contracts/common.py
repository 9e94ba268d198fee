"""Decoding at the edge: strict, size-bounded, with errors that name the field at fault."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

T = TypeVar("T")

MAX_MESSAGE_BYTES = 256 * 1024

# The monitor lanes' names on the wire, and every kind's (a publish lane too): the names of the lane table
# (libs/domain/lanes.py, LANE_SPECS). A Literal cannot be built from it for a type checker, so it is written out and
# tests/unit/test_lane_table.py holds it equal to the table.
Lane = Literal["high", "normal", "normal_boosted", "retry"]
ExecutionLane = Literal["high", "normal", "normal_boosted", "retry", "urgent"]
TaskKind = Literal["monitor", "publish"]
ExecutionStatus = Literal["queued", "in_progress", "succeeded", "failed", "aborted", "unknown"]
ExecutionPhase = Literal[
    "PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING"
]
# docs/architecture.md §14.2: "not really started" means exactly these phases.
NOT_STARTED_PHASES: frozenset[str] = frozenset({"PREPARING", "NAVIGATING"})

PositiveInt = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

# Text that Postgres or a consumer cannot take never gets in: `text` and `jsonb` cannot hold U+0000 (one such
# value fails the whole statement it is in), and control characters make no sense in a name, a code, a reason
# or a token. Single-line text refuses every C0 control and DEL; multi-line text (answers, titles, error
# descriptions) keeps tab, line feed and carriage return.
SINGLE_LINE = r"^[^\x00-\x1f\x7f]*$"
MULTI_LINE = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"
_CONTROL_PATTERNS = {SINGLE_LINE: "a control character", MULTI_LINE: "a NUL or control character"}


ShortText = Annotated[str, msgspec.Meta(max_length=200, pattern=SINGLE_LINE)]
# A result's answer and error description, as a client posts them and as the hub publishes them.
AnswerText = Annotated[str, msgspec.Meta(max_length=100_000, pattern=MULTI_LINE)]
ErrorText = Annotated[str, msgspec.Meta(max_length=2000, pattern=MULTI_LINE)]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=SINGLE_LINE)]
# ai_platforms.code: lower-case letters, digits, `_`, `-`, `.`, at most 40 (the column's width).
PlatformCode = Annotated[str, msgspec.Meta(min_length=1, max_length=40, pattern=r"^[a-z0-9][a-z0-9_.-]*$")]
# What a client may report of its login on one platform (desktop_clients.platform_health values).
PlatformHealthState = Literal["healthy", "login_required", "captcha", "rate_limited", "degraded", "unknown"]
MAX_PLATFORM_HEALTH_ENTRIES = 50


class ContractError(ValueError):
    """A message or body that does not match its contract."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


_AT = re.compile(r" - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`$")


def _field_from_path(path: str) -> str | None:
    """`$.citations[2].url` -> `citations[2].url`."""
    if not path:
        return None
    return path[1:] if path.startswith(".") else path


def decode_json(data: bytes | str, type_: type[T], *, max_bytes: int = MAX_MESSAGE_BYTES,
                decoder: msgspec.json.Decoder[Any] | None = None) -> T:
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise ContractError("payload_too_large", f"payload is {len(raw)} bytes; the limit is {max_bytes}")
    if not raw.strip():
        raise ContractError("invalid_body", "body is empty; a JSON object is required")
    try:
        if decoder is not None:
            decoded: T = decoder.decode(raw)
            return decoded
        value: T = msgspec.json.decode(raw, type=type_, strict=True)
        return value
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "got `float`" in text:
            respelled = _whole_floats_as_ints(raw)
            if respelled != raw:  # once respelled, a body has no whole floats left: this recursion ends
                return decode_json(respelled, type_, max_bytes=max(max_bytes, len(respelled)), decoder=decoder)
        match = _AT.search(text)
        field = _field_from_path(match.group("path")) if match else None
        if match and match.group("key") and field:
            field = f"{field} (a key)"
        message = text[: match.start()] if match else text
        control = next((what for pattern, what in _CONTROL_PATTERNS.items() if repr(pattern) in message), None)
        if control is not None:
            raise ContractError("invalid_field", f"text contains {control} (U+0000-U+001F, U+007F), which is "
                                "not allowed here", field) from exc
        if message.startswith("Object missing required field"):
            missing = message.split("`")[1] if "`" in message else None
            field = f"{field}.{missing}" if field and missing else missing
            raise ContractError("missing_field", message, field) from exc
        if "Invalid value" in message and field and field.endswith("type"):
            raise ContractError("unknown_type", message, field) from exc
        raise ContractError("invalid_field", message, field) from exc
    except msgspec.DecodeError as exc:
        raise ContractError("invalid_json", f"body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's depth guard (about a thousand levels), even in skipped fields
        raise ContractError("invalid_json", "body is nested too deeply") from exc


def _whole_floats_as_ints(raw: bytes) -> bytes:
    """JSON Schema (so every OpenAPI document here) counts `2.0` as the integer 2, strict msgspec does not: for the
    error path only, the body with whole floats spelled as integers (canonical JSON, so respelling it again gives
    the same bytes)."""
    def whole(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)
        if isinstance(value, list):
            return [whole(v) for v in value]
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        return value

    try:
        return msgspec.json.encode(whole(msgspec.json.decode(raw)))
    except (msgspec.MsgspecError, UnicodeError, RecursionError):
        return raw


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)
