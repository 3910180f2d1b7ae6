"""The prefix suite's timeline (`bench/suites/prefix/timeline.py`) over a stub engine: its own clock,
queue waits, prefill chunks and the tokens computed ahead of a first token."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from loraserve.bench.suites.prefix.timeline import Timeline


class _Request(SimpleNamespace):
    @property
    def finished(self) -> bool:
        return self.done


def _request(rid: str, prompt: int, answer: int) -> _Request:
    return _Request(
        request_id=rid, spec=SimpleNamespace(prompt_ids=[1] * prompt), output_ids=[], num_computed=0,
        first_token=None, cached_tokens=0, answer=answer, done=False,
    )  # fmt: skip


class _Scheduler:
    """Plans steps of `budget` tokens: running requests first, then the queue, first come first served."""

    def __init__(self, budget: int) -> None:
        self.budget, self.waiting, self.running = budget, deque(), []

    def schedule(self):
        scheduled, budget = [], self.budget
        for r in self.running:
            n = min(len(r.spec.prompt_ids) + len(r.output_ids) - r.num_computed, budget)
            if n:
                scheduled.append((r, n))
                budget -= n
        while self.waiting and budget:
            r = self.waiting.popleft()
            self.running.append(r)
            n = min(len(r.spec.prompt_ids), budget)
            scheduled.append((r, n))
            budget -= n
        return SimpleNamespace(scheduled=scheduled)


class _Engine:
    """Steps that each take one second of a fake clock; a request's answer ends after `answer` tokens."""

    def __init__(self, budget: int, clock: list[float]) -> None:
        self.step_scheduler, self.clock = _Scheduler(budget), clock

    def add(self, request: _Request) -> None:
        self.step_scheduler.waiting.append(request)

    def step(self) -> list:
        plan = self.step_scheduler.schedule()
        self.clock[0] += 1.0
        for r, n in plan.scheduled:
            r.num_computed += n
            if r.num_computed >= len(r.spec.prompt_ids) + len(r.output_ids):
                r.output_ids.append(7)
                r.first_token = r.first_token or self.clock[0]
                if len(r.output_ids) == r.answer:
                    r.done = True
                    self.step_scheduler.running.remove(r)
        return []


def test_a_burst_of_prompts_waits_for_the_prefills_ahead():
    clock = [0.0]
    engine = _Engine(budget=100, clock=clock)
    timeline = Timeline(engine, clock=lambda: clock[0])
    a, b = _request("a", 150, 2), _request("b", 30, 2)
    for r in (a, b):
        engine.add(r)
        timeline.submitted(r, turn=1)
    while not (a.done and b.done):
        timeline.step()
    # step 1: a's first 100 tokens; step 2: a's last 50 (its first token) and b's 30 (its first token)
    # step 3: both decode, both end
    ra, rb = timeline.requests["a"], timeline.requests["b"]
    assert (ra.prefill_chunks, ra.ttft_s, ra.tokens_ahead, ra.queue_wait_s) == (2, 2.0, 180, 0.0)
    assert (rb.prefill_chunks, rb.ttft_s, rb.tokens_ahead, rb.queue_wait_s) == (1, 2.0, 180, 1.0)
    assert ra.latency_s == rb.latency_s == 3.0 and ra.output_tokens == 2
    assert [(s.prefill_tokens, s.decodes, s.waiting) for s in timeline.steps] == [(100, 0, 2), (80, 0, 1), (0, 2, 0)]
    summary = timeline.summary()
    assert summary["start_requests"] == 2 and summary["start_ttft_max_s"] == 2.0
    assert summary["seconds"] == 3.0 and summary["tokens_per_s"] == (180 + 4) / 3.0
    assert summary["queue_wait_p99_s"] == 1.0 and summary["tokens_ahead_p99"] == 180


def test_the_clock_counts_only_the_engine_s_own_steps():
    clock = [0.0]
    engine = _Engine(budget=100, clock=clock)
    timeline = Timeline(engine, clock=lambda: clock[0])
    first = _request("a", 10, 1)
    engine.add(first)
    timeline.submitted(first)
    timeline.step()
    clock[0] += 50.0  # another engine's steps, between two of this one's
    later = _request("b", 10, 1)
    engine.add(later)
    timeline.submitted(later)
    timeline.step()
    assert timeline.now == 2.0
    assert timeline.requests["b"].submitted == 1.0 and timeline.requests["b"].ttft_s == 1.0
    summary = timeline.summary()
    assert summary["start_requests"] == 1 and summary["later_ttft_p99_s"] == 1.0
