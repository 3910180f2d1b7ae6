"""One generation's output as events: the workers' TOKENS messages in, `Chunk`s and a `Summary` out.

Tokens are detokenized incrementally (special tokens' text left out unless the request keeps it),
stop sequences are applied to the text (`StopFilter`), log-probabilities are attached (the prompt's
to the first chunk with a token), and the counts and times the summary reports are kept. No I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loraserve.gateway.adapter_versions import AdapterVersion
from loraserve.gateway.events import Chunk, Summary, Timings, logprobs_of, prompt_logprobs_of
from loraserve.gateway.generation_request import GenerationRequest
from loraserve.gateway.stops import StopFilter
from loraserve.tokenizer import IncrementalDetokenizer, Tokenizer
from loraserve.wire import Tokens


@dataclass(frozen=True)
class Step:
    """What one TOKENS message gives: the chunk to send (None: nothing to show), and whether the
    generation is over, why, and whether its attempt still runs (a stop sequence ended it first)."""

    chunk: Chunk | None
    done: bool = False
    finish_reason: str = ""
    still_running: bool = False
    first_token: bool = False  # the message carried the generation's first token


class Output:
    """The text, counts and times of one generation, message by message."""

    def __init__(self, tokenizer: Tokenizer, valid: GenerationRequest, prompt_ids: list[int], arrival: float):
        self.valid, self.prompt_ids, self.arrival = valid, prompt_ids, arrival
        keep_special = valid.keep_special_tokens
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=not keep_special)
        self._stops = StopFilter(list(valid.stop), include=valid.include_stop)
        self._special = set() if keep_special else set(tokenizer.eos_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token_at: float | None = None

    def push(self, message: Tokens) -> Step:
        """The chunk of `message`, and whether the generation ends with it."""
        self.cached_tokens = max(self.cached_tokens, message.cached_tokens)
        logprobs = logprobs_of(message.token_ids, message.logprobs)
        prompt_logprobs = []
        first = bool(message.token_ids) and self.first_token_at is None
        if first:
            if self.valid.sampling.prompt_logprobs is not None:  # they come with the first token
                prompt_logprobs = prompt_logprobs_of(self.prompt_ids, message.prompt_logprobs)
            self.first_token_at = time.time()
        self.completion_tokens += len(message.token_ids)
        text = "".join(self._detok.push(t) for t in message.token_ids if t not in self._special)
        if message.finished:
            text += self._detok.flush()
        shown, stopped = self._stops.feed(text)
        if message.finished and not stopped:
            shown += self._stops.flush()
        chunk = None
        if shown or message.token_ids:
            chunk = Chunk(
                shown, list(message.token_ids), logprobs, prompt_logprobs, len(self.prompt_ids), self.cached_tokens
            )
        if stopped or message.finished:
            reason = "stop_sequence" if stopped else message.finish_reason or ""
            return Step(chunk, True, reason, still_running=not message.finished, first_token=first)
        return Step(chunk, first_token=first)

    def summary(
        self,
        request_id: str,
        reason: str,
        timings: dict[str, float],
        version: AdapterVersion,
        worker_id: str,
        failovers: int,
    ) -> Summary:
        """The last event: the finish reason, usage and where the time went (`timings`: the worker's)."""
        first = self.first_token_at
        return Summary(
            request_id=request_id,
            client_request_id=self.valid.client_request_id,
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            timings=Timings(
                queue_s=timings.get("queue_s", 0.0),
                adapter_load_s=timings.get("adapter_load_s", 0.0),
                prefill_s=timings.get("prefill_s", 0.0),
                time_to_first_token_s=(first - self.arrival) if first else 0.0,
                decode_s=timings.get("decode_s", 0.0),
                total_s=time.time() - self.arrival,
            ),
            adapter_version=version.version,
            worker_id=worker_id,
            failovers=failovers,
        )
