"""What each step and each request of a prefix-suite run did: the figures that explain its latencies.

    timeline = Timeline(engine)
    timeline.submitted(request, turn=1)   # when a request is added
    outputs = timeline.step()             # instead of engine.step()
    timeline.summary()                    # the run's figures, for the suite's record

Times are the engine's own: its clock advances only while its `step()` runs, so two engines stepped
in turn in one process (the suite's cache on and off) are each timed as if alone, and both see the
machine as it is at the same moments. A request submitted between steps is submitted at the clock's
value then; its first token and its end come at the end of the step that produced them.

Each step records its time, the requests it ran, the tokens it prefilled (prompt chunks, or
recomputation), its decodes, and how many requests waited when it began. Each request records its
queue wait (submission to the start of the first step that ran it), the steps its prefill took,
its time to first token and to its end, and the tokens every step computed between its submission
and its first token: the work ahead of it, which depends on the scheduling and not on the machine's
speed. `summary()` reduces them to what the suite writes: latencies, throughput, hit rate, mean
batch size and step time, the queue-wait distribution, the time to first token of the requests
submitted at the start (all at once) and of the later ones, and the requests forming the tail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

TAIL_SHARE = 0.05  # the slowest 5 % of requests by time to first token: where p99 lies


@dataclass
class StepRecord:
    began: float  # the engine's own clock, seconds
    seconds: float
    requests: int  # scheduled in the step
    prefill_tokens: int  # prompt chunks (or recomputation) computed, not decodes
    decodes: int
    waiting: int  # requests queued when the step began


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    submitted: float  # the engine's own clock, seconds
    turn: int | None = None  # the conversation's turn it sends (1: a first turn, nothing cached for it)
    cached_tokens: int = 0
    output_tokens: int = 0
    queue_wait_s: float | None = None  # submitted → the start of the first step that ran it
    ttft_s: float | None = None
    latency_s: float | None = None  # submitted → its last token
    prefill_chunks: int = 0  # steps that computed part of its prompt before its first token
    steps_to_first_token: int = 0  # steps that ran between its submission and its first token
    tokens_ahead: int = 0  # tokens those steps computed, for every request in them (its own included)


class Timeline:
    """Wraps an engine's steps; records per-step and per-request figures (see the module docstring)."""

    def __init__(self, engine, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.clock = clock
        self.now = 0.0  # the engine's own clock: the sum of its steps' times
        self.steps: list[StepRecord] = []
        self.requests: dict[str, RequestRecord] = {}
        self._tokens = 0  # computed by every step so far
        self._at_submit: dict[str, tuple[int, int]] = {}  # request -> (steps, tokens) when submitted
        self._plan = None
        scheduler = engine.step_scheduler
        schedule = scheduler.schedule

        def keep_plan():
            self._plan = schedule()
            return self._plan

        scheduler.schedule = keep_plan  # what the step computed, read after it

    def submitted(self, request, turn: int | None = None) -> None:
        rid = request.request_id
        self.requests[rid] = RequestRecord(rid, len(request.spec.prompt_ids), self.now, turn)
        self._at_submit[rid] = (len(self.steps), self._tokens)

    def step(self) -> list:
        waiting = len(self.engine.step_scheduler.waiting)
        self._plan = None
        began = self.clock()
        outputs = self.engine.step()
        seconds = self.clock() - began
        plan, start = self._plan, self.now
        self.now += seconds
        if plan is None or not plan.scheduled:
            return outputs
        prefill = decodes = 0
        for request, n in plan.scheduled:
            record = self.requests.get(request.request_id)
            if n > 1 or request.num_computed - n < len(request.spec.prompt_ids):  # a chunk of its prompt, or recompute
                prefill += n
                if record is not None and record.ttft_s is None:
                    record.prefill_chunks += 1
            else:
                decodes += n
        self.steps.append(StepRecord(start, seconds, len(plan.scheduled), prefill, decodes, waiting))
        self._tokens += prefill + decodes
        for request, _ in plan.scheduled:
            self._after_step(request, start)
        return outputs

    def _after_step(self, request, start: float) -> None:
        record = self.requests.get(request.request_id)
        if record is None:
            return
        if record.queue_wait_s is None:
            record.queue_wait_s = start - record.submitted
        if record.ttft_s is None and request.first_token is not None:
            steps, tokens = self._at_submit[request.request_id]
            record.ttft_s = self.now - record.submitted
            record.cached_tokens = request.cached_tokens
            record.steps_to_first_token = len(self.steps) - steps
            record.tokens_ahead = self._tokens - tokens
        if request.finished:
            record.latency_s = self.now - record.submitted
            record.output_tokens = len(request.output_ids)

    def summary(self) -> dict:
        """The run's figures (see the module docstring); `tail` lists the slowest 5 % by time to first token."""
        done = [r for r in self.requests.values() if r.latency_s is not None]
        steps, seconds = self.steps, self.now
        prompt, cached, output = (
            sum(getattr(r, k) for r in done) for k in ("prompt_tokens", "cached_tokens", "output_tokens")
        )
        ttfts = sorted(r.ttft_s for r in done)
        at_start = sorted(r.ttft_s for r in done if r.submitted == 0.0)
        later = sorted(r.ttft_s for r in done if r.submitted > 0.0)
        prefill_steps = [s for s in steps if s.prefill_tokens]
        decode_steps = [s for s in steps if not s.prefill_tokens]
        tail = sorted(done, key=lambda r: r.ttft_s, reverse=True)[: max(1, round(TAIL_SHARE * len(done)))]
        return {
            "requests": len(done),
            "ttft_p50_s": rank_quantile(ttfts, 0.5),
            "ttft_p99_s": rank_quantile(ttfts, 0.99),
            "latency_p50_s": rank_quantile(sorted(r.latency_s for r in done), 0.5),
            "latency_p99_s": rank_quantile(sorted(r.latency_s for r in done), 0.99),
            "tokens_per_s": (prompt + output) / seconds if seconds else 0.0,
            "output_tokens_per_s": output / seconds if seconds else 0.0,
            "hit_rate": cached / prompt if prompt else 0.0,
            "seconds": seconds,
            "start_requests": len(at_start),
            "start_ttft_max_s": at_start[-1] if at_start else 0.0,
            "later_ttft_p99_s": rank_quantile(later, 0.99),
            "tokens_ahead_p99": rank_quantile(sorted(r.tokens_ahead for r in done), 0.99),
            "queue_wait_p50_s": rank_quantile(sorted(r.queue_wait_s for r in done), 0.5),
            "queue_wait_p99_s": rank_quantile(sorted(r.queue_wait_s for r in done), 0.99),
            "steps": len(steps),
            "mean_batch_size": mean([s.requests for s in steps]),
            "mean_step_tokens": mean([s.prefill_tokens + s.decodes for s in steps]),
            "mean_step_s": mean([s.seconds for s in steps]),
            "prefill_steps": len(prefill_steps),
            "prefill_step_s": mean([s.seconds for s in prefill_steps]),
            "prefill_step_tokens": mean([s.prefill_tokens + s.decodes for s in prefill_steps]),
            "decode_step_s": mean([s.seconds for s in decode_steps]),
            "tail": [asdict(r) for r in tail],
        }


def rank_quantile(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values by nearest rank, as the suite has always taken it; None for no
    values (a side that completed nothing has no quantile, and no ratio is taken from it)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
