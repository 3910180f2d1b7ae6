"""Which adapters each worker should fetch before a request needs them, and how likely each is needed.

Three sources of prediction (S-LoRA §5.2 looks only at the queue; popularity and returns cover what
has not arrived yet):

- the queue: the next `depth` requests in dispatch order will be placed soon, each on the worker
  placement would choose for it now; their adapters are needed there almost surely (score 1 for
  the next one, falling to 0.5 at the end of the window);
- popularity: an exponentially weighted arrival rate per adapter (`AdapterPopularity`, half-life
  `half_life_s`). The chance that an adapter is asked for within `horizon_s` is 1 - exp(-rate·
  horizon) (Poisson arrivals); a popular adapter no worker holds is sent to the worker placement
  would choose for a typical request of it, and one so hot that each worker will likely see a
  request for it (its rate split across the workers) to every worker lacking it. The worker fetches
  it into free memory, or in place of cached adapters scored lower, never of likelier ones;
- returns: an adapter whose request just ended is likely to be asked for again after the user's think
  time, when it is a conversation's (`ReturningAdapters`: learnt per adapter, from how often its ended
  requests were followed by another within `window_s`); the worker placement would choose for its
  next request is told to fetch it, scored by that chance, unless it holds it already (when the worker
  that served it evicted it, or is busier than another, the next turn would find it cold).

A hint goes only to the worker that would serve the request, never to every worker, and carries
the adapter's score in [0, 1]: a worker never evicts a cached adapter whose last known score is
higher than the one it fetches (`loraserve.wire.Prefetch.scores`).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from loraserve.errors import InvalidConfigError
from loraserve.wire import AdapterKey


class AdapterPopularity:
    """EWMA arrival rate (requests per second) per adapter; at most `max_adapters` are tracked.

    A rate is kept as its logarithm shifted to a fixed epoch (`log rate + t/tau`), which decay does not
    change: an arrival updates one entry, and the ranking needs no recomputation as time passes. The
    most popular are recomputed at most every `refresh_s` (a prediction needs no fresher ranking), and
    when more than `max_adapters` are tracked the least popular half goes in one pass."""

    def __init__(self, half_life_s: float = 30.0, max_adapters: int = 4096, refresh_s: float = 0.1):
        if half_life_s <= 0 or max_adapters < 1 or refresh_s < 0:
            raise InvalidConfigError("half_life_s must be > 0, max_adapters >= 1 and refresh_s >= 0")
        self.tau = half_life_s / math.log(2)
        self.max_adapters = max_adapters
        self.refresh_s = refresh_s
        self._keys: dict[AdapterKey, float] = {}  # adapter -> log(rate) + t / tau
        self._top: tuple[float, int, list[AdapterKey]] = (-math.inf, 0, [])  # (computed at, n, adapters)

    def arrived(self, adapter: AdapterKey, now: float) -> None:
        key = self._keys.get(adapter)
        bump = math.log(1.0 / self.tau) + now / self.tau  # one arrival now, on the same scale
        self._keys[adapter] = bump if key is None else max(key, bump) + math.log1p(math.exp(-abs(key - bump)))
        if len(self._keys) > 2 * self.max_adapters:  # forget the least popular half (amortised O(1))
            kept = heapq.nlargest(self.max_adapters, self._keys.items(), key=lambda kv: kv[1])
            self._keys = dict(kept)

    def rate(self, adapter: AdapterKey, now: float) -> float:
        key = self._keys.get(adapter)
        return 0.0 if key is None else math.exp(key - now / self.tau)

    def likelihood(self, adapter: AdapterKey, now: float, horizon_s: float) -> float:
        """Chance of at least one request for `adapter` within `horizon_s` (Poisson at its rate)."""
        return 1.0 - math.exp(-self.rate(adapter, now) * horizon_s)

    def most_popular(self, now: float, n: int) -> list[tuple[AdapterKey, float]]:
        computed, count, top = self._top
        if now - computed > self.refresh_s or count != n or now < computed:
            top = [k for k, _ in heapq.nlargest(n, self._keys.items(), key=lambda kv: (kv[1], kv[0]))]
            self._top = (now, n, top)
        return [(k, self.rate(k, now)) for k in top]


class ReturningAdapters:
    """Adapters likely to be asked for again soon because a request for them just ended: a conversation's
    next turn comes back to its adapter after the user's think time (the queue cannot predict it: nothing
    is queued while the user thinks, and an adapter of the popularity tail has too low a rate).

    After a request for adapter A ends, A is *pending* for `window_s`. If a request for A arrives within
    the window, A returned; if the window passes first, it did not. The chance that A returns is
    estimated per adapter, shrunk toward the rate of all adapters' returns (`prior` observations of it):

        p(A) = (returns(A) + prior·p_all) / (trials(A) + prior)

    `candidates` are the most recently ended pending adapters at least `min_score` likely to return:
    the planner has each fetched, scored p(A), on the worker placement would choose for its next request
    (the one that served it, unless it evicted it or is busier), so it is there before the next turn.
    Memory is bounded: `max_adapters` adapters' statistics; at most that many pending."""

    def __init__(self, window_s: float = 10.0, prior: float = 2.0, max_adapters: int = 4096, forget: float = 0.99):
        if window_s <= 0 or prior <= 0 or max_adapters < 1 or not 0 < forget <= 1:
            raise InvalidConfigError("invalid ReturningAdapters settings")
        self.window_s, self.prior, self.max_adapters, self.forget = window_s, prior, max_adapters, forget
        self._pending: OrderedDict[AdapterKey, tuple[float, int]] = OrderedDict()  # -> (ended at, rank), oldest first
        self._stats: OrderedDict[AdapterKey, tuple[float, float]] = OrderedDict()  # -> (returns, trials)
        self._all = (0.0, 0.0)  # returns, trials of every adapter (forgetting)

    def p_all(self) -> float:
        returns, trials = self._all
        return returns / trials if trials else 0.0

    def probability(self, adapter: AdapterKey) -> float:
        returns, trials = self._stats.get(adapter, (0.0, 0.0))
        return (returns + self.prior * self.p_all()) / (trials + self.prior)

    def ended(self, adapter: AdapterKey, rank: int, now: float) -> None:
        """A request for `adapter` (of LoRA rank `rank`) ended."""
        self.expire(now)
        if adapter in self._pending:  # several requests in flight for it: the last end counts
            del self._pending[adapter]
        self._pending[adapter] = (now, rank)
        while len(self._pending) > self.max_adapters:
            self._end_trial(*self._pending.popitem(last=False)[:1], returned=False)

    def arrived(self, adapter: AdapterKey, now: float) -> None:
        """A request for `adapter` arrived: it returned if it was pending."""
        self.expire(now)
        if self._pending.pop(adapter, None) is not None:
            self._end_trial(adapter, returned=True)

    def candidates(self, now: float, min_score: float, limit: int) -> list[tuple[AdapterKey, float, int]]:
        """(adapter, its return probability, its rank) for the `limit` most recently ended pending
        adapters at least `min_score` likely to return, the likeliest first."""
        self.expire(now)
        out = []
        for adapter in reversed(self._pending):
            if len(out) >= limit:
                break
            score = self.probability(adapter)
            if score >= min_score:
                out.append((adapter, score, self._pending[adapter][1]))
        return sorted(out, key=lambda c: -c[1])

    def expire(self, now: float) -> None:
        while self._pending:
            adapter, (ended, _) = next(iter(self._pending.items()))
            if now - ended <= self.window_s:
                return
            del self._pending[adapter]
            self._end_trial(adapter, returned=False)

    def _end_trial(self, adapter: AdapterKey, returned: bool) -> None:
        returns, trials = self._stats.pop(adapter, (0.0, 0.0))
        self._stats[adapter] = (returns + returned, trials + 1)
        while len(self._stats) > self.max_adapters:
            self._stats.popitem(last=False)
        returns, trials = self._all
        self._all = (self.forget * returns + returned, self.forget * trials + 1)


@dataclass(frozen=True)
class PrefetchPlan:
    """Per worker: adapters to fetch, most urgent first, each with its score in [0, 1]."""

    adapters: dict[str, list[tuple[AdapterKey, float]]]

    def for_worker(self, worker_id: str) -> tuple[tuple[AdapterKey, ...], tuple[float, ...]]:
        hints = self.adapters.get(worker_id, [])
        return tuple(k for k, _ in hints), tuple(round(s * 20) / 20 for _, s in hints)  # steps of 0.05: fewer resends


def plan_prefetch(
    queued: Iterable[tuple[AdapterKey, str | None]],
    popular: Iterable[tuple[AdapterKey, float, Sequence[str]]],
    holds: Callable[[str, AdapterKey], bool],
    max_per_worker: int = 8,
    min_score: float = 0.2,
) -> PrefetchPlan:
    """Build the hints.

    queued:  (adapter, the worker placement would choose) for the next queued requests, in order
    popular: (adapter, likelihood, the workers that will serve its next requests) for popular adapters
    holds(worker, adapter): the worker has it resident (or is loading it): no hint needed
    """
    plan: dict[str, dict[AdapterKey, float]] = {}
    queued = list(queued)
    for i, (adapter, worker_id) in enumerate(queued):
        if worker_id is None or holds(worker_id, adapter):
            continue
        score = 1.0 - 0.5 * i / max(1, len(queued))
        hints = plan.setdefault(worker_id, {})
        hints[adapter] = max(hints.get(adapter, 0.0), score)
    for adapter, likelihood, workers in popular:
        for worker_id in workers:
            if likelihood < min_score or holds(worker_id, adapter):
                continue
            hints = plan.setdefault(worker_id, {})
            hints[adapter] = max(hints.get(adapter, 0.0), likelihood)
    return PrefetchPlan(
        {
            w: sorted(hints.items(), key=lambda kv: (-kv[1], kv[0]))[:max_per_worker]
            for w, hints in plan.items()
            if hints
        }
    )
