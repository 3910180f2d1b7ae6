"""OpenAI-shaped answers: whole completions, stream chunks and their SSE framing. Pure functions.

A stream is a sequence of `data: <json>\\n\\n` events: (chat only) a first chunk with the assistant
role for each choice, one chunk per piece of text, a last chunk with the finish reason, then, with
`stream_options.include_usage`, a chunk with no choices and the usage (every other chunk then
carries `"usage": null`), and finally `data: [DONE]`. With `stream_options.continuous_usage_stats`
(vLLM's) every chunk carries its choice's usage so far instead: its prompt's tokens and the tokens
generated up to that chunk (the role chunk: none yet; the finish chunk: all). A failure after the
stream has begun is one event `data: {"error": {...}}`, then `data: [DONE]`. A completion of several prompts interleaves
their chunks, each choice carrying its prompt's `index`, and its usage is their sum.

A chat answer with tools in use (`tool_calling.py`) carries its tool calls in the message; streamed,
its text is held back and sent whole after the role chunk, with the calls (each with its `index`),
because a call can only be parsed from the whole text.

With log-probabilities asked for, each choice (whole or chunk) carries those of its tokens
(`logprobs.py`); with `echo`, a completion's text (its first chunk's, in a stream) begins with the
prompt, and its log-probabilities with the prompt's (a choice that ends before any text still
begins with it: its closing chunk carries the echo).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loraserve.gateway.events import Logprob
from loraserve.gateway.http.logprobs import LogprobFormat
from loraserve.gateway.http.tool_calling import ToolChoice, tool_calls_json

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it, the log does
FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "length": "length"}  # loraserve's -> OpenAI's


@dataclass(frozen=True)
class Final:
    """How a generation ended: OpenAI's finish reason and the token counts."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was found cached (prefix caching)

    def usage(self) -> dict[str, Any]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    @staticmethod
    def summed(finals: list[Final], per_prompt: int = 1) -> Final:
        """The token counts of several generations together (a batch of prompts' usage): every
        generation's completion tokens, and each prompt's tokens once (`finals` in prompt order,
        `per_prompt` generations of each: its choices share its prompt)."""
        firsts = finals[::per_prompt]
        completion = sum(f.completion_tokens for f in finals)
        return Final("", sum(f.prompt_tokens for f in firsts), completion, sum(f.cached_tokens for f in firsts))


@dataclass(frozen=True)
class Piece:
    """Text a generation produced, with the log-probabilities of its tokens when they were asked for
    (and, on a generation's first piece, its prompt's), and the generation's usage so far: its prompt's
    tokens and the tokens generated up to and including this piece's."""

    text: str
    logprobs: Sequence[Logprob] = ()
    prompt_logprobs: Sequence[Logprob] = ()
    usage: Final = Final("", 0, 0)

    @staticmethod
    def joined(pieces: list[Piece]) -> Piece:
        """A whole generation's pieces as one (its usage: the last piece's)."""
        return Piece(
            "".join(p.text for p in pieces),
            [e for p in pieces for e in p.logprobs],
            [e for p in pieces for e in p.prompt_logprobs],
            pieces[-1].usage if pieces else Final("", 0, 0),
        )


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Answers:
    """The answers of one request: a completion (`chat` False) or a chat completion."""

    id: str
    model: str
    chat: bool
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: LogprobFormat | None = None  # None: not asked for
    echo: Sequence[str] | None = None  # completions with echo: each prompt's text
    tools: ToolChoice | None = None  # chat with tools in use: the text is parsed into tool calls
    choices_per_prompt: int = 1  # n: choice i is prompt i // n's
    prompt_only: bool = False  # completions' `max_tokens: 0` with echo: what was generated is left out

    @property
    def buffered(self) -> bool:
        """A stream whose text is only sent whole, in its closing chunks (tool calls are parsed from all of it)."""
        return self.tools is not None

    def whole(self, results: list[tuple[Piece, Final]], usage: Final | None = None) -> dict[str, Any]:
        """The non-streaming answer to one or several prompts: choice i is the i-th result (prompt
        i // n's), the usage their sum unless given (best_of: every candidate's, not only the kept)."""
        results = [(self.shown(piece), self.shown(final)) for piece, final in results]
        usage = usage and self.shown(usage)
        choices = []
        for index, (piece, final) in enumerate(results):
            text = self._echo(index) + piece.text
            message = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            reason = final.finish_reason
            if self.tools is not None:
                message["message"], reason = self._with_tool_calls(text, reason)
            logprobs = self._logprobs(piece, index, True)
            choices.append({"index": index, **message, "logprobs": logprobs, "finish_reason": reason})
        usage = usage or Final.summed([final for _, final in results], self.choices_per_prompt)
        return self._object(self.chat and "chat.completion", choices) | {"usage": usage.usage()}

    def shown(self, item: Piece | Final) -> Piece | Final:
        """`item` as the answer shows it: with `prompt_only`, the prompt's log-probabilities alone, and
        a `length` finish with no completion tokens."""
        if not self.prompt_only:
            return item
        if isinstance(item, Final):
            return Final("length", item.prompt_tokens, 0, item.cached_tokens)
        return Piece("", (), item.prompt_logprobs, self.shown(item.usage))

    def opening(self, first: Piece | Final, index: int = 0) -> dict[str, Any] | None:
        """The chunk before any text of choice `index` (chat: the assistant's role), or None; `first`:
        the choice's first event (its prompt's usage, nothing generated yet)."""
        if not self.chat:
            return None
        usage = first if isinstance(first, Final) else first.usage
        return self._chunk({"role": "assistant", "content": ""}, None, index, replace(usage, completion_tokens=0))

    def piece(self, piece: Piece, index: int = 0, first: bool = False) -> dict[str, Any]:
        """The chunk of a piece of choice `index`'s text; `first`: its first (which an echo begins)."""
        text = self._echo(index) + piece.text if first else piece.text
        chunk = self._chunk({"content": text} if self.chat else text, None, index, piece.usage)
        chunk["choices"][0]["logprobs"] = self._logprobs(piece, index, first)
        return chunk

    def closing(self, final: Final, index: int = 0, first: bool = False) -> dict[str, Any]:
        """The chunk with choice `index`'s finish reason; `first`: no piece of it was sent (which an echo begins)."""
        text = self._echo(index) if first else ""
        return self._chunk({} if self.chat else text, final.finish_reason, index, final)

    def settled(self, piece: Piece, final: Final, index: int = 0) -> list[dict[str, Any]]:
        """A buffered stream's last chunks: its whole text as content and tool calls (each call with its
        `index`), then the finish reason."""
        message, reason = self._with_tool_calls(piece.text, final.finish_reason)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        for i, call in enumerate(delta.get("tool_calls", ())):
            call["index"] = i
        chunk = self._chunk(delta, None, index, final)
        chunk["choices"][0]["logprobs"] = self._logprobs(piece, index, True)
        return [chunk, self._chunk({}, reason, index, final)]

    def _with_tool_calls(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message of `text` with its tool calls parsed out, and the finish reason."""
        parsed = self.tools.parse(text, cut=reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = tool_calls_json(parsed.tool_calls)
        return message, self.tools.finish_reason(parsed, reason)

    def usage(self, final: Final) -> dict[str, Any]:
        """The include_usage chunk: no choices, the usage."""
        return self._object(self.chat and "chat.completion.chunk", []) | {"usage": final.usage()}

    def _echo(self, index: int) -> str:
        """The text choice `index` begins with: its prompt's, with `echo`."""
        return "" if self.echo is None else self.echo[index]

    def _logprobs(self, piece: Piece, index: int, first: bool) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries = [*piece.prompt_logprobs, *piece.logprobs] if first and self.echo is not None else piece.logprobs
        return self.logprobs.format(entries, index)

    def _chunk(
        self, content: dict[str, Any] | str, finish_reason: str | None, index: int, usage: Final
    ) -> dict[str, Any]:
        """A chunk of choice `index`; `usage`: the choice's so far (sent with `continuous_usage`)."""
        choice = {"index": index, "delta": content} if self.chat else {"index": index, "text": content}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        chunk = self._object(self.chat and "chat.completion.chunk", [choice])
        if self.continuous_usage:
            return chunk | {"usage": usage.usage()}
        return chunk | {"usage": None} if self.include_usage else chunk

    def _object(self, chat_kind: str | bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = chat_kind or "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
