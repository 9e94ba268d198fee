"""Is a newer set of WebSocket message Structs still the same major as an older one (docs/desktop-protocol.md,
Versioning)? The problems found, as text; none means every change was additive.

Server messages must stay decodable by a client built against the old set: every old message type and field is
still sent, with the same JSON shape, and an enumeration only loses values. Client messages from an old client must
still decode: no old field removed, no new required field, and an enumeration only gains values. Constraints
(lengths, patterns, ranges) are not compared: tightening what the hub accepts from a client is validation (answered
by an `error` event), not a change of shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from msgspec import inspect as mi

Direction = Literal["server", "client"]
_CONSTRAINTS = frozenset({"maxLength", "minLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
                          "exclusiveMaximum", "maxItems", "minItems", "maxProperties", "minProperties", "default",
                          "description", "title", "x-since", "format", "propertyNames"})


def compatibility_problems(old: Sequence[type[msgspec.Struct]], new: Sequence[type[msgspec.Struct]],
                           direction: Direction) -> list[str]:
    problems: list[str] = []
    old_schemas = _schemas(old)
    new_schemas = _schemas(new)
    new_by_tag = {_tag(cls): cls for cls in new}
    for old_cls in old:
        tag = _tag(old_cls)
        new_cls = new_by_tag.get(tag)
        if new_cls is None:
            problems.append(f"message type {tag!r} is gone")
            continue
        old_info, new_info = _info(old_cls), _info(new_cls)
        old_props = old_schemas[old_cls.__name__]["properties"]
        new_props = new_schemas[new_cls.__name__]["properties"]
        new_fields = {f.encode_name: f for f in new_info.fields}
        for field in old_info.fields:
            name = f"{tag}.{field.encode_name}"
            current = new_fields.get(field.encode_name)
            if current is None:
                problems.append(f"{name} is gone")
                continue
            omitted = new_cls.__struct_config__.omit_defaults
            if direction == "server" and field.required and not current.required and omitted:
                problems.append(f"{name} may now be left out (omit_defaults), but a {old_cls.__name__} requires it")
            problems.extend(f"{name}: {p}" for p in _shape_problems(
                old_props[field.encode_name], new_props[field.encode_name], direction))
        if direction == "client":
            old_names = {f.encode_name for f in old_info.fields}
            problems.extend(f"{tag}.{f.encode_name} is new and required: an old client does not send it"
                            for f in new_info.fields if f.required and f.encode_name not in old_names)
    return problems


def _shape_problems(old: dict[str, Any], new: dict[str, Any], direction: Direction) -> list[str]:
    old_shape, new_shape = _shape(old), _shape(new)
    old_enum, new_enum = _enum(old_shape), _enum(new_shape)
    # An open string that became an enumeration of strings is narrower (fine for what a client reads); the reverse
    # is wider (fine for what a client sends).
    narrower, wider = (new_enum, old_shape) if direction == "server" else (old_enum, new_shape)
    if narrower is not None and wider == {"type": "string"} and all(isinstance(v, str) for v in narrower):
        return []
    if old_enum is not None and new_enum is not None:
        gone, added = old_enum - new_enum, new_enum - old_enum
        if direction == "server" and added:
            return [f"new value(s) {sorted(added, key=str)} an old client does not know"]
        if direction == "client" and gone:
            return [f"value(s) {sorted(gone, key=str)} an old client sends are no longer taken"]
        return []
    if direction == "client":
        # Inside a value (a map's values, a list's items), a string the hub now takes from a closed set only is
        # validation too: a value outside it is answered with an `error` event.
        old_shape, new_shape = _open_enums(old_shape), _open_enums(new_shape)
    if old_shape != new_shape:
        return [f"shape changed from {old_shape} to {new_shape}"]
    return []


def _open_enums(shape: Any) -> Any:
    if isinstance(shape, dict):
        if "enum" in shape and all(isinstance(v, str) for v in shape["enum"]):
            return {"type": "string"}
        return {key: _open_enums(value) for key, value in shape.items()}
    if isinstance(shape, list):
        return [_open_enums(value) for value in shape]
    return shape


def _enum(shape: Any) -> frozenset[Any] | None:
    """The values of an enumeration (possibly nullable: `anyOf [enum, null]`), else None."""
    if isinstance(shape, dict) and "enum" in shape:
        return frozenset(shape["enum"])
    if isinstance(shape, dict) and "anyOf" in shape:
        values: set[Any] = set()
        for branch in shape["anyOf"]:
            if branch == {"type": "null"}:
                values.add(None)
            elif isinstance(branch, dict) and "enum" in branch:
                values.update(branch["enum"])
            else:
                return None
        return frozenset(values)
    return None


def _shape(schema: Any) -> Any:
    """A schema without its constraints, references compared by name."""
    if isinstance(schema, dict):
        return {key: _shape(value) for key, value in schema.items() if key not in _CONSTRAINTS}
    if isinstance(schema, list):
        return [_shape(value) for value in schema]
    return schema


def _schemas(types: Sequence[type[msgspec.Struct]]) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(tuple(types), ref_template="#/{name}")
    return components


def _info(cls: type[msgspec.Struct]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def _tag(cls: type[msgspec.Struct]) -> str:
    tag = _info(cls).tag
    assert isinstance(tag, str), f"{cls.__name__} has no string tag"
    return tag
