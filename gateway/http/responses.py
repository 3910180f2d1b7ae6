"""OpenAI-shaped answers: whole completions, stream chunks and their SSE framing. Pure functions.

A stream is a sequence of `data: <json>\\n\\n` events: (chat only) a first chunk with the assistant
role, one chunk per piece of text, a last chunk with the finish reason, then, with
`stream_options.include_usage`, a chunk with no choices and the usage (every other chunk then
carries `"usage": null`), and finally `data: [DONE]`. A failure after the stream has begun is one
event `data: {"error": {...}}`, then `data: [DONE]`. A completion of several prompts interleaves
their chunks, each choice carrying its prompt's `index`, and its usage is their sum.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

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

    def usage(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    @staticmethod
    def summed(finals: list[Final]) -> Final:
        """The token counts of several generations together (a batch of prompts' usage)."""
        return Final("", sum(f.prompt_tokens for f in finals), sum(f.completion_tokens for f in finals))


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Answers:
    """The answers of one request: a completion (`chat` False) or a chat completion."""

    id: str
    model: str
    chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def whole(self, results: list[tuple[str, Final]]) -> dict[str, Any]:
        """The non-streaming answer to one or several prompts: choice i is prompt i's (its text and how
        it ended), the usage their sum."""
        choices = []
        for index, (text, final) in enumerate(results):
            message = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **message, "logprobs": None, "finish_reason": final.finish_reason})
        usage = Final.summed([final for _, final in results]).usage()
        return self._object(self.chat and "chat.completion", choices) | {"usage": usage}

    def opening(self) -> dict[str, Any] | None:
        """The chunk before any text (chat: the assistant's role), or None."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def piece(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"content": text} if self.chat else text, None, index)

    def closing(self, final: Final, index: int = 0) -> dict[str, Any]:
        return self._chunk({} if self.chat else "", final.finish_reason, index)

    def usage(self, final: Final) -> dict[str, Any]:
        """The include_usage chunk: no choices, the usage."""
        return self._object(self.chat and "chat.completion.chunk", []) | {"usage": final.usage()}

    def _chunk(self, content: dict[str, Any] | str, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": content} if self.chat else {"index": index, "text": content}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        chunk = self._object(self.chat and "chat.completion.chunk", [choice])
        return chunk | {"usage": None} if self.include_usage else chunk

    def _object(self, chat_kind: str | bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = chat_kind or "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
