"""Log-probabilities in OpenAI's two shapes, from the generation's `TokenLogprob`s (formatting only, no I/O).

- Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, lists
  with one item per token; `top_logprobs[i]` maps the k most likely tokens' text to their
  log-probabilities. With `echo`, the prompt's tokens come first, the very first with `null`s
  (nothing predicts it).
- Chat (`logprobs: true, top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}`.

A token's text is the tokenizer's decoding of that token alone (special tokens included), its
`bytes` that text's UTF-8; `text_offset` counts characters of those texts from the first token
reported, so a stream's offsets go on from chunk to chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from loraserve.tokenizer import Tokenizer
from loraserve.v1 import common_pb2


class LogprobFormat:
    """Formats a request's log-probabilities; remembers each choice's text offset across stream chunks."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.chat = chat
        self._text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        self._offsets: dict[int, int] = {}

    def format(self, entries: Sequence[common_pb2.TokenLogprob], index: int = 0) -> dict[str, Any]:
        """The `logprobs` of choice `index` for `entries`, the choice's next tokens."""
        return self._chat(entries) if self.chat else self._completion(entries, index)

    def _completion(self, entries: Sequence[common_pb2.TokenLogprob], index: int) -> dict[str, Any]:
        tokens, offsets, offset = [], [], self._offsets.get(index, 0)
        for entry in entries:
            text = self._text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob if e.HasField("logprob") else None for e in entries],
            "top_logprobs": [
                {self._text(t.token_id): t.logprob for t in e.top} if e.HasField("logprob") else None for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat(self, entries: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                self._chat_token(e.token_id, e.logprob)
                | {"top_logprobs": [self._chat_token(t.token_id, t.logprob) for t in e.top]}
                for e in entries
            ],
            "refusal": None,
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
