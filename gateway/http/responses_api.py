"""A Responses API request (`schemas.ResponsesRequest`) as a chat completion (`chat_request`): the route
(`app.py`) renders, constrains and generates it exactly as it does a chat completion.

`instructions` becomes a system message, then `input`'s items are chat messages in order (`developer`
becomes `system`; a `function_call` joins the assistant message before it as one of its `tool_calls`; a
`function_call_output` is a `tool` message). The response repeats the parameters as they took effect
(`echo`).
"""

from __future__ import annotations

from typing import Any

from loraserve.gateway.http.schemas import (
    DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionDefinition,
    FunctionName,
    FunctionTool,
    NamedToolChoice,
    ResponsesRequest,
    Tool,
    text_of,
)

ROLES = {"developer": "system"}  # a Responses API role -> the chat template's


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """`body` (which `unsupported()` found nothing to refuse in) as the chat completion it asks for."""
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    text_format = body.text_format()
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=None if body.tools is None else [Tool(type="function", function=f) for f in functions(body)],
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=None if text_format is None else text_format.chat_format(),
        user=body.user,
    )


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


def functions(body: ResponsesRequest) -> list[FunctionDefinition]:
    """The function tools as chat's functions, each strict unless it says `strict: false`."""
    fields = set(FunctionDefinition.model_fields)
    return [
        FunctionDefinition(**t.model_dump(include=fields) | {"strict": t.strict is not False})
        for t in body.tools or ()
        if isinstance(t, FunctionTool)
    ]


def echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters as the response repeats them: as they took effect (defaults filled in)."""
    text_format, choice = body.text_format(), body.tool_choice or ("auto" if body.tools else "none")
    shown_format = text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
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
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": shown_format},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
        "tools": [{"type": "function", **f.model_dump()} for f in functions(body)],
        "truncation": "disabled",
        "user": body.user,
    }
