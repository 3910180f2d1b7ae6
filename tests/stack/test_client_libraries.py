"""Structured output and tool calls through the client libraries users run, unchanged, on a real stack:
LangChain's `with_structured_output` (non-strict function calling and json_schema) and `bind_tools`,
instructor in its TOOLS, TOOLS_STRICT and JSON_SCHEMA modes, and the openai SDK's tool calls cut by max_tokens.

The schemas are plain pydantic models (no `extra="forbid"`): loraserve closes their objects, so the
demo model cannot add keys of its own until max_tokens cuts the JSON (which it does when a model opts
into JSON Schema's open default, as the contrast checks). Their strings and numbers are bounded, as a
schema for a small model should be: the demo model seldom closes a string of its own accord.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from stack import http_stack

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
PROMPT = "the quiet king"
ADAPTERS = ("upper", "title", DEMO_MODEL_DIR.name)  # two adapters and the base model


class City(BaseModel):
    """A city the text names."""

    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**9)
    kind: Literal["town", "city"]


class OpenCity(City):
    model_config = ConfigDict(extra="allow")  # JSON Schema's open default: additionalProperties true


@pytest.fixture(scope="module")
def stack():
    with http_stack() as stack:
        stack.base_url = f"{stack.http_url}/v1"
        yield stack


def chat_model(stack, model: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model, base_url=stack.base_url, api_key="unused", temperature=0, max_tokens=64, max_retries=0
    )


@pytest.mark.parametrize("model", ADAPTERS)
def test_langchain_non_strict_structured_output_parses(stack, model):
    for method in ("function_calling", "json_schema"):
        result = chat_model(stack, model).with_structured_output(City, method=method, include_raw=True).invoke(PROMPT)
        assert result["parsing_error"] is None and isinstance(result["parsed"], City), (method, result)
        assert result["raw"].response_metadata["finish_reason"] in ("stop", "tool_calls")


def test_an_open_schema_lets_the_model_add_keys_until_max_tokens(stack):
    """The contrast: the same model opted into `additionalProperties: true` is held to nothing more, and
    the demo model goes on writing keys of its own until the length cuts its JSON."""
    result = (
        chat_model(stack, "upper")
        .with_structured_output(OpenCity, method="function_calling", include_raw=True)
        .invoke(PROMPT)
    )
    assert result["parsed"] is None and result["raw"].response_metadata["finish_reason"] == "length"


class Weather(BaseModel):
    """The forecast for a city."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_langchain_bind_tools_parses_the_forced_calls(stack):
    for choice in ("any", "City", "Weather"):
        message = chat_model(stack, "upper").bind_tools([City, Weather], tool_choice=choice).invoke(PROMPT)
        assert message.invalid_tool_calls == [] and message.tool_calls, (choice, message)
        for call in message.tool_calls:
            {"City": City, "Weather": Weather}[call["name"]].model_validate(call["args"])


def test_instructor_tools_and_json_schema_modes_return_the_model(stack):
    """The modes that send the schema as a constraint (a forced tool, or response_format json_schema). Its
    JSON and MD_JSON modes put the schema in the prompt alone, which only a model trained to follow it can."""
    import instructor

    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        city = patched.chat.completions.create(
            model="title",
            response_model=City,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=64,
            temperature=0,
            max_retries=0,
        )
        assert isinstance(city, City), mode


def test_a_tool_call_cut_by_max_tokens_is_still_a_call(stack):
    """`required` and a named function, cut short: the calls come back in `tool_calls`, the cut one with
    its arguments as generated, the finish reason `length`; the content holds no call text."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "City", "parameters": City.model_json_schema()}}]
    messages = [{"role": "user", "content": PROMPT}]
    for choice in ("required", {"type": "function", "function": {"name": "City"}}):
        fields = {"tools": tools, "tool_choice": choice, "temperature": 0}
        whole = client.chat.completions.create(model="upper", messages=messages, max_tokens=64, **fields)
        [call] = whole.choices[0].message.tool_calls  # the model wrote one call (and closed the list)
        jsonschema.validate(json.loads(call.function.arguments), City.model_json_schema())
        compact = json.dumps(json.loads(call.function.arguments), separators=(",", ":"), ensure_ascii=False)
        fields["max_tokens"] = whole.usage.completion_tokens - 4  # cut inside the arguments' last value
        for stream in (False, True):
            if stream:
                chunks = list(client.chat.completions.create(model="upper", messages=messages, stream=True, **fields))
                calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
                content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                answer = client.chat.completions.create(model="upper", messages=messages, **fields).choices[0]
                calls, content, finish = answer.message.tool_calls, answer.message.content or "", answer.finish_reason
            [cut] = calls
            assert (cut.function.name, finish, content) == ("City", "length", ""), (choice, stream)
            arguments = cut.function.arguments  # as generated: compact JSON, cut short
            assert compact.startswith(arguments) and len(compact) - 12 < len(arguments) < len(compact), arguments
