"""Generated malformed WebSocket frames for the hub's fuzz test (tests/e2e/test_ws_fuzz.py).

Hypothesis draws them from a fixed seed (`WS_FUZZ_SEED` picks another), so a run is reproducible and a
failure names a frame that can be replayed. Each frame is wrong *by construction*, which is what says which
error it must get: a known field with a value of the wrong type or outside its range, text with NUL or
another control character (escaped, or raw inside a JSON string), random JSON shapes that are no heartbeat,
JSON cut short or followed by garbage, random binary frames, nesting deeper than any decoder goes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

DEFAULT_SEED = 20260420
FRAMES_PER_KIND = 16

PHASES = {"PREPARING", "NAVIGATING", "AUTHENTICATING", "INPUTTING", "SUBMITTING", "WAITING", "PARSING", "POSTING"}
HEALTH_STATES = {"healthy", "login_required", "captcha", "rate_limited", "degraded", "unknown"}
HEARTBEAT_KEYS = {"type", "sent_at", "platform_health", "local_queue_depth", "active_task_id", "execution_phase"}
CONTROL_CHARS = [chr(c) for c in range(0x20)] + ["\x7f"]


@dataclass(frozen=True)
class Frame:
    """One generated frame and what the hub must answer: an `error` event with one of `codes`, naming a field
    that starts with `named` (when set)."""

    kind: str
    frame: str | bytes
    codes: frozenset[str]
    named: str | None = None


def seed_in_use() -> int:
    return int(os.environ.get("WS_FUZZ_SEED", DEFAULT_SEED))


# Any code point but lone surrogates (a text frame is UTF-8): every script, emoji, combining marks, and the C0
# controls, NUL included.
_text = st.text(max_size=12)
_extra_keys = st.text(max_size=8).filter(lambda k: k not in HEARTBEAT_KEYS)
_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
         | st.floats(allow_nan=False, allow_infinity=False) | _text)
_json: st.SearchStrategy[Any] = st.recursive(
    _leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_extra_keys, kids, max_size=4), max_leaves=12)
_extras = st.dictionaries(_extra_keys, _json, max_size=3)
_with_control = st.builds(lambda a, c, b: a + c + b, _text, st.sampled_from(CONTROL_CHARS), _text)


def _not(*kinds: type) -> Callable[[Any], bool]:
    """JSON values of none of these types (and not null: every heartbeat field may be null)."""
    return lambda v: v is not None and not isinstance(v, kinds)


def _is_datetime(text: str) -> bool:
    try:
        msgspec.json.decode(json.dumps(text), type=datetime)
    except msgspec.ValidationError:
        return False
    return True


def _whole_or_int(v: Any) -> bool:
    # A whole float (2.0) counts as the integer it spells, as in JSON Schema.
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


_no_state = _json.filter(lambda v: not isinstance(v, str) or v not in HEALTH_STATES)
_code = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,15}", fullmatch=True)
_WRONG_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "sent_at": _json.filter(_not(str)) | _text.filter(lambda t: not _is_datetime(t)),
    "local_queue_depth": (_json.filter(lambda v: v is not None and not _whole_or_int(v))
                          | st.integers(max_value=-1) | st.integers(min_value=2**63)),
    "active_task_id": _json.filter(_not(str)) | _text.filter(lambda t: not re.fullmatch(r"[0-9a-fA-F-]*", t)),
    "execution_phase": _json.filter(_not(str)) | _text.filter(lambda t: t not in PHASES),
    "platform_health": _json.filter(_not(dict)) | st.dictionaries(_code, _no_state, min_size=1, max_size=5),
}


def _heartbeat_text(fields: dict[str, Any], extras: dict[str, Any], type_first: bool, ascii_only: bool) -> str:
    body = {"type": "heartbeat", **fields, **extras} if type_first else {**extras, **fields, "type": "heartbeat"}
    return json.dumps(body, ensure_ascii=ascii_only)


@st.composite
def wrong_types(draw: st.DrawFn) -> Frame:
    """A known heartbeat field with a value of the wrong type, or out of range."""
    name = draw(st.sampled_from(sorted(_WRONG_VALUES)))
    text = _heartbeat_text({name: draw(_WRONG_VALUES[name])}, draw(_extras), draw(st.booleans()), draw(st.booleans()))
    return Frame("wrong type or range", text, frozenset({"invalid_field"}), name)


@st.composite
def control_characters(draw: st.DrawFn) -> Frame:
    """NUL or another control character in a string a heartbeat holds (JSON-escaped, so the JSON is valid)."""
    bad = draw(_with_control)
    where = draw(st.sampled_from(["execution_phase", "active_task_id", "health code", "health state", "type"]))
    fields: dict[str, Any] = {
        "execution_phase": {"execution_phase": bad}, "active_task_id": {"active_task_id": bad},
        "health code": {"platform_health": {bad: "healthy"}}, "health state": {"platform_health": {"openai": bad}},
        "type": {},
    }[where]
    ascii_only = draw(st.booleans())
    if where == "type":
        return Frame("control character in text", json.dumps({"type": bad, **draw(_extras)}, ensure_ascii=ascii_only),
                     frozenset({"unknown_type"}), "type")
    named = "platform_health" if where.startswith("health") else where
    text = _heartbeat_text(fields, draw(_extras), draw(st.booleans()), ascii_only)
    return Frame("control character in text", text, frozenset({"invalid_field"}), named)


_plain = st.text(max_size=12).filter(lambda t: '"' not in t and "\\" not in t)


@st.composite
def raw_control_characters(draw: st.DrawFn) -> Frame:
    """A raw (unescaped) C0 control character inside a JSON string: not JSON at all."""
    inner = draw(_plain) + draw(st.sampled_from(CONTROL_CHARS[:0x20])) + draw(_plain)
    template = draw(st.sampled_from([
        '{"type":"heartbeat","execution_phase":"%s"}', '{"type":"%s"}',
        '{"type":"heartbeat","platform_health":{"%s":"healthy"}}', '{"%s":1,"type":"heartbeat"}',
    ]))
    return Frame("raw control character", template % inner, frozenset({"invalid_json"}))


@st.composite
def json_shapes(draw: st.DrawFn) -> Frame:
    """Valid JSON that is no heartbeat: not an object, an object without `type`, or with another `type`."""
    shape = draw(st.sampled_from(["not an object", "no type", "another type"]))
    if shape == "not an object":
        return Frame("random JSON shape", json.dumps(draw(_json.filter(lambda v: not isinstance(v, dict)))),
                     frozenset({"invalid_field"}))
    extras = draw(_extras)
    if shape == "no type":
        return Frame("random JSON shape", json.dumps(extras), frozenset({"missing_field"}), "type")
    other = draw(_json.filter(lambda v: v != "heartbeat" and v is not None))
    codes = {"unknown_type"} if isinstance(other, str) else {"invalid_field", "unknown_type"}
    text = json.dumps({"type": other, **extras} if draw(st.booleans()) else {**extras, "type": other})
    return Frame("random JSON shape", text, frozenset(codes), "type")


@st.composite
def broken_json(draw: st.DrawFn) -> Frame:
    """A heartbeat cut short (a proper prefix of an object is never JSON) or followed by garbage."""
    whole = _heartbeat_text(draw(_extras), {}, True, draw(st.booleans()))
    if draw(st.booleans()):
        return Frame("broken JSON", whole[:draw(st.integers(1, len(whole) - 1))], frozenset({"invalid_json"}))
    garbage = draw(st.text(min_size=1, max_size=12).filter(lambda t: t.strip() != ""))
    return Frame("broken JSON", whole + draw(st.sampled_from(["", " ", "\n"])) + garbage,
                 frozenset({"invalid_json"}))


@st.composite
def deep_nesting(draw: st.DrawFn) -> Frame:
    """Arrays and objects nested a thousand levels or more: at the top, in a field the hub ignores, in
    platform_health."""
    pattern = draw(st.lists(st.booleans(), min_size=1, max_size=4))  # True: an array level, False: an object level
    depth = draw(st.integers(1_000, 9_000))
    levels = [pattern[i % len(pattern)] for i in range(depth)]
    nested = "".join("[" if array else '{"k":' for array in levels) + "0" + "".join(
        "]" if array else "}" for array in reversed(levels))
    where = draw(st.sampled_from(["top", "ignored field", "platform_health"]))
    if where == "top":
        return Frame("deep nesting", nested, frozenset({"invalid_json", "invalid_field"}))
    key = draw(_extra_keys) if where == "ignored field" else "platform_health"
    text = '{"type":"heartbeat",' + json.dumps(key) + ":" + nested + "}"
    return Frame("deep nesting", text, frozenset({"invalid_json"} if where == "ignored field"
                                                 else {"invalid_json", "invalid_field"}))


@st.composite
def binary_frames(draw: st.DrawFn) -> Frame:
    return Frame("random binary", draw(st.binary(max_size=512)), frozenset({"invalid_message"}), "type")


KINDS: list[Callable[[], st.SearchStrategy[Frame]]] = [
    wrong_types, control_characters, raw_control_characters, json_shapes, broken_json, deep_nesting, binary_frames,
]


def _draw(strategy: st.SearchStrategy[Frame], n: int, at: int) -> list[Frame]:
    found: list[Frame] = []

    @seed(at)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(frame: Frame) -> None:
        found.append(frame)

    collect()
    return found


def generated_frames(per_kind: int = FRAMES_PER_KIND) -> list[Frame]:
    """`per_kind` frames of each kind (fewer only if hypothesis runs out of distinct ones), from seed_in_use()."""
    at = seed_in_use()
    return [frame for n, kind in enumerate(KINDS) for frame in _draw(kind(), per_kind, at + n)]
