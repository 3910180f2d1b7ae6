"""Which adapters each worker should fetch before a request needs them, and how likely each is needed.

Two sources of prediction (S-LoRA §5.2 looks only at the queue; popularity covers what has not
arrived yet):

- the queue: the next `depth` requests in dispatch order will be placed soon, each on the worker
  placement would choose for it now; their adapters are needed there almost surely (score 1 for
  the next one, falling to 0.5 at the end of the window);
- popularity: an exponentially weighted arrival rate per adapter (`AdapterPopularity`, half-life
  `half_life_s`). The chance that an adapter is asked for within `horizon_s` is 1 - exp(-rate·
  horizon) (Poisson arrivals); a popular adapter no worker holds is sent to the worker placement
  would choose for a typical request of it, and one so hot that each worker will likely see a
  request for it (its rate split across the workers) to every worker lacking it. The worker fetches
  it into free memory, or in place of cached adapters scored lower, never of likelier ones.

A hint goes only to the worker that would serve the request, never to every worker, and carries
the adapter's score in [0, 1]: a worker never evicts a cached adapter whose last known score is
higher than the one it fetches (`loraserve.wire.Prefetch.scores`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from loraserve.errors import InvalidConfigError
from loraserve.wire import AdapterKey


class AdapterPopularity:
    """EWMA arrival rate (requests per second) per adapter; at most `max_adapters` are tracked."""

    def __init__(self, half_life_s: float = 30.0, max_adapters: int = 4096):
        if half_life_s <= 0 or max_adapters < 1:
            raise InvalidConfigError("half_life_s must be > 0 and max_adapters >= 1")
        self.tau = half_life_s / math.log(2)
        self.max_adapters = max_adapters
        self._rates: dict[AdapterKey, tuple[float, float]] = {}  # adapter -> (rate, at time)

    def arrived(self, adapter: AdapterKey, now: float) -> None:
        self._rates[adapter] = (self.rate(adapter, now) + 1.0 / self.tau, now)
        if len(self._rates) > self.max_adapters:  # forget the least popular
            del self._rates[min(self._rates, key=lambda k: self.rate(k, now))]

    def rate(self, adapter: AdapterKey, now: float) -> float:
        rate, at = self._rates.get(adapter, (0.0, now))
        return rate * math.exp(-max(0.0, now - at) / self.tau)

    def likelihood(self, adapter: AdapterKey, now: float, horizon_s: float) -> float:
        """Chance of at least one request for `adapter` within `horizon_s` (Poisson at its rate)."""
        return 1.0 - math.exp(-self.rate(adapter, now) * horizon_s)

    def most_popular(self, now: float, n: int) -> list[tuple[AdapterKey, float]]:
        ranked = sorted(((k, self.rate(k, now)) for k in self._rates), key=lambda kv: (-kv[1], kv[0]))
        return ranked[:n]


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
