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

import operator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

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
    prune_above: int = 16  # with more workers with room than this, only `_candidates` are costed
    prune_keep: int = 4  # the least and the most loaded kept as candidates

    def _candidates(self, workers: list[WorkerLoad], d: Demand) -> list[WorkerLoad]:
        """The workers that can win in a large cluster: those holding, loading or batching the request's
        adapter (affinity), the `prune_keep` least loaded (the cheapest steps) and the `prune_keep` busiest
        (where near-ties go). Loads decide the rest of the cost, so a worker outside these three groups
        is cheaper than all of them only when its batch is unusually cheap for its size; what placement
        gains is a cost linear in the candidates, not in the cluster (docs/benchmarks.md, "Control plane")."""
        adapter = d.adapter
        chosen = {w.worker_id: w for w in workers if adapter in w.adapters} if adapter is not None else {}
        by_load = sorted(workers, key=BY_LOAD)
        for w in (*by_load[: self.prune_keep], *by_load[-self.prune_keep :]):
            chosen.setdefault(w.worker_id, w)
        return list(chosen.values())

    def fits(self, w: WorkerLoad, d: Demand) -> bool:
        return w.requests < w.max_batch and d.kv_pages(w.tokens_per_page) <= w.room_pages

    def cost_on(self, w: WorkerLoad, d: Demand) -> float:
        return self._cost(w, d, self.cost.coef())

    def _cost(self, w: WorkerLoad, d: Demand, coef: tuple[float, ...]) -> float:
        """The module docstring's cost. The model is linear, so each step r joins costs the batch's step
        plus r's share: its tokens and rank-tokens, its segment if new, its KV pages."""
        base, per_token, per_rank_token, per_adapter, per_kv_page = coef
        b = w.batch
        decode = base + per_token * b.tokens + per_rank_token * b.rank_tokens + per_adapter * b.adapters
        decode += per_kv_page * b.kv_pages  # step_s(w.batch), inline: this runs for every worker of every placement
        adapter = d.adapter
        joins = per_kv_page * d.kv_pages(w.tokens_per_page)  # r's KV and its segment, in every step it is in
        miss = 0.0
        if adapter is not None:
            if adapter not in w.batch_adapters:
                joins += per_adapter
            if adapter not in w.adapters:
                miss = self.adapter_load_s
        per_computed = per_token + per_rank_token * d.rank
        computed = d.prompt_len - (d.cached_tokens(w) if d.prefix is not None and w.prefixes else 0)
        ttft = (w.waiting + 1) * decode + per_computed * computed + joins + miss  # waits, then r's prefill step
        added = per_computed + joins  # what r's decode token adds to a step: with_r - decode
        return ttft + d.expected_output * (decode + added + w.requests * added)

    def choose(self, workers: list[WorkerLoad], d: Demand, need_room: bool = True) -> WorkerLoad | None:
        """The cheapest worker with room (or, with need_room False, the cheapest at all: where the
        request would go once room frees up, for prediction). Beyond `prune_above` workers the cost is
        computed only for the likely winners (`_candidates`)."""
        coef = self.cost.coef()
        if need_room:  # `fits`, inline: this runs for every worker of every placement
            tokens = d.prompt_len + d.max_new_tokens
            fitting = [w for w in workers if w.requests < w.max_batch and _pages(tokens, w) <= w.room_pages]
        else:
            fitting = workers
        if len(fitting) > self.prune_above:
            fitting = self._candidates(fitting, d)
        costs = [(self._cost(w, d, coef), w) for w in fitting]
        if not costs:
            return None
        near = min(c for c, _ in costs) * (1 + self.tie) + 1e-9
        return max((cw for cw in costs if cw[0] <= near), key=_busiest_cheapest)[1]


def _pages(tokens: int, w: WorkerLoad) -> int:
    return -(-tokens // max(1, w.tokens_per_page))


def _busiest_cheapest(cost_and_worker: tuple[float, WorkerLoad]) -> tuple[int, float, str]:
    cost, w = cost_and_worker
    return w.requests, -cost, w.worker_id


BY_LOAD = operator.attrgetter("requests", "worker_id")  # least loaded first, then by id
