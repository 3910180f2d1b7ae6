"""Closed object schemas: checked against the `jsonschema` validator (the reference for what a schema
means) and through llguidance, on the demo tokenizer, for what a constrained model may write."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from loraserve.closed_schemas import close_objects
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.structured import grammar_for
from loraserve.tokenizer import Tokenizer


class City(BaseModel):
    name: str
    population: int


class Trip(BaseModel):
    origin: City
    stops: list[City]
    note: str | None = None
    tags: dict[str, str] = {}  # a free-form map: stays open


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")  # pydantic writes additionalProperties: true

    name: str


TRIP = {"origin": {"name": "a", "population": 1}, "stops": [{"name": "b", "population": 2}], "tags": {"k": "v"}}


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_objects_that_list_their_keys_refuse_others_at_every_depth():
    schema = Trip.model_json_schema()
    closed = close_objects(schema)
    assert valid(closed, TRIP) and valid(schema, TRIP)
    for path in ((), ("origin",), ("stops", 0)):
        extra = copy.deepcopy(TRIP)
        target = extra
        for step in path:
            target = target[step]
        target["added"] = 1
        assert valid(schema, extra) and not valid(closed, extra), path  # open by JSON Schema's default
    assert valid(closed, TRIP | {"tags": {"any": "key", "at": "all"}})  # a map with no listed keys stays open
    assert schema == Trip.model_json_schema()  # the argument is not changed


def test_a_schema_that_says_what_other_keys_may_be_is_left_as_it_is():
    loose = Loose.model_json_schema()
    assert close_objects(loose) == loose and valid(close_objects(loose), {"name": "x", "more": 1})
    typed = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(typed) == typed
    judged = {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}
    assert close_objects(judged) == judged
    assert close_objects({"type": "object"}) == {"type": "object"}
    assert close_objects(True) is True


def test_keywords_that_hold_values_and_properties_named_like_keywords_are_not_schemas():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "default": {"properties": {"x": 1}},
        "examples": [{"properties": {}}],
    }
    closed = close_objects(schema)
    assert closed["default"] == schema["default"] and closed["examples"] == schema["examples"]
    assert set(closed["properties"]) == {"properties"}  # no property named "additionalProperties" appears
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert valid(closed, {"properties": {"x": 1}}) and not valid(closed, {"properties": {"x": 1, "y": 2}})


def test_all_of_is_closed_on_its_holder_with_the_members_keys():
    schema = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    closed = close_objects(schema)
    assert valid(closed, {"a": 1, "b": 2}) and valid(closed, {"a": 1})
    assert not valid(closed, {"a": 1, "c": 3}) and not valid(closed, {"a": "one"})
    assert all("additionalProperties" not in member for member in closed["allOf"])


JSON_SCHEMAS = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "string", "boolean"])}),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.sampled_from("abc"), inner, max_size=3)}
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)}),
    ),
    max_leaves=8,
)
JSON_VALUES = st.recursive(
    st.one_of(st.integers(-3, 3), st.sampled_from(["x", ""]), st.booleans()),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(st.sampled_from("abcd"), inner, max_size=3)),
    max_leaves=8,
)


def _listed_keys_only(schema: dict[str, Any], value: Any) -> bool:
    """The reference rule, written over values rather than schemas: `value` is valid against `schema` and
    every object in it, where `schema` lists keys, holds only those (anyOf: some alternative does)."""
    if not valid(schema, value):
        return False
    if "anyOf" in schema:
        return any(_listed_keys_only(option, value) for option in schema["anyOf"])
    if schema.get("type") == "object":
        listed = schema["properties"]
        return set(value) <= set(listed) and all(_listed_keys_only(listed[k], v) for k, v in value.items())
    if schema.get("type") == "array":
        return all(_listed_keys_only(schema["items"], item) for item in value)
    return True


@settings(max_examples=300, deadline=None, derandomize=True)
@given(JSON_SCHEMAS, JSON_VALUES)
def test_a_closed_schema_accepts_exactly_the_values_with_only_listed_keys(schema, value):
    assert valid(close_objects(schema), value) == _listed_keys_only(schema, value)


@pytest.fixture(scope="module")
def writes():
    """Whether a model constrained by a json_schema constraint may write `text` and stop there."""
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    ll = LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids))

    def allowed(schema: dict[str, Any], text: str) -> bool:
        matcher = LLMatcher(ll, grammar_for("json_schema", schema, "response_format"))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return allowed


def test_a_constrained_model_cannot_add_keys_unless_the_schema_opens_its_objects(writes):
    city = City.model_json_schema()
    assert writes(city, '{"name":"a","population":1}')
    assert not writes(city, '{"name":"a","population":1,"mayor":"b"}')
    assert writes(Loose.model_json_schema(), '{"name":"a","mayor":"b"}')
    assert writes(city | {"additionalProperties": True}, '{"name":"a","population":1,"mayor":"b"}')
    trip = json.dumps(TRIP, separators=(",", ":"))
    assert writes(Trip.model_json_schema(), trip)
    assert not writes(Trip.model_json_schema(), trip.replace('"population":2', '"population":2,"x":0'))
