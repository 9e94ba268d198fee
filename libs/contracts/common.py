"""Decoding at the edge: strict, size-bounded, with errors that name the field at fault."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

T = TypeVar("T")

MAX_MESSAGE_BYTES = 256 * 1024

Lane = Literal["high", "normal", "normal_boosted", "retry"]
TaskKind = Literal["monitor", "publish"]
ExecutionStatus = Literal["queued", "in_progress", "succeeded", "failed", "aborted", "unknown"]
ExecutionPhase = Literal[
    "PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING"
]
# Seed §14.2: "not really started" means exactly these phases.
NOT_STARTED_PHASES: frozenset[str] = frozenset({"PREPARING", "NAVIGATING"})

PositiveInt = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
ShortText = Annotated[str, msgspec.Meta(max_length=200)]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ContractError(ValueError):
    """A message or body that does not match its contract."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


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
        match = _AT.search(text)
        field = _field_from_path(match.group("path")) if match else None
        message = text[: match.start()] if match else text
        if message.startswith("Object missing required field"):
            missing = message.split("`")[1] if "`" in message else None
            field = f"{field}.{missing}" if field and missing else missing
            raise ContractError("missing_field", message, field) from exc
        if "Invalid value" in message and field and field.endswith("type"):
            raise ContractError("unknown_type", message, field) from exc
        raise ContractError("invalid_field", message, field) from exc
    except msgspec.DecodeError as exc:
        raise ContractError("invalid_json", f"body is not valid JSON: {exc}") from exc


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)
