"""OpenAI's Responses API (`POST /v1/responses`) end to end: one real stack, driven by the official `openai`
client (`responses.create`, `responses.stream`, `responses.parse`) and LangChain's `use_responses_api`.

The demo model continues text, and its chat template joins the turns' text, so a greedy response must be
what `/v1/chat/completions` answers for the same conversation. Outputs are short (the model seldom ends
on its own): most responses are cut by `max_output_tokens`, which makes them `incomplete`; constrained
ones (a forced call, a JSON schema) end with their grammar, `completed`.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from stack import http_stack

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
BASE = DEMO_MODEL_DIR.name
PROMPT = "the quiet king"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "weather", "description": "the weather in a city", "parameters": WEATHER}]


class Verdict(BaseModel):
    kind: Literal["yes", "no"]


@pytest.fixture(scope="module")
def stack():
    with http_stack(tool_call_parser="hermes") as stack:
        yield stack


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_answer(stack, messages: list[dict], max_tokens: int) -> openai.types.chat.ChatCompletion:
    return client(stack).chat.completions.create(model=BASE, messages=messages, temperature=0, max_tokens=max_tokens)


def tokenized(stack, messages: list[dict]) -> int:
    """The prompt tokens /tokenize counts for `messages`, rendered as chat renders them."""
    body = json.dumps({"model": BASE, "messages": messages}).encode()
    request = urllib.request.Request(f"{stack.http_url}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["count"]


def test_greedy_text_is_what_chat_completions_answers_whole_and_streamed(stack):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    chat = chat_answer(stack, messages, 12)
    asked = dict(model=BASE, instructions="be brief", input=PROMPT, temperature=0, max_output_tokens=12)
    whole = client(stack).responses.create(**asked, metadata={"run": "1"}, user="someone")
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # cut at 12
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    assert (whole.metadata, whole.instructions, whole.user, whole.temperature) == (
        {"run": "1"},
        "be brief",
        "someone",
        0,
    )
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")

    events = list(client(stack).responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == chat.choices[0].message.content
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_max_output_tokens_makes_the_response_incomplete(stack):
    response = client(stack).responses.create(model=BASE, input=PROMPT, temperature=0, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "weather"}])
def test_a_forced_call_has_arguments_valid_against_its_schema(stack, choice):
    asked = dict(model=BASE, input=PROMPT, tools=TOOLS, tool_choice=choice, temperature=0, max_output_tokens=48)
    response = client(stack).responses.create(**asked, parallel_tool_calls=False)
    assert response.status == "completed", response
    (call,) = response.output  # one call (no parallel calls), no text
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    events = list(client(stack).responses.create(**asked, max_tool_calls=1, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == done.arguments


def test_auto_answers_text_as_a_message_whole_and_streamed_alike(stack):
    """Under `auto` (strict tools: the hermes grammar) the demo model writes text; a stream holds it back
    and sends it whole at the end, as it would calls."""
    asked = dict(model=BASE, input=PROMPT, tools=TOOLS, temperature=0, max_output_tokens=8)
    whole = client(stack).responses.create(**asked)
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    events = list(client(stack).responses.create(**asked, stream=True))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [whole.output_text]
    assert events[-1].response.output_text == whole.output_text


def test_parse_answers_a_pydantic_model_whole_and_streamed(stack):
    asked = dict(model=BASE, input=PROMPT, temperature=0, max_output_tokens=24)
    parsed = client(stack).responses.parse(**asked, text_format=Verdict)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    with client(stack).responses.stream(**asked, text_format=Verdict) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_earlier_calls_and_their_outputs_reach_the_template(stack):
    arguments = '{"city": "rome"}'
    items = [
        {"role": "user", "content": PROMPT},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "finds a boat"},
    ]
    messages = [
        {"role": "user", "content": PROMPT},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "finds a boat"},
    ]
    response = client(stack).responses.create(model=BASE, input=items, temperature=0, max_output_tokens=8)
    assert response.usage.input_tokens == tokenized(stack, messages) > tokenized(stack, messages[:1])
    assert response.output_text == chat_answer(stack, messages, 8).choices[0].message.content


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("previous_response_id", "resp_123", "previous_response_id"),
        ("tools", [{"type": "web_search"}], "tools[0].type"),
        ("store", True, "store"),
        ("reasoning", {"effort": "high"}, "reasoning"),
    ],
)
def test_what_is_not_served_is_refused_by_name(stack, field, value, named):
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack).responses.create(model=BASE, input=PROMPT, max_output_tokens=4, **{field: value})
    assert refused.value.status_code == 400 and refused.value.body["param"] == named
    if field == "previous_response_id":
        assert "input" in refused.value.message


def test_langchain_chat_openai_speaks_the_responses_api(stack):
    expected = chat_answer(stack, [{"role": "user", "content": PROMPT}], 8).choices[0].message.content
    assert chat_model(stack, 8).invoke(PROMPT).text == expected
    assert "".join(chunk.text for chunk in chat_model(stack, 8).stream(PROMPT)) == expected
    forced = chat_model(stack, 24).bind_tools([TOOLS[0]], tool_choice="weather").invoke(PROMPT)
    (call,) = forced.tool_calls
    assert call["name"] == "weather" and forced.response_metadata["status"] == "completed"
    jsonschema.validate(call["args"], WEATHER)


def chat_model(stack, max_tokens: int):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=BASE,
        base_url=f"{stack.http_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        use_responses_api=True,
    )
