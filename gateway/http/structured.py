"""Structured output at the HTTP edge: the one constraint a request body asks for, in any of the spellings
the README's "Structured output" lists (OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs`; the tables below map them to `Constraint` kinds). It is read here and compiled once
the request is validated, by the generation core in the gateway's sandbox processes
(`gateway/constraints.py`), so a bad schema or regex (or one that would crash or wedge the compiler) is a
400 naming the parameter, and travels downstream as an llguidance grammar.
"""

from __future__ import annotations

from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.structured import Constraint

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
BACKENDS = ("auto", "llguidance", "guidance")
# the fields of a body that may ask for a constraint (`requested_constraint` reads them)
CONSTRAINT_FIELDS = ("response_format", *GUIDED, "guided_decoding_backend", "structured_outputs")


def requested_constraint(fields: dict[str, Any]) -> Constraint | None:
    """The one constraint among a body's fields (its field: the parameter that asked for it), or None.

    `fields`: the body's response_format, guided_* and structured_outputs values (unset ones None)."""
    found = []
    response_format = fields.get("response_format")
    if response_format is not None:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            found.append(Constraint("json_object", True, "response_format"))
        elif kind == "json_schema":
            found.append(Constraint("json_schema", _schema(response_format), "response_format"))
        elif kind != "text":
            raise InvalidRequestError(
                "response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
            )
    found += [Constraint(kind, fields[name], name) for name, kind in GUIDED.items() if fields.get(name) is not None]
    outputs = fields.get("structured_outputs")
    if outputs is not None:
        unknown = sorted(set(outputs) - set(STRUCTURED_OUTPUTS))
        if unknown:
            raise InvalidRequestError(
                "structured_outputs", f"{', '.join(unknown)} not supported (use one of {', '.join(STRUCTURED_OUTPUTS)})"
            )
        asked = {k: v for k, v in outputs.items() if v is not None and not (k == "json_object" and v is False)}
        found += [Constraint(STRUCTURED_OUTPUTS[k], v, "structured_outputs") for k, v in asked.items()]
    backend = fields.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise InvalidRequestError("guided_decoding_backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if len(found) > 1:
        raise InvalidRequestError(found[1].field, f"conflicts with {found[0].field}: ask for one output constraint")
    return found[0] if found else None


def _schema(response_format: dict[str, Any]) -> Any:
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError(
            "response_format", "type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}"
        )
    return spec["schema"]
