"""Log-probabilities in OpenAI's two shapes, from the generation's `Logprob`s (formatting only, no I/O):
a completion's `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` and chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...], "refusal": null}`.

A token's text is the tokenizer's decoding of that token alone. `text_offset` counts the characters of
the tokens before it, from the first token reported (a stream's offsets go on from chunk to chunk), a
special token counting none unless the text keeps special tokens (`skip_special_tokens: false`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from loraserve.gateway.events import Logprob
from loraserve.tokenizer import Tokenizer


class LogprobFormat:
    """Formats a request's log-probabilities; remembers each choice's text offset across stream chunks."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, keep_special: bool = False):
        self.chat = chat
        self._text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        # the room a token takes in the choice's text, which leaves special tokens out unless it keeps them
        self._width = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: len(tokenizer.decode([token_id], skip_special_tokens=not keep_special))
        )
        self._offsets: dict[int, int] = {}

    def format(self, entries: Sequence[Logprob], index: int = 0) -> dict[str, Any]:
        """The `logprobs` of choice `index` for `entries`, the choice's next tokens."""
        return self._chat(entries) if self.chat else self._completion(entries, index)

    def _completion(self, entries: Sequence[Logprob], index: int) -> dict[str, Any]:
        tokens, offsets, offset = [], [], self._offsets.get(index, 0)
        for entry in entries:
            tokens.append(self._text(entry.token_id))
            offsets.append(offset)
            offset += self._width(entry.token_id)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top(e) if e.logprob is not None else None for e in entries],
            "text_offset": offsets,
        }

    def _top(self, entry: Logprob) -> dict[str, float]:
        """The most likely tokens' text -> log-probability, then the token's own (when not among them)."""
        top = {self._text(t.token_id): t.logprob for t in entry.top}
        if all(t.token_id != entry.token_id for t in entry.top):
            top.setdefault(self._text(entry.token_id), entry.logprob)
        return top

    def _chat(self, entries: Sequence[Logprob]) -> dict[str, Any]:
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
