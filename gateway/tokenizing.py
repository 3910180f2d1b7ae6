"""Tokenizing off the event loop: the gateway's one bounded pool of tokenizer threads.

Every edge tokenizes, detokenizes and renders chat templates through `Tokenizing`, never on an
event loop: a long prompt tokenized inline stalls every other call of the process (health checks
included) for as long as it takes. HF `tokenizers` releases the GIL in `encode_batch` and
`decode_batch` (its `encode` and `decode` hold it throughout), so the threads call those
(`Tokenizer.encode_in_thread`, `decode_in_thread`) and the loop runs meanwhile; a chat template
is pure Python, which the loop's thread still gets turns beside.

Owned here: the threads (`--tokenizer-threads`), the bound on jobs waiting for one
(`--tokenizer-queue`: one more is refused RESOURCE_EXHAUSTED with a retry hint), and the byte
bound checked before any tokenizing: a text of more UTF-8 bytes than the context length times the
longest token's bytes (computed once, at start) cannot fit the context, so it is refused
INVALID_ARGUMENT naming its field at once. The token-count check after tokenizing stays the
generation's (`validation.check_context`). Concurrent encodes of the same text (a body's prompt, once
for each of its n choices) share one job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError, InvalidRequestError
from loraserve.gateway.events import RetryLaterError

if TYPE_CHECKING:
    from loraserve.gateway.chat_template import ChatTemplate
    from loraserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

BUSY_RETRY_S = 1.0  # a full queue drains as jobs end; nothing predicts when


@dataclass(frozen=True)
class TokenizingConfig:
    tokenizer_threads: int = setting(2, "threads that tokenize, detokenize and render chat templates (off the loop)")
    tokenizer_queue: int = setting(
        32, "tokenizer jobs that may wait for a thread; one more is refused RESOURCE_EXHAUSTED (HTTP 429)"
    )

    def __post_init__(self) -> None:
        if self.tokenizer_threads < 1:
            raise InvalidConfigError(f"--tokenizer-threads must be at least 1, got {self.tokenizer_threads}")
        if self.tokenizer_queue < 0:
            raise InvalidConfigError(f"--tokenizer-queue must be 0 or more, got {self.tokenizer_queue}")


class TokenizerBusyError(RetryLaterError):
    """Every tokenizer thread is busy and the queue in front of them is full."""


class Tokenizing:
    """The model's tokenizer (and chat template) behind a bounded pool of threads; async for the loop."""

    def __init__(self, tokenizer: Tokenizer, max_context: int, config: TokenizingConfig | None = None):
        config = config or TokenizingConfig()
        self.tokenizer = tokenizer
        self.longest_token_bytes = tokenizer.longest_token_bytes()  # None: no token bounds its text
        self.max_context = max_context
        # more cannot be max_context tokens; None: no such bound (the prompt's byte cap still applies)
        self.max_text_bytes = None if self.longest_token_bytes is None else max_context * self.longest_token_bytes
        self._threads = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenizer")
        self._most = config.tokenizer_threads + config.tokenizer_queue  # jobs running or waiting, at most
        self._jobs = 0  # running or waiting; a job's thread gives its count back when the job ends
        self._lock = threading.Lock()
        self._encoding: dict[tuple[str, bool], asyncio.Task[list[int]]] = {}  # texts being encoded now
        if self.max_text_bytes is None:
            bound = "no byte bound (a token of this tokenizer may stand for any length of text)"
        else:
            bound = f"texts over {self.max_text_bytes} bytes refused ({max_context} x {self.longest_token_bytes})"
        log.info(
            "tokenizing: %d threads, %d queued jobs at most; %s",
            config.tokenizer_threads,
            config.tokenizer_queue,
            bound,
        )

    def check_fits(self, text: str, field: str) -> None:
        """InvalidRequestError naming `field` when `text` has too many bytes to fit the context as tokens."""
        bound = self.max_text_bytes
        if bound is None or len(text) <= bound // 4:  # at most 4 bytes a character: no need to count them
            return
        size = len(text.encode())
        if size > bound:
            raise InvalidRequestError(
                field,
                f"is {size} bytes; a text over {bound} bytes cannot fit the context length of {self.max_context} "
                f"tokens (a token stands for at most {self.longest_token_bytes} bytes): shorten it",
            )

    async def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; the byte bound first (InvalidRequestError naming `field`). Callers asking for
        a text that is being encoded share that job (one caller cancelled does not cancel it)."""
        self.check_fits(text, field)
        key = (text, add_special_tokens)
        job = self._encoding.get(key)
        if job is None:
            job = asyncio.ensure_future(self._run(self.tokenizer.encode_in_thread, text, add_special_tokens))
            self._encoding[key] = job
            job.add_done_callback(lambda _: self._encoding.pop(key, None))
        return list(await asyncio.shield(job))

    async def encode_with_strings(
        self, text: str, field: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[str]]:
        """The ids of `text` and each one's token string, in one job; the byte bound first."""
        self.check_fits(text, field)
        return await self._run(self._ids_and_strings, text, add_special_tokens)

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self.tokenizer.decode_in_thread, list(ids), skip_special_tokens)

    async def token_strings(self, ids: Sequence[int]) -> list[str]:
        return await self._run(self.tokenizer.token_strings, list(ids))

    async def render(
        self, template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """`template` rendered for `messages` (and `tools`): `ChatTemplate.render` in a thread."""
        return await self._run(template.render, messages, tools)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- internals -----------------------------------------------------------------------------
    def _ids_and_strings(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        ids = self.tokenizer.encode_in_thread(text, add_special_tokens)
        return ids, self.tokenizer.token_strings(ids)

    async def _run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` in a tokenizer thread; TokenizerBusyError when `_most` jobs are running or waiting.
        A caller that stops waiting (cancelled) leaves a queued job cancelled, a running one to finish."""
        with self._lock:
            if self._jobs >= self._most:
                raise TokenizerBusyError(
                    f"the gateway's tokenizer is busy ({self._jobs} jobs running or queued, its limit); "
                    f"retry in {BUSY_RETRY_S:g} s",
                    int(BUSY_RETRY_S * 1000),
                )
            self._jobs += 1
        try:
            future = self._threads.submit(job, *args)
        except BaseException:
            self._job_ended(None)
            raise
        future.add_done_callback(self._job_ended)  # in the thread that ended it (or here, if cancelled)
        return await asyncio.wrap_future(future)

    def _job_ended(self, _future: Future | None) -> None:
        with self._lock:
            self._jobs -= 1

    @property
    def jobs(self) -> int:
        """Jobs running or waiting for a thread now."""
        with self._lock:
            return self._jobs
