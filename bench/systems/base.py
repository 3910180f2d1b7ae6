"""What the serving benchmark compares: systems that replay a trace in real time.

A `System` has a name and `run(trace)`: it sets itself up (loads the model and the trace's
adapters, warms up) before the trace's clock starts, then submits every request when its arrival
time comes — wall-clock seconds since the start — and returns one `RequestRecord` per request,
finished or not. Times in records are seconds on the trace's clock, so a request that waited
because the system was busy when it arrived is charged for the wait.

`Replay` is the shared real-time machinery: the clock, the arrivals that are due, the deadline
(trace duration + drain limit: a system that falls behind is stopped there and its unfinished
requests count as such), the records and a progress bar.

In-process systems live in `engine_system.py` (loraserve and its ablations), `peft_system.py`
and `merge_system.py`; one that drives the whole gRPC stack only needs the same two members.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from tqdm import tqdm

from loraserve.bench.workloads.slora import Trace, TraceRequest


@dataclass
class RequestRecord:
    request_id: str
    adapter: str
    arrival_s: float  # on the trace's clock (seconds since the replay started)
    prompt_tokens: int
    max_new_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_s is not None and self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float | None:
        return self.finish_s - self.arrival_s if self.finished else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.finished or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class System(Protocol):
    name: str

    def run(self, trace: Trace) -> list[RequestRecord]:
        """Replay `trace` in real time; one record per request, in the trace's order."""
        ...

    def stats(self) -> dict:
        """System-specific numbers about the last run (pool waste, adapter loads, switches); may be empty."""
        ...


@dataclass
class LastRunStats:
    """What every system keeps of its last run: `run` sets `_stats`, `stats()` hands out a copy."""

    _stats: dict = field(default_factory=dict, init=False, repr=False)

    def stats(self) -> dict:
        return dict(self._stats)


@dataclass(frozen=True)
class ReplayLimits:
    drain_s: float = 30.0  # after the last arrival, stop waiting for stragglers after this long
    progress: bool = True  # a progress bar per run


class Replay:
    """The clock, the arrivals, the deadline and the records of one run."""

    def __init__(self, trace: Trace, name: str, limits: ReplayLimits):
        self.pending: deque[TraceRequest] = deque(trace.requests)
        self.records = {
            r.request_id: RequestRecord(r.request_id, r.adapter, r.arrival_s, r.prompt_len, r.max_new_tokens)
            for r in trace.requests
        }
        last = trace.requests[-1].arrival_s if trace.requests else 0.0
        self.deadline_s = max(trace.duration_s, last) + limits.drain_s
        self.open = 0  # submitted, not finished
        self.bar = tqdm(total=len(self.records), desc=name, unit="req", leave=False, disable=not limits.progress)
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        assert self._t0 is not None, "call start() first"
        return time.monotonic() - self._t0

    @property
    def expired(self) -> bool:
        return self.now() >= self.deadline_s

    @property
    def done(self) -> bool:
        """Every request arrived and finished, or the deadline passed."""
        return (not self.pending and self.open == 0) or self.expired

    def due(self) -> list[TraceRequest]:
        """Requests whose arrival time has come, in order; they count as open from now on."""
        now, out = self.now(), []
        while self.pending and self.pending[0].arrival_s <= now:
            out.append(self.pending.popleft())
        self.open += len(out)
        return out

    def wait_for_arrival(self) -> None:
        """Sleep until the next arrival (or the deadline)."""
        if self.pending:
            time.sleep(max(0.0, min(self.pending[0].arrival_s, self.deadline_s) - self.now()))

    def tokens(self, request_id: str, count: int, now: float | None = None) -> None:
        record = self.records[request_id]
        if count and record.first_token_s is None:
            record.first_token_s = self.now() if now is None else now
        record.output_tokens += count

    def finish(self, request_id: str, now: float | None = None, error: str | None = None) -> None:
        record = self.records[request_id]
        if record.finish_s is not None:
            return
        record.finish_s = self.now() if now is None else now
        record.error = error
        self.open -= 1
        self.bar.update(1)

    def results(self) -> list[RequestRecord]:
        self.bar.close()
        return list(self.records.values())
