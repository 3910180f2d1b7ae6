"""A step's results applied to its requests: the only place request state changes after scheduling.

`Engine.step` plans a step (`StepScheduler`), runs it (the runner), then hands the runner's output
here: `StepResults.apply` appends each request's new token and its log-probabilities, advances its
grammar, checks its stops and ends it when one is met, and `finish` frees what an ended request
holds (its pages through the step scheduler, its adapter's hold in the registry).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from loraserve.tokenizer import Tokenizer
from loraserve.wire import AdapterKey, TokenLogprob
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.grammar import guide_error
from loraserve.worker.request import FinishReason, Request
from loraserve.worker.step_runner import RunnerOutput
from loraserve.worker.step_scheduler import StepPlan, StepScheduler
from loraserve.worker.unified_pool import UnifiedPool

log = logging.getLogger(__name__)

# A request whose logits are NaN or infinite (or whose probabilities are not a distribution) ends
# with this; the others in its batch go on.
NON_FINITE_ERROR = (
    "the model produced non-finite logits for this request (NaN or infinity), so no token can be "
    "sampled; its adapter's weights are the likely cause: check them, or run without the adapter"
)


@dataclass
class StepOutput:
    """What one step did for one request: at most one new token, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: str = "RESOURCE_EXHAUSTED"  # the grpc.StatusCode name for an ERROR finish
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the new tokens', when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with the first token, when asked for
    cached_tokens: int = 0  # with the first token: prompt tokens whose KV was found cached


class StepShape(NamedTuple):
    """One step's batch composition: tokens computed, Σ adapter rank over them, distinct adapters,
    KV pages the attention read."""

    tokens: int
    rank_tokens: int
    adapters: int
    kv_pages: int

    @classmethod
    def of(cls, plan: StepPlan, pool: UnifiedPool, tokens_per_page: int) -> StepShape:
        """What a step computed, in the terms of the scheduler's step-cost model (scheduler/cost_model.py)."""
        tokens = rank_tokens = kv_pages = 0
        for request, n in plan.scheduled:
            tokens += n
            if (key := request.spec.adapter_key) is not None:
                rank_tokens += n * pool.slot(key).rank
            kv_pages += -(-(request.num_computed + n) // tokens_per_page)
        return cls(tokens, rank_tokens, len(plan.adapters), kv_pages)


class StepResults:
    """Applies steps' outputs to the engine's `requests` (shared with the engine, which adds them) and
    ends requests."""

    def __init__(
        self,
        requests: dict[str, Request],
        step_scheduler: StepScheduler,
        pool: UnifiedPool,
        registry: AdapterRegistry,
        tokenizer: Tokenizer,
        max_model_len: int,
    ) -> None:
        self.requests, self.step_scheduler, self.pool, self.registry = requests, step_scheduler, pool, registry
        self.eos_token_ids = tokenizer.eos_token_ids
        self.max_model_len = max_model_len

    def apply(
        self, plan: StepPlan, output: RunnerOutput, scheduled_at: float, waited: dict[AdapterKey, float]
    ) -> list[StepOutput]:
        """The step's new tokens, appended to their requests; the requests a stop ended, finished."""
        now = time.monotonic()
        outputs = []
        for request, n in plan.scheduled:
            if request.first_scheduled is None:
                request.first_scheduled = scheduled_at
                request.adapter_wait_s += waited.get(request.spec.adapter_key, 0.0)
            scored = output.prompt_logprobs.get(request.request_id)
            if scored is not None:
                start = request.num_computed
                request.prompt_logprobs[start : start + len(scored)] = scored
            request.num_computed += n
            self.step_scheduler.cache_computed(request)
            if request.request_id not in output.sampled:
                continue  # a prefill chunk that does not end its prompt
            token = output.sampled[request.request_id]
            if token is None:
                log.warning(
                    "request %s (adapter %s): non-finite logits, ended", request.request_id, request.spec.adapter_key
                )
                outputs.append(
                    self.finish(request.request_id, FinishReason.ERROR, NON_FINITE_ERROR, status="FAILED_PRECONDITION")
                )
                continue
            outputs.append(self._append(request, token, output, now))
        return outputs

    def _append(self, request: Request, token: int, output: RunnerOutput, now: float) -> StepOutput:
        first = not request.output_ids
        request.output_ids.append(token)
        request.first_token = request.first_token or now
        logprobs = [output.logprobs[request.request_id]] if request.request_id in output.logprobs else []
        request.logprobs += logprobs
        error = self._advance_guide(request, token)
        reason = FinishReason.ERROR if error else self._stop_reason(request, token)
        if reason is None:
            step_output = StepOutput(request.request_id, [token], False)
        else:  # an ERROR here is the request's own constraint breaking down (over llguidance's limits)
            step_output = self.finish(request.request_id, reason, error, [token], status="INVALID_ARGUMENT")
        step_output.logprobs = logprobs
        if first and request.prompt_logprobs is not None:
            step_output.prompt_logprobs = list(request.prompt_logprobs)
        if first:
            step_output.cached_tokens = request.cached_tokens
        return step_output

    @staticmethod
    def _advance_guide(request: Request, token: int) -> str | None:
        """Move a guided request's grammar past its new token; the error if the grammar broke down (it went
        over llguidance's limits computing the step's mask or consuming the token)."""
        if request.guide is None or request.guide.consume_token(token):
            return None
        return str(guide_error(request.guide))

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        s = request.spec.sampling
        if (token in self.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return FinishReason.STOP
        if request.guide is not None and request.guide.is_stopped():  # the grammar is complete
            return FinishReason.STOP
        if len(request.output_ids) >= s.max_new_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(
        self, request_id: str, reason: FinishReason, error: str | None, tokens=(), status: str = "RESOURCE_EXHAUSTED"
    ) -> StepOutput:
        """End a request and free what it holds; `status` is the gRPC status of an ERROR finish."""
        request = self.requests.pop(request_id)
        self.step_scheduler.finish(request, reason, error)
        request.finished_at = time.monotonic()
        if (key := request.spec.adapter_key) is not None:
            self.registry.release(key)
            self.pool.discard_stale(key)
        return StepOutput(request_id, list(tokens), True, reason, error, status)

    def fail_unschedulable(self, outputs: list[StepOutput]) -> None:
        """Nothing could run: if nothing is running either, the queue's head can never fit."""
        if self.step_scheduler.running or not self.step_scheduler.waiting or self.pool.copying():
            return
        head = self.step_scheduler.waiting[0]
        outputs.append(
            self.finish(
                head.request_id,
                FinishReason.ERROR,
                "the request does not fit in the page pool even when it runs alone (adapter + KV pages)",
            )
        )
