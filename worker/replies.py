"""The messages a worker sends a gateway about its requests, built from a step's outputs (pure).

step_tokens(worker_id, outputs)        # one STEP_TOKENS: each going-on request's new token
end_tokens(worker_id, tracked, ...)    # one TOKENS that ends a request, with its timings
ending(output, expired)                # how a finished output ends: normally, or with which status
"""

from __future__ import annotations

from loraserve.wire import StepTokens, Tokens
from loraserve.worker.request import FinishReason
from loraserve.worker.step_results import StepOutput
from loraserve.worker.tracked import Tracked


def step_tokens(worker_id: str, outputs: list[StepOutput]) -> StepTokens:
    """The new tokens of requests that go on (to one gateway), with log-probabilities and cached counts
    only when one of them has some."""
    message = StepTokens(worker_id, [o.request_id for o in outputs], [o.new_token_ids for o in outputs])
    if any(o.logprobs or o.prompt_logprobs for o in outputs):
        message.logprobs = [o.logprobs for o in outputs]
        message.prompt_logprobs = [o.prompt_logprobs for o in outputs]
    if any(o.cached_tokens for o in outputs):
        message.cached_tokens = [o.cached_tokens for o in outputs]
    return message


def ending(output: StepOutput, expired: bool) -> tuple[str | None, str | None]:
    """(gRPC status, error) a finished output ends its request with; (None, None) for a normal end."""
    if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return None, None
    if expired:
        return "DEADLINE_EXCEEDED", "the deadline passed on the worker"
    if output.finish_reason is FinishReason.CANCELLED:
        return "CANCELLED", "cancelled"
    return output.error_status, output.error or "failed"


def end_tokens(
    worker_id: str,
    tracked: Tracked,
    timings: dict[str, float],
    output: StepOutput | None,
    error_status: str | None,
    error: str | None,
    retry: bool,
) -> Tokens:
    """The TOKENS that ends a request: normally with `output`, the step's output that ended it (its last
    token, finish reason and log-probabilities), else with `error_status`."""
    return Tokens(
        tracked.spec.request_id,
        list(output.new_token_ids) if output else [],
        worker_id,
        finished=True,
        finish_reason=str(output.finish_reason) if output else None,
        error_status=error_status,
        error=error,
        retry=retry,
        timings=timings,
        logprobs=output.logprobs if output else [],
        prompt_logprobs=output.prompt_logprobs if output else [],
        cached_tokens=tracked.request.cached_tokens if tracked.request is not None else 0,
    )
