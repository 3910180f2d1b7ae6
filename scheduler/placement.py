"""Placement by predicted cost, with adapter affinity as a term of the cost.

For a request r and a worker w that has batch and pool room for it, with the step-time model
(`cost_model.py`) and w's current decode batch B (n requests):

    ttft(w)  = waiting(w)·step(B) + step(B + r's prefill) + miss(w)
    cost(w)  = ttft(w) + out(r)·(step(B + r) + n·(step(B + r) - step(B)))

where r's prefill computes only the prompt tokens w has not cached (prefix caching: the longest of
r's checkpoint prefixes w reports, `loraserve/prefix_keys.py`, or that a request just placed there
will leave cached), i.e. the latency r would see (its first token, then `out(r)` decode steps) plus the delay it adds
to the n requests already there: greedy on the sum of latencies. `miss(w)` is the time to load
r's adapter, zero when w holds it or is loading it (it was prefetched there, or a request for it
was just placed there): affinity is a cost term, so a worker holding the adapter wins unless its
load costs more than the load of the adapter elsewhere. A new adapter also adds a segment to the
batch (`per_adapter_s`), which favours workers already batching it (Punica's segments).

Costs within `tie` of the best count as equal, and then the busiest worker wins (Punica §5.1:
consolidate, so that lightly loaded workers drain): with a GPU's nearly flat decode curve the
fitted model makes most costs equal, and placement consolidates; with a CPU's steep one it spreads.
Nothing is placed beyond a worker's batch or pool room, so consolidation never starves a request.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from loraserve.prefix_keys import PrefixProbe
from loraserve.scheduler.cost_model import BatchShape, StepCostModel
from loraserve.wire import AdapterKey


@dataclass(frozen=True)
class WorkerLoad:
    """A worker as placement sees it (built by the policy from the last report and its own assignments)."""

    worker_id: str
    requests: int  # held: running, waiting, and assigned but not yet reported
    waiting: int  # of which not running yet
    max_batch: int
    room_pages: int  # pool pages free or reclaimable, minus what unreported assignments will take
    tokens_per_page: int
    batch: BatchShape  # its decode step now
    adapters: AbstractSet[AdapterKey]  # resident, or being loaded
    batch_adapters: frozenset[AdapterKey]  # adapters of the requests it holds (one segment each)
    prefixes: AbstractSet[bytes] = frozenset()  # fingerprints of the prefixes cached there, or soon to be


@dataclass(frozen=True)
class Demand:
    """What a request asks of a worker."""

    adapter: AdapterKey | None
    rank: int
    prompt_len: int
    max_new_tokens: int
    expected_output: float  # decode steps it will probably take
    prefix: PrefixProbe | None = None  # its prompt's checkpoint fingerprints (None: not cacheable)

    def kv_pages(self, tokens_per_page: int) -> int:
        return -(-(self.prompt_len + self.max_new_tokens) // max(1, tokens_per_page))

    def cached_tokens(self, w: WorkerLoad) -> int:
        """Prompt tokens w would find cached (prefix caching)."""
        return self.prefix.cached_tokens(w.tokens_per_page, w.prefixes) if self.prefix is not None else 0


@dataclass(frozen=True)
class Placement:
    cost: StepCostModel
    adapter_load_s: float = 0.05  # seconds to fetch and install an adapter a worker lacks
    tie: float = 0.05  # relative cost difference that counts as equal (then the busiest wins)

    def fits(self, w: WorkerLoad, d: Demand) -> bool:
        return w.requests < w.max_batch and d.kv_pages(w.tokens_per_page) <= w.room_pages

    def cost_on(self, w: WorkerLoad, d: Demand) -> float:
        pages = d.kv_pages(w.tokens_per_page)
        new_segment = int(d.adapter is not None and d.adapter not in w.batch_adapters)
        decode = self.cost.step_s(w.batch)
        joined = _add(w.batch, 1, d.rank, new_segment, pages)
        computed = d.prompt_len - d.cached_tokens(w)
        prefill = self.cost.step_s(_add(w.batch, computed, d.rank * computed, new_segment, pages))
        miss = self.adapter_load_s if d.adapter is not None and d.adapter not in w.adapters else 0.0
        ttft = w.waiting * decode + prefill + miss
        with_r = self.cost.step_s(joined)
        return ttft + d.expected_output * (with_r + w.requests * (with_r - decode))

    def choose(self, workers: list[WorkerLoad], d: Demand, need_room: bool = True) -> WorkerLoad | None:
        """The cheapest worker with room (or, with need_room False, the cheapest at all: where the
        request would go once room frees up, for prediction)."""
        candidates = [w for w in workers if self.fits(w, d)] if need_room else list(workers)
        if not candidates:
            return None
        costs = {w.worker_id: self.cost_on(w, d) for w in candidates}
        best = min(costs.values())
        near = [w for w in candidates if costs[w.worker_id] <= best * (1 + self.tie) + 1e-9]
        return max(near, key=lambda w: (w.requests, -costs[w.worker_id], w.worker_id))


def _add(batch: BatchShape, tokens: int, rank_tokens: int, adapters: int, pages: int) -> BatchShape:
    return replace(
        batch,
        tokens=batch.tokens + tokens,
        rank_tokens=batch.rank_tokens + rank_tokens,
        adapters=batch.adapters + adapters,
        kv_pages=batch.kv_pages + pages,
    )
