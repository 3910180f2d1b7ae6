"""The fresh workers' placement views, indexed so that a placement looks only at its likely winners.

`Placement.choose` over a large cluster costs three groups of workers (`Placement._candidates`):
those holding or loading the request's adapter, the least loaded and the busiest. Here the first group
is bounded too: of many holders (a popular adapter), the `prune_keep` least loaded and busiest. `LoadIndex` keeps
what finds them without a pass over the cluster: the views in a list, the workers in order of load
(a sorted list, kept by bisection as loads change), and which workers hold each adapter (kept from the
difference of a worker's adapter sets, old and new). A change of one worker costs O(workers) in
C-level list moves and O(adapters that changed) in set updates; a placement costs O(candidates).
"""

from __future__ import annotations

import bisect
from collections.abc import Set as AbstractSet

from loraserve.scheduler.placement import BY_LOAD, Demand, Placement, WorkerLoad
from loraserve.wire import AdapterKey


class LoadIndex:
    """Placement views by position, in load order, and by adapter (module docstring)."""

    def __init__(self, loads: list[WorkerLoad]):
        self.loads = loads
        self.position = {w.worker_id: i for i, w in enumerate(loads)}
        self._order = sorted((w.requests, w.worker_id) for w in loads)
        self._holders: dict[AdapterKey, set[str]] = {}
        for w in loads:
            for adapter in w.adapters:
                self._holders.setdefault(adapter, set()).add(w.worker_id)

    def set(self, i: int, load: WorkerLoad) -> None:
        """Replace the view at position `i` (the same worker's, changed)."""
        old = self.loads[i]
        self.loads[i] = load
        if old.requests != load.requests:
            del self._order[bisect.bisect_left(self._order, (old.requests, old.worker_id))]
            bisect.insort(self._order, (load.requests, load.worker_id))
        if old.adapters is not load.adapters:
            worker_id = load.worker_id
            for adapter in old.adapters - load.adapters:
                holders = self._holders.get(adapter)
                if holders is not None:
                    holders.discard(worker_id)
                    if not holders:
                        del self._holders[adapter]
            for adapter in load.adapters - old.adapters:
                self._holders.setdefault(adapter, set()).add(worker_id)

    def choose(
        self, placement: Placement, d: Demand, need_room: bool = True, excluded: AbstractSet[str] = frozenset()
    ) -> WorkerLoad | None:
        """`placement.choose` over every worker but `excluded`, costing only the candidates in a large cluster."""
        if len(self.loads) <= placement.prune_above:
            loads = [w for w in self.loads if w.worker_id not in excluded] if excluded else self.loads
            return placement.choose(loads, d, need_room)
        loads, position, keep = self.loads, self.position, placement.prune_keep
        tokens = d.prompt_len + d.max_new_tokens

        def fits(w: WorkerLoad) -> bool:
            if w.worker_id in excluded:
                return False
            return not need_room or (
                w.requests < w.max_batch and -(-tokens // max(1, w.tokens_per_page)) <= w.room_pages
            )

        holders = self._holders.get(d.adapter, ()) if d.adapter is not None else ()
        affine = [w for w in (loads[position[worker_id]] for worker_id in holders) if fits(w)]
        if len(affine) > 2 * keep:  # a popular adapter: its least loaded and busiest holders
            affine.sort(key=BY_LOAD)
            affine = [*affine[:keep], *affine[-keep:]]
        chosen = {w.worker_id: w for w in affine}
        for order in (self._order, reversed(self._order)):
            found = 0
            for _, worker_id in order:
                w = loads[position[worker_id]]
                if fits(w):
                    chosen.setdefault(worker_id, w)
                    found += 1
                    if found == keep:
                        break
        return placement.choose(list(chosen.values()), d, need_room=False)
