"""OpenAI-shaped answers of completions and chat completions, written from the generation core's events
(`Chunk`s, then a `Summary`): whole completions, stream chunks and their SSE framing (the README's
"POST /v1/completions" says what a client sees).

A stream is `data: <json>` events ending with `data: [DONE]` (a failure after its start: one `error`
event before it). Several generations' chunks interleave, each choice with its `index` (the prompt's
place × n + the choice's); the usage counts each prompt's tokens once and every generation's (best_of:
every candidate's). Most chunks hold text alone, written into a template of their choice's chunk
(`Answers.text_piece`) rather than encoded whole per token. With tools in use (`tool_calling.py`) a
streamed answer's text is held back and sent whole at the end, with its calls, which are parsed from
the whole text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring_ascii
from typing import Any

from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.http.answering import Generation, merged
from loraserve.gateway.http.errors import CHAT_PARAMS, PARAMS, http_error
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.gateway.http.tool_calling import ToolChoice, tool_calls_json

DONE = b"data: [DONE]\n\n"
HOLE = "\x00text\x00"  # where a piece's text goes in its chunk's template (`Answers.text_piece`)
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length"}  # loraserve's -> OpenAI's


def finish_reason(summary: Summary) -> str:
    """OpenAI's finish reason for how a generation ended (one it has no name for: "stop")."""
    return FINISH_REASONS.get(summary.finish_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def summed_usage(summaries: Sequence[Summary], per_prompt: int = 1) -> dict[str, Any]:
    """The usage of generations together (`summaries` in prompt order, `per_prompt` of each): every
    generation's completion tokens, and each prompt's tokens once (its choices share it)."""
    firsts = summaries[::per_prompt]
    completion = sum(s.completion_tokens for s in summaries)
    return usage(sum(s.prompt_tokens for s in firsts), completion, sum(s.cached_tokens for s in firsts))


def best_of(results: list[tuple[Chunk, Summary]], candidates: int, n: int) -> list[tuple[Chunk, Summary]]:
    """Of each prompt's `candidates` results (consecutive), the `n` with the highest log-probability
    (the sum of their tokens'), likeliest first; all of them, in order, when there are only n."""
    if candidates == n:
        return results
    kept = []
    for start in range(0, len(results), candidates):
        block = results[start : start + candidates]
        kept += sorted(block, key=lambda result: -sum(e.logprob for e in result[0].logprobs))[:n]
    return kept


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Answers:
    """The answers of one completions or chat completions request (`body`)."""

    id: str
    body: CompletionRequest | ChatCompletionRequest
    logprobs: LogprobFormat | None = None  # None: not asked for
    echo: Sequence[str] | None = None  # completions with echo: each choice's prompt text
    tools: ToolChoice | None = None  # chat with tools in use: the text is parsed into tool calls
    created: int = field(default_factory=lambda: int(time.time()))
    _templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def params(self) -> dict[str, str]:
        return CHAT_PARAMS if self.chat else PARAMS

    def whole(self, results: list[tuple[Chunk, Summary]]) -> dict[str, Any]:
        """The non-streaming answer to one or several prompts: choice i is the i-th kept result (prompt
        i // n's), the usage every generation's (best_of: every candidate's, not only the kept)."""
        choices = []
        for index, (kept, ended) in enumerate(best_of(results, self.body.candidates, self.body.choices)):
            chunk, summary = self.shown(kept), self.shown(ended)
            text, reason = self._echo(index) + chunk.text, finish_reason(summary)
            if self.tools is not None:
                message, reason = self._with_tool_calls(text, reason)
                content: dict[str, Any] = {"message": message}
            else:
                content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            logprobs = self._logprobs(chunk, index, True)
            choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": reason})
        total = summed_usage([self.shown(s) for _, s in results], self.body.candidates)
        return self._object(self.chat and "chat.completion", choices) | {"usage": total}

    def shown(self, event: Event) -> Event:
        """`event` as the answer shows it: with `prompt_only`, the prompt's log-probabilities alone, and
        a `length` finish with no completion tokens."""
        if not self.body.prompt_only:
            return event
        if isinstance(event, Summary):
            return replace(event, finish_reason="length", completion_tokens=0)
        return replace(event, text="", token_ids=(), logprobs=())

    def opening(self, first: Event, index: int = 0) -> dict[str, Any] | None:
        """The chunk before any text of choice `index` (chat: the assistant's role), or None; `first`:
        the choice's first event (its prompt's usage, nothing generated yet)."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, index, first, 0)

    def piece(self, chunk: Chunk, index: int = 0, first: bool = False, generated: int = 0) -> dict[str, Any]:
        """The chunk of a piece of choice `index`'s text; `first`: its first (which an echo begins);
        `generated`: the choice's tokens so far."""
        text = self._echo(index) + chunk.text if first else chunk.text
        sent = self._chunk({"content": text} if self.chat else text, None, index, chunk, generated)
        sent["choices"][0]["logprobs"] = self._logprobs(chunk, index, first)
        return sent

    def text_piece(self, text: str, index: int = 0) -> bytes:
        """`piece`'s SSE event for text alone (not the first piece, no log-probabilities, no usage so far):
        the chunk encoded once per choice around a hole for the text, which alone is encoded per token
        (as `json.dumps` encodes it)."""
        template = self._templates.get(index)
        if template is None:
            head, _, tail = sse(self.piece(Chunk(HOLE), index)).rpartition(encode_basestring_ascii(HOLE).encode())
            template = self._templates[index] = head, tail
        return template[0] + encode_basestring_ascii(text).encode() + template[1]

    def closing(self, summary: Summary, index: int = 0, first: bool = False) -> dict[str, Any]:
        """The chunk with choice `index`'s finish reason; `first`: no piece of it was sent (which an echo begins)."""
        text = self._echo(index) if first else ""
        return self._chunk({} if self.chat else text, finish_reason(summary), index, summary, summary.completion_tokens)

    def settled(self, chunk: Chunk, summary: Summary, index: int = 0) -> list[dict[str, Any]]:
        """A stream of tool calls' last chunks: its whole text as content and tool calls (each call with its
        `index`), then the finish reason."""
        message, reason = self._with_tool_calls(chunk.text, finish_reason(summary))
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        for i, call in enumerate(delta.get("tool_calls", ())):
            call["index"] = i
        sent = self._chunk(delta, None, index, summary, summary.completion_tokens)
        sent["choices"][0]["logprobs"] = self._logprobs(chunk, index, True)
        return [sent, self._chunk({}, reason, index, summary, summary.completion_tokens)]

    def usage(self, summaries: Sequence[Summary]) -> dict[str, Any]:
        """The include_usage chunk: no choices, the choices' summed usage."""
        total = summed_usage(summaries, self.body.choices)
        return self._object(self.chat and "chat.completion.chunk", []) | {"usage": total}

    async def stream(self, firsts: list[Event], generations: list[Generation]) -> AsyncIterator[bytes]:
        """The SSE stream, from the generations' first events on (`GenerationStream` stops them after it). A
        lone generation is read here, in the response's task; several through one merge."""
        written = _Written(self)
        try:
            for index in range(len(generations)):  # chat: each choice's role
                opening = self.opening(firsts[index], index)
                if opening is not None:
                    yield sse(opening)
            if len(generations) == 1:
                event, generation = firsts[0], generations[0]
                while True:
                    for sent in written.of(0, event):
                        yield sent
                    if isinstance(event, Summary):
                        break
                    event = await generation.next()
            else:
                async for index, event in merged(firsts, generations):
                    for sent in written.of(index, event):
                        yield sent
            if self.body.include_usage:
                yield sse(self.usage([written.summaries[i] for i in sorted(written.summaries)]))
        except Exception as e:  # after the status line: the failure goes in the stream
            yield sse(http_error(e, self.params).body)
        yield DONE

    def _with_tool_calls(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message of `text` with its tool calls parsed out, and the finish reason."""
        parsed = self.tools.parse(text, cut=reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = tool_calls_json(parsed.tool_calls)
        return message, self.tools.finish_reason(parsed, reason)

    def _echo(self, index: int) -> str:
        """The text choice `index` begins with: its prompt's, with `echo`."""
        return "" if self.echo is None else self.echo[index]

    def _logprobs(self, chunk: Chunk, index: int, first: bool) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries = [*chunk.prompt_logprobs, *chunk.logprobs] if first and self.echo is not None else chunk.logprobs
        return self.logprobs.format(entries, index)

    def _chunk(
        self, content: dict[str, Any] | str, reason: str | None, index: int, counted: Event, generated: int
    ) -> dict[str, Any]:
        """A chunk of choice `index`; its usage so far (sent with `continuous_usage`): the prompt's tokens as
        `counted` has them, and `generated` tokens."""
        choice = {"index": index, "delta": content} if self.chat else {"index": index, "text": content}
        choice |= {"logprobs": None, "finish_reason": reason}
        sent = self._object(self.chat and "chat.completion.chunk", [choice])
        if self.body.continuous_usage:
            return sent | {"usage": usage(counted.prompt_tokens, generated, counted.cached_tokens)}
        return sent | {"usage": None} if self.body.include_usage else sent

    def _object(self, chat_kind: str | bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = chat_kind or "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.body.model, "choices": choices}


class _Written:
    """What each choice's events become on the stream: text as it comes (or held until the choice ends,
    for tool calls, which are parsed from the whole text), then its closing chunk."""

    def __init__(self, answers: Answers):
        self.answers = answers
        self.summaries: dict[int, Summary] = {}
        self._generated: dict[int, int] = {}  # tokens so far per choice, shown or not (the usage so far)
        self._started: set[int] = set()  # the choices whose first text was sent
        self._held: dict[int, list[Chunk]] = {}  # a tool calls answer's chunks, per choice
        self._shown = answers.body.prompt_only  # events are changed before they are shown (`Answers.shown`)
        self._plain = answers.logprobs is None and not answers.body.continuous_usage  # text alone: `text_piece`

    def of(self, index: int, event: Event) -> list[bytes]:
        """The SSE events for one event of choice `index`."""
        answers = self.answers
        event = answers.shown(event) if self._shown else event
        if isinstance(event, Summary):
            self.summaries[index] = event
            if answers.tools is not None:
                held = self._held.pop(index, [Chunk("")])  # no text: one empty chunk
                return [sse(c) for c in answers.settled(Chunk.joined(held), event, index)]
            return [sse(answers.closing(event, index, first=index not in self._started))]
        self._generated[index] = generated = self._generated.get(index, 0) + len(event.token_ids)
        if not (event.text or event.logprobs or event.prompt_logprobs):
            return []  # all of it left out (`prompt_only`)
        if answers.tools is not None:
            self._held.setdefault(index, []).append(event)
            return []
        if self._plain and index in self._started:
            return [answers.text_piece(event.text, index)]
        first = index not in self._started
        self._started.add(index)
        return [sse(answers.piece(event, index, first, generated))]
