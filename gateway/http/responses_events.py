"""The Responses API's answers, written from the generation core's events (its one generation's `Chunk`s,
then its `Summary`): the `response` object, its output items, and a stream's events, in the shapes the
README's "POST /v1/responses" lists.

A response is "incomplete" (`incomplete_details.reason` "max_output_tokens") when that length cut the
output, else "completed", and repeats the request's parameters as they took effect (`responses_api.echo`).
Its output is one `message` item holding one `output_text` part; with tools in use (`tool_calling.py`)
the text is parsed: what is not a call (if anything) is the message, then a `function_call` item per call
(one cut short keeps its arguments as generated, and the last item of a cut response is "incomplete").
A stream's events are numbered by `sequence_number` from 0, with no `[DONE]`; its text is sent as it
comes, or with tools in use whole at the end (a call is parsed from all of it). A failure after the
stream began is one `error` event, which ends it; failures name the Responses API's parameters
(`errors.RESPONSES_PARAMS`).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.http import responses_api
from loraserve.gateway.http.answering import Generation
from loraserve.gateway.http.errors import RESPONSES_PARAMS, HttpError, http_error
from loraserve.gateway.http.schemas import ResponsesRequest
from loraserve.gateway.http.tool_calling import ToolChoice
from loraserve.gateway.tool_parsers import call_id

INCOMPLETE = "length"  # the finish reason that makes a response incomplete (max_output_tokens)


def item_id(kind: str) -> str:
    """A fresh output item id: `msg_` (a message) or `fc_` (a function call) and 32 hex digits."""
    return f"{kind}_{uuid.uuid4().hex}"


def usage(summary: Summary) -> dict[str, Any]:
    return {
        "input_tokens": summary.prompt_tokens,
        "input_tokens_details": {"cached_tokens": summary.cached_tokens},
        "output_tokens": summary.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": summary.prompt_tokens + summary.completion_tokens,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(frozen=True)
class Reply:
    """The answer to one Responses API request (`body`). `tools`: the tool choice in use (the text is parsed
    into calls), or None."""

    id: str
    body: ResponsesRequest
    tools: ToolChoice | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: item_id("msg"))

    @functools.cached_property
    def echo(self) -> dict[str, Any]:
        """The request's parameters as the response repeats them (`responses_api.echo`)."""
        return responses_api.echo(self.body)

    @property
    def buffered(self) -> bool:
        """A stream whose text is sent whole at its end (calls are parsed from all of it)."""
        return self.tools is not None

    def error(self, exc: BaseException, retry_after_s: float | None = None) -> HttpError:
        return http_error(exc, RESPONSES_PARAMS, retry_after_s)

    def response(self, output: list[dict[str, Any]] | None = None, summary: Summary | None = None) -> dict[str, Any]:
        """The response object: in progress (no `summary` yet), else finished with `output`."""
        status = "in_progress" if summary is None else _status(summary)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.body.model,
            "output": output or [],
            "usage": None if summary is None else usage(summary),
            **self.echo,
        }

    def output(self, text: str, summary: Summary) -> list[dict[str, Any]]:
        """The output items of the whole generated `text`."""
        if self.tools is None:
            items = [self.message(text)]
        else:
            parsed = self.tools.parse(text, cut=summary.finish_reason == INCOMPLETE)
            items = [] if parsed.content is None else [self.message(parsed.content)]
            items += [function_call(c.name, c.arguments) for c in parsed.tool_calls]
            items = items or [self.message("")]
        if _status(summary) == "incomplete":
            items[-1] = items[-1] | {"status": "incomplete"}
        return items

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [text_part(text)] if status != "in_progress" else []
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status, "content": content}

    def whole(self, results: list[tuple[Chunk, Summary]]) -> dict[str, Any]:
        """The non-streamed answer (of its one generation)."""
        [(chunk, summary)] = results
        return self.response(self.output(chunk.text, summary), summary)

    def stream(self, firsts: list[Event], generations: list[Generation]) -> AsyncIterator[bytes]:
        """The SSE stream, from the generation's first event on (`GenerationStream` stops it after it)."""
        return ResponseEvents(self).stream(firsts[0], generations[0])


def function_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id(),
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _status(summary: Summary) -> str:
    return "incomplete" if summary.finish_reason == INCOMPLETE else "completed"


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are made."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        numbered = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return numbered

    def opening(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`, then (text sent as it comes) the message's first events."""
        snapshot = self.reply.response()
        events = [self.event(f"response.{kind}", response=snapshot) for kind in ("created", "in_progress")]
        return events if self.reply.buffered else events + self.message_opening(0)

    def message_opening(self, index: int) -> list[dict[str, Any]]:
        """A message's first events (output item `index`), before its text."""
        place = {"item_id": self.reply.message_id, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=self.reply.message("", "in_progress")),
            self.event("response.content_part.added", **place, content_index=0, part=text_part("")),
        ]

    def text_delta(self, index: int, delta: str) -> dict[str, Any]:
        place = {"item_id": self.reply.message_id, "output_index": index, "content_index": 0}
        return self.event("response.output_text.delta", **place, delta=delta, logprobs=[])

    def message_closing(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A message's last events, once its text (`item`'s) is whole."""
        place = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text = item["content"][0]["text"]
        return [
            self.event("response.output_text.done", **place, text=text, logprobs=[]),
            self.event("response.content_part.done", **place, part=text_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def whole_item(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        """Every event of output item `index`, whose content is known whole (a buffered stream's), in order."""
        if item["type"] == "message":
            events = self.message_opening(index)
            text = item["content"][0]["text"]
            if text:
                events.append(self.text_delta(index, text))
            return events + self.message_closing(index, item)
        place = {"item_id": item["id"], "output_index": index}
        opened = item | {"arguments": "", "status": "in_progress"}
        events = [self.event("response.output_item.added", output_index=index, item=opened)]
        if item["arguments"]:
            events.append(self.event("response.function_call_arguments.delta", **place, delta=item["arguments"]))
        return [
            *events,
            self.event(
                "response.function_call_arguments.done", **place, name=item["name"], arguments=item["arguments"]
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def settled(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events once the text is whole: the streamed message's last ones, or every item's (buffered)."""
        if not self.reply.buffered:
            return self.message_closing(0, output[0])
        return [event for index, item in enumerate(output) for event in self.whole_item(index, item)]

    def closing(self, output: list[dict[str, Any]], summary: Summary) -> dict[str, Any]:
        """`response.completed` (or `response.incomplete`) with the whole response."""
        response = self.reply.response(output, summary)
        return self.event(f"response.{response['status']}", response=response)

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The event of a failure after the stream began."""
        error = self.reply.error(exc).body["error"]
        return self.event("error", code=error["code"] or error["type"], message=error["message"], param=error["param"])

    async def stream(self, first: Event, generation: Generation) -> AsyncIterator[bytes]:
        """The SSE stream of `generation`, from its `first` event on."""
        try:
            for event in self.opening():
                yield sse(event)
            texts, event = [], first
            while not isinstance(event, Summary):
                texts.append(event.text)
                if event.text and not self.reply.buffered:
                    yield sse(self.text_delta(0, event.text))
                event = await generation.next()
            output = self.reply.output("".join(texts), event)
            for made in [*self.settled(output), self.closing(output, event)]:
                yield sse(made)
        except Exception as e:  # after the status line: the failure goes in the stream, and ends it
            yield sse(self.error(e))


def sse(event: dict[str, Any]) -> bytes:
    """An event as SSE: its type as the event name, then its data."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
