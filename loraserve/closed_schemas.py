"""JSON schemas with their objects closed: an object schema that lists its keys allows no others
unless it says so. Pure functions over parsed JSON.

JSON Schema's default lets an object hold any key its schema does not list (`additionalProperties`
defaults to `true`). Constrained decoding then lets the model add keys of its own, which a client
that validates the answer against its model (pydantic, instructor, LangChain) refuses, and a small
model often does. So every schema a request constrains output with (`response_format`, vLLM's
`guided_json`, tool parameters) is closed first, as vLLM's default grammar backend does: each object
schema that lists `properties` or `patternProperties` and does not say `additionalProperties` (or
`unevaluatedProperties`) gets `"additionalProperties": false`. A schema that wants JSON Schema's
open default says so: `"additionalProperties": true` (pydantic's `extra="allow"` writes it). A bare
`{"type": "object"}` (any object: a free-form map) stays open.

`allOf` is closed on the schema that holds it, not on its members (closing each member alone would
refuse the keys the others list): the members' listed keys join the holder's `properties`, and the
holder gets `additionalProperties: false`.
"""

from __future__ import annotations

from typing import Any

# where a schema holds subschemas: one, a name -> schema map, or a list
ONE_SCHEMA = (
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
    "items",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
KEY_LISTS = ("properties", "patternProperties")  # what makes an object schema list its keys
OPEN_MARKS = ("additionalProperties", "unevaluatedProperties")  # a schema that says what other keys may be


def close_objects(schema: Any) -> Any:
    """A copy of `schema` with every object schema that lists its keys closed (module docstring); the
    argument is not changed. Walks without recursion (a schema's depth is the caller's input)."""
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    pending: list[tuple[dict[str, Any], bool]] = [(root, False)]  # (a copied schema, a member of allOf)
    while pending:
        node, in_all_of = pending.pop()
        for key, value in list(node.items()):
            if key in ONE_SCHEMA and isinstance(value, dict):
                node[key] = _copied(value, pending)
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                node[key] = {name: _copied(sub, pending) for name, sub in value.items()}
            elif key in SCHEMA_LISTS and isinstance(value, list):
                node[key] = [_copied(sub, pending, in_all_of=key == "allOf") for sub in value]
        if not in_all_of:
            _close(node)
    return root


def _copied(value: Any, pending: list[tuple[dict[str, Any], bool]], in_all_of: bool = False) -> Any:
    """`value` (a subschema) copied and queued for the walk; booleans and other values as they are."""
    if not isinstance(value, dict):
        return value
    copy = dict(value)
    pending.append((copy, in_all_of))
    return copy


def _close(node: dict[str, Any]) -> None:
    """Close `node` if it lists keys (itself or in its allOf members) and says nothing of other keys."""
    if any(mark in node for mark in OPEN_MARKS):
        return
    members = [m for m in node.get("allOf", ()) if isinstance(m, dict)]
    listing = [s for s in (node, *members) if any(isinstance(s.get(key), dict) for key in KEY_LISTS)]
    if not listing:
        return
    for key in KEY_LISTS:
        if any(isinstance(m.get(key), dict) for m in members):  # the members' keys, allowed here too
            joined = {name: {} for m in members if isinstance(m.get(key), dict) for name in m[key]}
            node[key] = joined | (node.get(key) if isinstance(node.get(key), dict) else {})
    node["additionalProperties"] = False
