"""Structured output: a request's constraint (JSON schema, any JSON object, regex, choice, grammar) as a grammar.

Every kind is compiled to one form, an llguidance grammar (its JSON text), which is what travels
with a request's sampling parameters (`SamplingParams.grammar`) and what the worker turns into a
per-token mask (`worker/grammar.py`). llguidance (https://github.com/guidance-ai/llguidance) does the
compiling and the matching; this module only names the kinds and turns its complaints into
InvalidRequestError naming the field.

JSON is written compactly (no whitespace between tokens: `{"a":1,"b":[2,3]}`) unless the schema's
own `x-guidance` options say otherwise: free whitespace lets a model pad an answer endlessly.
"""

from __future__ import annotations

import json
from typing import Any

from loraserve.errors import InvalidRequestError

MAX_GRAMMAR_BYTES = 1 << 17  # the compiled grammar's JSON text (a schema, regex or grammar and its wrapping)
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (llguidance's JsonCompileOptions)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "llguidance")


def grammar_for(kind: str, value: Any, field: str) -> str:
    """The llguidance grammar of a constraint, checked; InvalidRequestError naming `field` if it is not one.

    kind: "json_schema" (a schema: JSON text or a dict), "json_object" (any JSON object; value unused),
    "regex" (Rust regex syntax, matched by the whole output), "choice" (a list of strings: the output is
    one of them), "grammar" (Lark in llguidance's dialect, or GBNF) or "llguidance" (llguidance's own
    form: Lark text, or its JSON grammar).
    """
    from llguidance import LLMatcher, gbnf_to_lark

    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    elif kind == "json_schema":
        schema = _json_schema(value, field)
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(_text(value, field))
    elif kind == "choice":
        choices = value if isinstance(value, list | tuple) else None
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(field, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    elif kind == "grammar":
        try:
            lark = gbnf_to_lark.any_to_lark(_text(value, field))
        except Exception as e:  # the GBNF converter raises bare exceptions
            raise InvalidRequestError(field, f"is not a Lark or GBNF grammar: {e}") from None
        grammar = LLMatcher.grammar_from_lark(lark)
    elif kind == "llguidance":
        grammar = _text(value, field)
    else:
        raise InvalidRequestError(field, f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")
    check_grammar(grammar, field)
    return grammar


def check_grammar(grammar: str, field: str = "structured_output") -> None:
    """InvalidRequestError naming `field` unless `grammar` is a valid llguidance grammar of at most
    MAX_GRAMMAR_BYTES."""
    from llguidance import LLMatcher

    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(field, f"compiles to a grammar over {MAX_GRAMMAR_BYTES} bytes: simplify it")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(field, f"is not a valid constraint: {error.strip()}")


def _json_schema(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(field, f"is not JSON: {e}") from None
    if value is True:  # JSON Schema's "any value"
        value = {}
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(field, "must be a non-empty string")
    return value
