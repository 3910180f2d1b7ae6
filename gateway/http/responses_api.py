"""A Responses API request (`responses_schema.py`) as the chat path's pieces: the route (`app.py`) renders,
constrains and generates it exactly as it does a chat completion.

- The conversation: `instructions` first, as a system message; then `input`'s items in order, as chat
  messages (`schemas.ChatMessage`, rendered by the model's chat template as chat's `messages` are): a
  message keeps its role (`developer` becomes `system`: chat templates know no developer role) and its
  text; a `function_call` joins the assistant message just before it (or opens one) as one of its
  `tool_calls`, and a `function_call_output` is a `tool` message answering its `call_id`.
- Tools: each function tool as chat's (`schemas.Tool`), `strict` null read as true (the Responses API's
  default); `tool_choice` as chat's, `{"type": "function", "name": N}` as a named function; with
  `parallel_tool_calls` and `max_tool_calls` (`tool_calling.tool_choice`'s `max_calls`).
- `text.format` as chat's `response_format` (`structured.requested_constraint`), its field `text.format`.
- Sampling: `temperature` (OpenAI's default 1; 0 is greedy) and `top_p`; `max_output_tokens` bounds the output.
- What the response repeats (`echo`): the parameters as they took effect.
- A failure names the Responses API's parameters (`renamed`): `max_output_tokens` where chat's would name
  `max_tokens`, `input` where it would name `messages`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loraserve.gateway.http.errors import HttpError
from loraserve.gateway.http.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    ResponsesRequest,
    TextFormat,
    text_of,
)
from loraserve.gateway.http.schemas import (
    DEFAULT_TEMPERATURE,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    conversation,
)
from loraserve.gateway.http.structured import requested_constraint
from loraserve.structured import Constraint

RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}  # chat's parameter -> the Responses API's
ROLES = {"developer": "system"}  # a Responses API role -> the chat template's


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation as chat messages: the instructions, then the input's items."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    for item in body.input_items():
        if isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=text_of(item.output), tool_call_id=item.call_id))
        else:
            messages.append(ChatMessage(role=ROLES.get(item.role, item.role), content=text_of(item.content)))
    return messages


def chat_conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it (`schemas.conversation`, as chat's messages)."""
    return conversation(chat_messages(body))


def chat_tools(body: ResponsesRequest) -> list[Tool] | None:
    """The function tools as chat's, each strict unless it says `strict: false`."""
    if body.tools is None:
        return None
    return [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict is not False
            ),
        )
        for t in body.function_tools()
    ]


def chat_tool_choice(body: ResponsesRequest) -> str | NamedToolChoice | None:
    """`tool_choice` as chat's."""
    if isinstance(body.tool_choice, FunctionChoice):
        return NamedToolChoice(type="function", function=FunctionName(name=body.tool_choice.name))
    return body.tool_choice  # type: ignore[return-value]  # another object is refused by unsupported()


def text_constraint(body: ResponsesRequest) -> Constraint | None:
    """The structured output `text.format` asks for (None for `text`), naming `text.format`."""
    text_format = body.text_format()
    if text_format is None:
        return None
    constraint = requested_constraint({"response_format": text_format.chat_format()})
    return None if constraint is None else replace(constraint, field="text.format")


def sampling(body: ResponsesRequest) -> dict[str, Any]:
    """The sampling fields, by their `SamplingParams` names."""
    return {
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
    }


def echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters as the response repeats them: as they took effect (defaults filled in)."""
    tools = chat_tools(body) or []
    text_format = body.text_format()
    fields = sampling(body)
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "background": False,
        "temperature": fields["temperature"],
        "top_p": fields["top_p"],
        "text": {"format": {"type": "text"} if text_format is None else _format_echo(text_format)},
        "tool_choice": _choice_echo(body),
        "tools": [{"type": "function", **t.function.model_dump()} for t in tools],
        "truncation": "disabled",
        "user": body.user,
    }


def _format_echo(text_format: TextFormat) -> dict[str, Any]:
    return text_format.model_dump(by_alias=True, exclude_none=True)


def _choice_echo(body: ResponsesRequest) -> str | dict[str, Any]:
    if isinstance(body.tool_choice, FunctionChoice):
        return body.tool_choice.model_dump()
    return body.tool_choice or ("auto" if body.tools else "none")


def renamed(error: HttpError) -> HttpError:
    """`error` naming the Responses API's parameter where the chat path named its own."""
    detail = error.body["error"]
    param = RENAMED.get(detail.get("param") or "")
    if param is None:
        return error
    message = detail["message"]
    if message.startswith(f"{detail['param']}:"):
        message = param + message[len(detail["param"]) :]
    return HttpError(error.status, {"error": detail | {"message": message, "param": param}}, error.headers)
