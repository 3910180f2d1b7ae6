"""Structured output at the HTTP edge: the constraint a request body asks for, in any of the accepted spellings.

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`. The schema
  is enforced whatever `strict` says: a constrained answer always matches it.
- vLLM's `guided_json` (a schema, as an object or JSON text), `guided_regex`, `guided_choice` (a list
  of strings) and `guided_grammar` (Lark or GBNF), with `guided_decoding_backend` "auto",
  "llguidance" or "guidance" (the engine loraserve runs).
- vLLM's newer `structured_outputs`: `{"json": ..., "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}` (its other keys, such as `structural_tag` or `whitespace_pattern`, are refused).

At most one constraint per request. The answer is compiled here (`loraserve/structured.py`), so a bad
schema or regex is a 400 naming the parameter, and travels downstream as an llguidance grammar.
"""

from __future__ import annotations

from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.structured import grammar_for

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
BACKENDS = ("auto", "llguidance", "guidance")


def requested_constraint(fields: dict[str, Any]) -> tuple[str, Any, str] | None:
    """(kind, value, parameter) of the one constraint among a body's fields, or None.

    `fields`: the body's response_format, guided_* and structured_outputs values (unset ones None)."""
    found = []
    response_format = fields.get("response_format")
    if response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            found.append(("json_object", True, "response_format"))
        elif kind == "json_schema":
            found.append(("json_schema", _schema(response_format), "response_format"))
        elif kind != "text":
            raise InvalidRequestError(
                "response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
            )
    found += [(kind, fields[name], name) for name, kind in GUIDED.items() if fields.get(name) is not None]
    outputs = fields.get("structured_outputs")
    if outputs is not None:
        unknown = sorted(set(outputs) - set(STRUCTURED_OUTPUTS))
        if unknown:
            raise InvalidRequestError(
                "structured_outputs", f"{', '.join(unknown)} not supported (use one of {', '.join(STRUCTURED_OUTPUTS)})"
            )
        asked = {k: v for k, v in outputs.items() if v is not None and not (k == "json_object" and v is False)}
        found += [(STRUCTURED_OUTPUTS[k], v, "structured_outputs") for k, v in asked.items()]
    backend = fields.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise InvalidRequestError("guided_decoding_backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if len(found) > 1:
        raise InvalidRequestError(found[1][2], f"conflicts with {found[0][2]}: ask for one output constraint")
    return found[0] if found else None


def compiled(constraint: tuple[str, Any, str]) -> str:
    """The llguidance grammar of a constraint (InvalidRequestError naming its parameter)."""
    kind, value, param = constraint
    return grammar_for(kind, value, param)


def _schema(response_format: dict[str, Any]) -> Any:
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError(
            "response_format", "type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}"
        )
    return spec["schema"]
