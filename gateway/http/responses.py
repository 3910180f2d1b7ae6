"""OpenAI-shaped answers: whole completions, stream chunks and their SSE framing. Pure functions.

A stream is a sequence of `data: <json>\\n\\n` events: (chat only) a first chunk with the assistant
role, one chunk per piece of text, a last chunk with the finish reason, then, with
`stream_options.include_usage`, a chunk with no choices and the usage (every other chunk then
carries `"usage": null`), and finally `data: [DONE]`. A failure after the stream has begun is one
event `data: {"error": {...}}`, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]\n\n"
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

    def whole(self, text: str, final: Final) -> dict[str, Any]:
        """The non-streaming answer."""
        message = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **message}
        choice |= {"logprobs": None, "finish_reason": final.finish_reason}
        return self._object(self.chat and "chat.completion", [choice]) | {"usage": final.usage()}

    def opening(self) -> dict[str, Any] | None:
        """The chunk before any text (chat: the assistant's role), or None."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def piece(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text} if self.chat else text, None)

    def closing(self, final: Final) -> dict[str, Any]:
        return self._chunk({} if self.chat else "", final.finish_reason)

    def usage(self, final: Final) -> dict[str, Any]:
        """The include_usage chunk: no choices, the usage."""
        return self._object(self.chat and "chat.completion.chunk", []) | {"usage": final.usage()}

    def _chunk(self, content: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": content} if self.chat else {"index": 0, "text": content}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        chunk = self._object(self.chat and "chat.completion.chunk", [choice])
        return chunk | {"usage": None} if self.include_usage else chunk

    def _object(self, chat_kind: str | bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = chat_kind or "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
