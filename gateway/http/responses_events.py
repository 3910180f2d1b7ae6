"""The Responses API's answers, written from the generation core's events (its one generation's `Chunk`s,
then its `Summary`): the `response` object, its output items, and a stream's events, in the shapes the
README's "POST /v1/responses" lists.

The output is one `message` item; with tools in use (`tool_calling.py`) the text is parsed: what is not
a call (if anything) is the message, then a `function_call` item per call. A response cut by
`max_output_tokens` is "incomplete" (its last item too); it repeats the request's parameters as they
took effect (`responses_api.echo`). A stream's events are numbered by `sequence_number`; its text is
sent as it comes, or with tools in use whole at the end; a failure after it began is one `error` event.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.http import responses, responses_api
from loraserve.gateway.http.answering import Generation
from loraserve.gateway.http.errors import RESPONSES_PARAMS, http_error
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


@dataclass(frozen=True)
class Reply:
    """The answer to one Responses API request (`body`), whole or as a stream's events (one stream per reply:
    it numbers them). `tools`: the tool choice in use (the text is parsed into calls), or None."""

    id: str
    body: ResponsesRequest
    tools: ToolChoice | None = None
    params: ClassVar[dict[str, str]] = RESPONSES_PARAMS  # failures name the Responses API's parameters
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: item_id("msg"))
    _sequence: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False, compare=False)

    @property
    def buffered(self) -> bool:
        """A stream whose text is sent whole at its end (calls are parsed from all of it)."""
        return self.tools is not None

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
            **responses_api.echo(self.body),
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

    # ---- a stream's events, numbered in the order they are made ------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    def opening(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`, then (text sent as it comes) the message's first events."""
        snapshot = self.response()
        events = [self.event(f"response.{kind}", response=snapshot) for kind in ("created", "in_progress")]
        return events if self.buffered else events + self.message_opening(0)

    def message_opening(self, index: int) -> list[dict[str, Any]]:
        """A message's first events (output item `index`), before its text."""
        place = {"item_id": self.message_id, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=self.message("", "in_progress")),
            self.event("response.content_part.added", **place, content_index=0, part=text_part("")),
        ]

    def text_delta(self, index: int, delta: str) -> dict[str, Any]:
        place = {"item_id": self.message_id, "output_index": index, "content_index": 0}
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
        place, arguments = {"item_id": item["id"], "output_index": index}, item["arguments"]
        opened = item | {"arguments": "", "status": "in_progress"}
        return [  # made in order: their sequence numbers
            self.event("response.output_item.added", output_index=index, item=opened),
            *([self.event("response.function_call_arguments.delta", **place, delta=arguments)] if arguments else []),
            self.event("response.function_call_arguments.done", **place, name=item["name"], arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def settled(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events once the text is whole: the streamed message's last ones, or every item's (buffered)."""
        if not self.buffered:
            return self.message_closing(0, output[0])
        return [event for index, item in enumerate(output) for event in self.whole_item(index, item)]

    def closing(self, output: list[dict[str, Any]], summary: Summary) -> dict[str, Any]:
        """`response.completed` (or `response.incomplete`) with the whole response."""
        response = self.response(output, summary)
        return self.event(f"response.{response['status']}", response=response)

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The event of a failure after the stream began."""
        error = http_error(exc, self.params).body["error"]
        return self.event("error", code=error["code"] or error["type"], message=error["message"], param=error["param"])

    async def stream(self, firsts: list[Event], generations: list[Generation]) -> AsyncIterator[bytes]:
        """The SSE stream of the one generation, from its first event on (`GenerationStream` stops it after it)."""
        try:
            for event in self.opening():
                yield sse(event)
            texts, event, generation = [], firsts[0], generations[0]
            while not isinstance(event, Summary):
                texts.append(event.text)
                if event.text and not self.buffered:
                    yield sse(self.text_delta(0, event.text))
                event = await generation.next()
            output = self.output("".join(texts), event)
            for made in [*self.settled(output), self.closing(output, event)]:
                yield sse(made)
        except Exception as e:  # after the status line: the failure goes in the stream, and ends it
            yield sse(self.error(e))


def sse(event: dict[str, Any]) -> bytes:
    """An event as SSE: its type as the event name, then its data (as chat's, `responses.sse`)."""
    return f"event: {event['type']}\n".encode() + responses.sse(event)
