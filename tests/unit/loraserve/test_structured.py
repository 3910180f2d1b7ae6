"""Compiling a constraint (`loraserve/structured.py`): whatever is wrong with it is an InvalidRequestError
naming its field (a 400), never another exception (a 500): JSON nested deeper than Python's recursion
limit, integers llguidance cannot read, numbers that are not finite, a GBNF grammar that breaks its
converter, text over the size bound."""

from __future__ import annotations

import json

import pytest

from loraserve.errors import InvalidRequestError
from loraserve.structured import MAX_CONSTRAINT_BYTES, MAX_JSON_DEPTH, grammar_for

HUGE_BOUNDS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(10**300), "maximum": 10**300}}}


def deep_json(levels: int) -> str:
    return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels


def refused(kind: str, value, field: str = "guided_json") -> str:
    with pytest.raises(InvalidRequestError) as caught:
        grammar_for(kind, value, field)
    assert caught.value.field == field and caught.value.status == "INVALID_ARGUMENT"
    return str(caught.value)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 1000, 5000])
def test_json_nested_too_deep_is_refused_naming_the_field(levels):
    assert "nested more than 128 levels" in refused("json_schema", deep_json(levels))


def test_json_at_the_depth_bound_compiles():
    assert grammar_for("json_schema", deep_json(MAX_JSON_DEPTH // 2 - 1), "guided_json")


@pytest.mark.parametrize(
    "schema",
    [
        HUGE_BOUNDS,
        json.dumps(HUGE_BOUNDS),
        {"type": "integer", "maximum": 2**64},
        {"enum": [1, -(2**63) - 1]},
        {"const": -(2**63) + 100},  # llguidance crashes (SIGSEGV) on constants this close to -2^63
        '{"type": "integer", "minimum": 1' + "0" * 5000 + "}",  # more digits than Python reads
    ],
)
def test_integers_llguidance_cannot_read_are_refused_naming_the_field(schema):
    message = refused("json_schema", schema, "response_format")
    assert "integer" in message or "not JSON" in message


def test_integers_at_the_bounds_are_read():
    assert grammar_for("json_schema", {"enum": [-(2**53 - 1), 2**53 - 1]}, "guided_json")


@pytest.mark.parametrize("schema", [{"maximum": float("inf")}, '{"maximum": 1e400}', {"const": float("nan")}])
def test_numbers_that_are_not_finite_are_refused(schema):
    assert "not finite" in refused("json_schema", schema)


@pytest.mark.parametrize(
    ("kind", "value", "words"),
    [
        ("grammar", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "grammar"),  # the GBNF converter recurses
        ("grammar", "x" * (MAX_CONSTRAINT_BYTES + 1), "bytes"),
        ("regex", "a" * (MAX_CONSTRAINT_BYTES + 1), "bytes"),
        ("json_schema", " " * (MAX_CONSTRAINT_BYTES + 1), "bytes"),
        ("choice", ["x" * 200] * 1000, "bytes"),
        ("json_schema", {1: "a"}, "not a string"),
        ("json_schema", {"a": object()}, "not JSON"),
        ("json_schema", "[1, 2]", "object"),
        ("nonsense", "x", "unknown"),
    ],
)
def test_any_failure_of_compiling_names_the_field(kind, value, words):
    assert words in refused(kind, value, "sampling.structured_output.grammar")
