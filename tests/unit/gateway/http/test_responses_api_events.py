"""The Responses API's answers, without processes: the response object and the stream's events
(`responses_events.py`, `Reply.stream` over scripted generations) are what the
`openai` SDK's typed models accept, and a stream, accumulated by the SDK's own stream state (what
`responses.stream()` runs), ends with the response a whole answer gives for the same generation."""

from __future__ import annotations

import asyncio
import json
from typing import Any, get_args

import pytest
from openai import Omit, omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, ValidationError
from test_openai_streams import Scripted, piece, summary

from loraserve.errors import InvalidRequestError
from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.http import responses_api
from loraserve.gateway.http.responses_events import Reply
from loraserve.gateway.http.schemas import ResponsesRequest
from loraserve.gateway.http.tool_calling import tool_choice
from loraserve.gateway.tool_parsers import HermesParser

TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {"city": {}}}}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "rome"}}\n</tool_call>'
EVENTS = {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])}


def typed(kind: type[BaseModel], value: dict[str, Any]) -> Any:
    """`value` strictly validated as the SDK's `kind`. The one field loraserve leaves out is
    `usage.input_tokens_details.cache_write_tokens`: it does not know which prompt tokens the cache kept."""
    try:
        return kind.model_validate(value)
    except ValidationError as e:
        others = [error for error in e.errors() if error["loc"][-2:] != ("input_tokens_details", "cache_write_tokens")]
        assert not others, others
    return construct_type(type_=kind, value=value)


def reply(**fields) -> Reply:
    body = ResponsesRequest.model_validate({"model": "m", "input": "the quiet king"} | fields)
    chat = responses_api.chat_request(body)
    tools = tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls, HermesParser())
    return Reply("resp_1", body, tools)


def answered(answer: Reply, text: str, ended: Summary) -> dict[str, Any]:
    """The non-streamed answer of a generation of `text`."""
    return answer.whole([(Chunk(text), ended)])


def streamed(answer: Reply, script: list[Event | Exception]) -> list[dict[str, Any]]:
    """The stream's events, checked against the SSE framing: `event: TYPE`, then its data."""

    async def run() -> list[bytes]:
        generation = Scripted(script)
        generation.next = _raising(generation.next)
        return [frame async for frame in answer.stream([await generation.next()], [generation])]

    out = []
    for frame in asyncio.run(run()):
        name, data = frame.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    for event in out:
        typed(EVENTS[event["type"]], event)
    return out


def _raising(read):
    async def next_event():
        item = await read()
        if isinstance(item, Exception):
            raise item
        return item

    return next_event


class Counted(BaseModel):
    a: int


def accumulated(stream: list[dict[str, Any]], text_format: type[BaseModel] | Omit = omit) -> Any:
    """The final response the SDK's `responses.stream()` makes of `stream` (None without response.completed)."""
    state = ResponseStreamState(input_tools=[TOOL | {"strict": True}], text_format=text_format)
    for event in stream:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return state._completed_response


def unparsed(value: Any) -> Any:
    """`value` without the fields the SDK's parsing adds (`parsed`)."""
    if isinstance(value, dict):
        return {k: unparsed(v) for k, v in value.items() if k != "parsed"}
    return [unparsed(v) for v in value] if isinstance(value, list) else value


def pieces(*texts: str, reason: str = "stop") -> list[Event]:
    return [*(piece(t) for t in texts), summary(reason, 4, len(texts), 2)]


def test_a_whole_answer_is_an_sdk_response():
    answer = reply(metadata={"k": "v"}, instructions="be brief", max_output_tokens=9)
    whole = answered(answer, '{"a": 1}', summary("stop", 4, 3, 2))
    response = typed(Response, whole)
    assert response.output_text == '{"a": 1}' and response.status == "completed"
    assert response.usage.input_tokens_details.cached_tokens == 2 and response.usage.total_tokens == 7
    assert (response.metadata, response.instructions, response.max_output_tokens) == ({"k": "v"}, "be brief", 9)
    assert response.output[0].id == answer.message_id and response.incomplete_details is None
    cut = typed(Response, answered(answer, "the quiet", summary("length", 4, 9)))
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.output[0].status == "incomplete"
    assert cut.completed_at is None


def test_text_streams_as_it_comes_and_ends_as_the_whole_answer():
    answer = reply(text={"format": {"type": "json_object"}})
    stream = streamed(answer, pieces('{"a"', ": 1", "}"))
    assert [e["type"] for e in stream] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in stream if e["type"].endswith(".delta")] == ['{"a"', ": 1", "}"]
    assert stream[0]["response"]["status"] == "in_progress" and stream[0]["response"]["output"] == []
    assert accumulated(stream, Counted).output_parsed == Counted(a=1)  # responses.stream(text_format=...)
    whole = typed(Response, answered(answer, '{"a": 1}', summary("stop", 4, 3, 2)))
    final = accumulated(stream).model_dump(exclude={"completed_at"})
    assert unparsed(final) == whole.model_dump(exclude={"completed_at"})


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    stream = streamed(reply(), pieces("the", " quiet", reason="length"))
    assert stream[-1]["type"] == "response.incomplete" and stream[-2]["item"]["status"] == "incomplete"
    assert stream[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert accumulated(stream) is None  # as OpenAI's: responses.stream() finds no response.completed


def test_with_tools_the_text_is_parsed_into_a_message_and_calls_sent_at_the_end():
    answer = reply(tools=[TOOL], tool_choice="auto", parallel_tool_calls=True)
    text = "it rains " + CALL + "\n" + CALL
    whole = typed(Response, answered(answer, text, summary("stop", 4, 30)))
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output[0].content[0].text == "it rains" and whole.output[1].arguments == '{"city": "rome"}'
    assert whole.output[1].call_id != whole.output[2].call_id and whole.output[1].id.startswith("fc_")

    stream = streamed(answer, pieces("it rains ", CALL[:20], CALL[20:] + "\n" + CALL))
    kinds = [e["type"] for e in stream]
    assert kinds.count("response.output_text.delta") == 1  # held back, then sent whole
    assert kinds[-9:] == [
        *["response.output_item.added", "response.function_call_arguments.delta"],
        *["response.function_call_arguments.done", "response.output_item.done"],
        *["response.output_item.added", "response.function_call_arguments.delta"],
        *["response.function_call_arguments.done", "response.output_item.done"],
        "response.completed",
    ]
    final = accumulated(stream)
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    assert final.output[1].parsed_arguments == {"city": "rome"}  # a strict tool's, parsed by the SDK


def test_a_call_cut_by_max_output_tokens_is_a_call_with_its_arguments_as_generated():
    answer = reply(tools=[TOOL], tool_choice={"type": "function", "name": "weather"})
    whole = typed(Response, answered(answer, '{"city": "ro', summary("length", 4, 5)))
    (call,) = whole.output
    assert (call.type, call.arguments, call.status, whole.status) == (
        "function_call",
        '{"city": "ro',
        "incomplete",
        "incomplete",
    )


def test_a_failure_after_the_stream_began_is_an_error_event_that_ends_it():
    stream = streamed(reply(), [piece("the"), InvalidRequestError("max_new_tokens", "is too many")])
    assert stream[-1] == {
        "type": "error",
        "sequence_number": len(stream) - 1,
        "code": "invalid_request_error",
        "message": "max_output_tokens: is too many",
        "param": "max_output_tokens",
    }
    assert stream[-2]["type"] == "response.output_text.delta"


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_answer_is_an_empty_message(text):
    answer = reply(tools=[TOOL], tool_choice="auto")
    response = typed(Response, answered(answer, text, summary("stop", 4, 1)))
    assert [item.type for item in response.output] == ["message"] and response.output_text == ""
