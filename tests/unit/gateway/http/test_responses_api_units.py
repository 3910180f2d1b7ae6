"""The Responses API's request side, without processes: what a body may ask for (`schemas.py`), and
how it maps onto a chat completion (`responses_api.chat_request`): the conversation the chat template
renders, the tools and tool choice, the output constraint, the sampling, the parameters the response
repeats, and the names failures give. `test_responses_api.py` (stack) runs the route against a real stack."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.http import responses_api
from loraserve.gateway.http.errors import RESPONSES_PARAMS, http_error
from loraserve.gateway.http.schemas import ChatCompletionRequest, NamedToolChoice, ResponsesRequest
from loraserve.gateway.http.structured import requested_constraint
from loraserve.gateway.http.tool_calling import MAX_TOOL_CALLS, tool_choice
from loraserve.gateway.tool_parsers import HermesParser
from loraserve.structured import Constraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "weather", "parameters": WEATHER}
ITEMS = [
    {"role": "developer", "content": "answer in French"},
    {"role": "user", "content": [{"type": "input_text", "text": "the quiet "}, {"type": "input_text", "text": "king"}]},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "finds", "annotations": [], "logprobs": []}],
    },
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "rome"}'},
    {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": "{}"},
]


def body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "the quiet king"} | fields)


def chat(**fields) -> ChatCompletionRequest:
    """The chat completion a Responses API body of `fields` is served as."""
    return responses_api.chat_request(body(**fields))


def test_the_conversation_is_the_instructions_then_the_items_as_chat_messages():
    conversation = chat(instructions="be brief", input=ITEMS).conversation()
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "rome"}}}
    assert conversation == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "answer in French"},  # developer: the templates' system
        {"role": "user", "content": "the quiet king"},
        {  # the calls join the assistant's message, their arguments as objects (as chat's do)
            "role": "assistant",
            "content": "finds",
            "tool_calls": [call | {"id": "call_1"}, _call("call_2", {"city": "paris"})],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_3", {})]},  # a call with no message opens one
    ]
    assert chat().conversation() == [{"role": "user", "content": "the quiet king"}]


def _call(call_id: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}


def test_the_template_renders_the_conversation_as_the_same_chat_messages():
    """The same conversation sent to chat completions renders the same prompt."""
    messages = [
        {"role": "user", "content": "the quiet king"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_1", {"city": "rome"})]},
        {"role": "tool", "content": "finds a boat", "tool_call_id": "call_1"},
    ]
    sent = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    items = [ITEMS[1], ITEMS[3] | {"call_id": "call_1"}, {**ITEMS[5], "output": "finds a boat"}]
    template = ChatTemplate.from_model_dir(DEMO_MODEL_DIR)
    rendered = template.render(chat(input=items).conversation())
    assert rendered == template.render(sent.conversation()) == "<s>the quiet king  finds a boat"


def test_tools_are_chat_tools_strict_unless_they_say_otherwise():
    tools = chat(tools=[TOOL, TOOL | {"name": "other", "strict": False}]).tools
    assert [(t.function.name, t.function.strict, t.function.parameters) for t in tools] == [
        ("weather", True, WEATHER),  # strict null: the Responses API's default, true
        ("other", False, WEATHER),
    ]
    assert chat().tools is None
    assert tool_choice(None, chat().tool_choice, None, None) is None  # no tools: text


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ("required", "required", None),
        ({"type": "function", "name": "weather"}, "function", "weather"),
        ("auto", "auto", None),
        (None, "auto", None),  # the default with tools
    ],
)
def test_tool_choice_is_chats(choice, mode, name):
    asked = chat(tools=[TOOL], tool_choice=choice)
    if name is not None:
        assert asked.tool_choice == NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})
    tools = tool_choice(asked.tools, asked.tool_choice, None, HermesParser())
    assert (tools.mode, tools.name) == (mode, name)


def test_parallel_tool_calls_and_max_tool_calls_bound_the_calls():
    asked = body(tools=[TOOL], tool_choice="required", max_tool_calls=3)
    listed = responses_api.chat_request(asked).tools
    tools = tool_choice(listed, "required", None, None, max_calls=asked.max_tool_calls)
    assert tools.constraint().value["maxItems"] == 3
    tools = tool_choice(listed, "required", False, None, max_calls=3)
    assert tools.constraint().value["maxItems"] == 1
    with pytest.raises(InvalidRequestError, match="max_tool_calls"):
        tool_choice(listed, "required", None, None, max_calls=MAX_TOOL_CALLS + 1)


@pytest.mark.parametrize(
    ("text", "constraint"),
    [
        (None, None),
        ({"format": {"type": "text"}}, None),
        ({"format": {"type": "json_object"}}, Constraint("json_object", True, "response_format")),
        (
            {"format": {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}},
            Constraint("json_schema", WEATHER, "response_format"),  # named text.format (RESPONSES_PARAMS)
        ),
        ({"verbosity": "medium"}, None),
    ],
)
def test_text_format_is_the_output_constraint(text, constraint):
    assert requested_constraint(chat(text=text).constraint_fields()) == constraint


def test_sampling_and_what_the_response_repeats():
    asked = body(
        instructions="be brief",
        temperature=0,
        max_output_tokens=9,
        metadata={"k": "v"},
        user="u",
        tools=[TOOL],
        parallel_tool_calls=False,
    )
    sampling = responses_api.chat_request(asked).sampling()
    assert (sampling["temperature"], sampling["top_p"], responses_api.chat_request(asked).new_tokens) == (0, 1.0, 9)
    assert chat().sampling() == ChatCompletionRequest(model="m", messages=[{"role": "u"}]).sampling()  # OpenAI's
    echo = responses_api.echo(asked)
    assert echo["instructions"] == "be brief" and echo["metadata"] == {"k": "v"} and echo["user"] == "u"
    assert (echo["max_output_tokens"], echo["temperature"], echo["parallel_tool_calls"]) == (9, 0, False)
    assert echo["tools"] == [TOOL | {"description": None, "strict": True}] and echo["tool_choice"] == "auto"
    assert echo["text"] == {"format": {"type": "text"}} and echo["store"] is False
    assert responses_api.echo(body())["tool_choice"] == "none"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation in input"),
        ({"conversation": "conv_1"}, "conversation", "not stored"),
        ({"store": True}, "store", "send store: false or leave it out"),
        ({"background": True}, "background", "not supported"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"truncation": "auto"}, "truncation", "never truncated"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "templates"),
        ({"top_logprobs": 2}, "top_logprobs", "log-probabilities"),
        ({"service_tier": "flex"}, "service_tier", "not supported"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options", "obfuscated"),
        ({"max_tokens": 4}, "max_tokens", "max_output_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
        ({"seed": 1}, "seed", "not supported"),  # not a Responses API parameter
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", "only function tools"),
        ({"tools": [TOOL | {"output_schema": {"type": "string"}}]}, "tools[0].output_schema", "not supported"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto"}}, "tool_choice", "allowed_tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "function tools only"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "schema": WEATHER}}}, "text.format", "needs name"),
        ({"input": []}, "input", "no items"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "not stored"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0].type",
            "text models only",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
            "input[0].output[0].type",
            "text models only",
        ),
        ({"input": [{"role": "user", "content": "x", "cache": True}]}, "input[0].cache", "not supported"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "function_call_output"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "is not a role"),
        ({"top_p": 0}, "top_p", "temperature to 0"),
    ],
)
def test_what_is_not_served_is_refused_by_name(fields, param, says):
    refused = body(**fields).unsupported()
    assert refused is not None and refused[0] == param and says in refused[1], refused


@pytest.mark.parametrize(
    "fields",
    [
        {"store": False},
        {"background": False},
        {"include": []},
        {"reasoning": {"effort": "none", "summary": None}},
        {"reasoning": {}},
        {"truncation": "disabled"},
        {"service_tier": "auto"},
        {"top_logprobs": 0},
        {"stream_options": {"include_obfuscation": False}},
        {"previous_response_id": None},
        {"text": {"format": {"type": "text"}, "verbosity": "medium"}},
        {"tools": [TOOL | {"defer_loading": False}], "tool_choice": "none"},
        {"input": [{"role": "assistant", "content": "x", "phase": "final_answer", "id": "msg_1"}]},
    ],
)
def test_what_asks_for_nothing_is_accepted(fields):
    assert body(**fields).unsupported() is None


@pytest.mark.parametrize(
    "fields",
    [
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},  # no call_id
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k": "v" * 513}},
        {"max_output_tokens": 0},
        {"tools": [{"type": "function", "name": "bad name"}]},
    ],
)
def test_malformed_bodies_fail_validation(fields):
    with pytest.raises(ValidationError):
        body(**fields)


def test_failures_name_the_responses_api_parameters():
    def named(field: str, why: str) -> tuple[str, str]:
        error = http_error(InvalidRequestError(field, why), RESPONSES_PARAMS).body["error"]
        return error["param"], error["message"]

    assert named("max_new_tokens", "must be at most 10") == (
        "max_output_tokens",
        "max_output_tokens: must be at most 10",
    )
    assert named("messages", "roles must alternate") == ("input", "input: roles must alternate")
    assert named("prompt.token_ids", "too long") == ("input", "input: too long")
    assert named("sampling.temperature", "too hot") == ("temperature", "temperature: too hot")
    assert named("response_format", "bad schema") == ("text.format", "text.format: bad schema")
    refused = body(max_tokens=4).unsupported()  # chat's name, sent here: named as sent
    assert refused == ("max_tokens", "is not a Responses API parameter: send max_output_tokens")
    assert named(*refused) == ("max_tokens", "max_tokens: is not a Responses API parameter: send max_output_tokens")
