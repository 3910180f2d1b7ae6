"""The scheduler's waiting queue, two ways: plain FCFS, and Chameleon's multi-queue under VTC fairness.

Both hold `QueuedRequest`s by id and answer the same questions:

    push(request, front)        queue it (front: a resumed request, admitted before)
    remove(request_id)          -> the request, or None
    next_candidate(now, passed, capped, at_share)
                                the next request to try to place, given those that could not be
                                placed this round (`passed`), the tenants at their share of the
                                batch slots (`capped`) and the client requests at theirs (`at_share`,
                                by `request_key`: skipped, never a reason to stop); None: stop
                                placing this round
    tenants_waiting()           how many tenants have requests queued
    taken(request)              it was placed (fairness counters are charged here)
    ahead(request, now)         about how many queued requests go before it (for admission)
    iteration                   request ids in dispatch order (prediction, tests)

`FifoQueue` is today's baseline: first come, first served, the head waits and nobody overtakes it
(except a head held back by its batch share: skipped, it waits where it is).

`MultiQueue` (Chameleon, Iliakopoulou et al. 2024, §4): a request's *weighted size* is its prompt,
plus its expected output, plus a term for its adapter's rank (a big adapter costs a load and LoRA
FLOPs); sizes fall into classes by `SizeClasses.bounds`, and the smallest class goes first, so a
short request is not stuck behind long ones (head-of-line blocking is what makes FCFS tails heavy).
Across tenants, the tenant with the smallest virtual token counter goes first (VTC,
`fairness.py`); within a tenant, the class order above, except that a request that has waited
`starvation_s` is *starved*: it goes before its tenant's other requests, and once its tenant's turn
comes nothing overtakes it any more, so a long request waits at most the bound plus its tenant's
fair share of the time (and the time a worker needs to make room for it). Starvation does not
cross tenants: a flood of old requests must not outrank a calm tenant's new one. Resumed requests
(failed over from a lost worker) go before everything, as in FCFS.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError
from loraserve.scheduler.fairness import VirtualTokenCounter

if TYPE_CHECKING:
    from loraserve.scheduler.decisions import QueuedRequest


class _Entries:
    """What both queues answer from `_entries` (request id -> entry, in arrival order): the queue's
    length, membership, and the ids in arrival order (a copy: safe to remove while iterating)."""

    _entries: OrderedDict

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))


class FifoQueue(_Entries):
    """First come, first served (the `fcfs` policy): resumed requests at the head, nobody overtakes."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, QueuedRequest] = OrderedDict()
        self._tenants: Counter[str] = Counter()  # tenant -> its requests queued

    def values(self) -> list[QueuedRequest]:
        return list(self._entries.values())

    def push(self, request: QueuedRequest, front: bool = False) -> None:
        if request.request_id not in self._entries:
            self._tenants[request.tenant] += 1
        self._entries[request.request_id] = request
        if front:
            self._entries.move_to_end(request.request_id, last=False)

    def remove(self, request_id: str) -> QueuedRequest | None:
        request = self._entries.pop(request_id, None)
        if request is not None:
            self._tenants[request.tenant] -= 1
            if not self._tenants[request.tenant]:
                del self._tenants[request.tenant]
        return request

    def clear(self) -> None:
        self._entries.clear()
        self._tenants.clear()

    def tenants_waiting(self) -> int:
        return len(self._tenants)

    def next_candidate(
        self, now: float, passed: set[str], capped: Collection[str] = (), at_share: Collection[str] = ()
    ) -> QueuedRequest | None:
        """The head, past those held back by their share (`capped`, `at_share`); None if it was passed."""
        head = next(
            (r for r in self._entries.values() if r.tenant not in capped and r.request_key not in at_share), None
        )
        return None if head is None or head.request_id in passed else head

    def taken(self, request: QueuedRequest) -> None:
        pass

    def ahead(self, request: QueuedRequest, now: float) -> int:
        return len(self._entries)

    def upcoming(self, now: float, n: int) -> list[QueuedRequest]:
        return list(itertools.islice(self._entries.values(), n))


@dataclass(frozen=True)
class SizeClasses:
    """Weighted request size (Chameleon): prompt + output_weight·expected output + rank_weight·rank."""

    bounds: tuple[float, ...] = setting(
        (256.0, 1024.0, 4096.0),
        "weighted request sizes bounding the queues' size classes, increasing (class i holds sizes <= bound i; "
        "one more class above); repeat the flag for each",
        flag="--size-class-bound",
    )
    output_weight: float = setting(
        1.0, "size units per expected output token (an output token costs a step each)", flag="--size-output-weight"
    )
    rank_weight: float = setting(8.0, "size units per unit of adapter rank", flag="--size-rank-weight")
    default_rank: int = setting(16, "adapter rank assumed when a request's is unknown", flag="--size-default-rank")

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds) or any(b <= 0 for b in self.bounds):
            raise InvalidConfigError(f"size class bounds must be positive and increasing, got {self.bounds}")
        if self.output_weight < 0 or self.rank_weight < 0 or self.default_rank < 0:
            raise InvalidConfigError(f"invalid size weights {self}")

    def size(self, request: QueuedRequest) -> float:
        rank = request.rank or (self.default_rank if request.adapter is not None else 0)
        return request.prompt_len + self.output_weight * request.max_new_tokens + self.rank_weight * rank

    def of(self, request: QueuedRequest) -> int:
        size = self.size(request)
        return next((i for i, bound in enumerate(self.bounds) if size <= bound), len(self.bounds))


class MultiQueue(_Entries):
    """Size classes per tenant, the smallest first; tenants by VTC; starved and resumed ones first."""

    def __init__(self, classes: SizeClasses, starvation_s: float, fairness: VirtualTokenCounter):
        if starvation_s <= 0:
            raise InvalidConfigError(f"starvation_s must be positive, got {starvation_s}")
        self.classes = classes
        self.starvation_s = starvation_s
        self.fairness = fairness
        self._entries: OrderedDict[str, tuple[int, QueuedRequest]] = OrderedDict()  # arrival order
        self._resumed: deque[tuple[int, str]] = deque()
        # tenant -> one FIFO per size class of (sequence, request id); stale entries are skipped lazily
        self._tenants: dict[str, list[deque[tuple[int, str]]]] = {}
        self._counts: dict[str, list[int]] = {}  # tenant -> live requests per class
        self._seq = itertools.count()

    def values(self) -> list[QueuedRequest]:
        return [request for _, request in self._entries.values()]

    def push(self, request: QueuedRequest, front: bool = False) -> None:
        self.remove(request.request_id)
        seq = next(self._seq)
        self._entries[request.request_id] = (seq, request)
        if front:
            self._entries.move_to_end(request.request_id, last=False)
            self._resumed.append((seq, request.request_id))
        tenant, cls = request.tenant, self.classes.of(request)
        if tenant not in self._counts or not any(self._counts[tenant]):
            self.fairness.activate(tenant)
        self._tenants.setdefault(tenant, [deque() for _ in range(len(self.classes.bounds) + 1)])[cls].append(
            (seq, request.request_id)
        )
        self._counts.setdefault(tenant, [0] * (len(self.classes.bounds) + 1))[cls] += 1

    def remove(self, request_id: str) -> QueuedRequest | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        request = entry[1]
        counts = self._counts[request.tenant]
        counts[self.classes.of(request)] -= 1
        if not any(counts):  # the tenant has nothing queued any more
            del self._counts[request.tenant], self._tenants[request.tenant]
            self.fairness.deactivate(request.tenant)
        return request

    def clear(self) -> None:
        for request_id in list(self._entries):
            self.remove(request_id)

    def _live(
        self, queue: deque[tuple[int, str]], passed: Collection[str], at_share: Collection[str] = ()
    ) -> QueuedRequest | None:
        """The first live entry of `queue` not in `passed` nor of a client request in `at_share` (dropping
        stale entries at its head)."""
        while queue and not self._is_live(queue[0]):
            queue.popleft()
        for seq, request_id in queue:
            if request_id not in passed and self._is_live((seq, request_id)):
                request = self._entries[request_id][1]
                if request.request_key not in at_share:
                    return request
        return None

    def _is_live(self, item: tuple[int, str]) -> bool:
        entry = self._entries.get(item[1])
        return entry is not None and entry[0] == item[0]

    def next_candidate(
        self, now: float, passed: set[str], capped: Collection[str] = (), at_share: Collection[str] = ()
    ) -> QueuedRequest | None:
        # resumed ones first, in order; a passed one stops the round (nobody overtakes it)
        while self._resumed and not self._is_live(self._resumed[0]):
            self._resumed.popleft()
        if self._resumed:
            request = self._live(self._resumed, (), at_share)  # those held back by their share: skipped
            if request is not None:
                return None if request.request_id in passed else request
        # then the tenants by VTC counter; a tenant's candidate is its starved one, else its smallest
        for _, tenant in sorted((self.fairness.counter(t), t) for t in self._tenants if t not in capped):
            oldest = self._oldest(tenant)
            if oldest is not None and now - oldest.enqueued >= self.starvation_s and oldest.request_key not in at_share:
                return None if oldest.request_id in passed else oldest
            request = next(
                (r for q in self._tenants[tenant] if (r := self._live(q, passed, at_share)) is not None), None
            )
            if request is not None:
                return request
        return None

    def tenants_waiting(self) -> int:
        return len(self._counts)

    def _oldest(self, tenant: str) -> QueuedRequest | None:
        heads = [(q[0][0], q[0][1]) for q in self._tenants[tenant] if self._live(q, set()) is not None]
        return self._entries[min(heads)[1]][1] if heads else None

    def backlogs(self) -> dict[str, int]:
        """Requests queued per tenant (those with any)."""
        return {t: sum(counts) for t, counts in self._counts.items()}

    def count(self, tenant: str) -> int:
        return sum(self._counts.get(tenant, ()))

    def upcoming(self, now: float, n: int) -> list[QueuedRequest]:
        """About the next `n` in dispatch order: resumed, starved, then by (class, tenant counter, age)."""
        first = [self._entries[i][1] for s, i in self._resumed if self._is_live((s, i))]
        first += [r for _, r in self._entries.values() if now - r.enqueued >= self.starvation_s and r not in first]
        if len(first) >= n:
            return first[:n]
        chosen = {r.request_id for r in first}
        rest = heapq.nsmallest(
            n - len(first),
            ((s, r) for s, r in self._entries.values() if r.request_id not in chosen),
            key=lambda e: (self.classes.of(e[1]), self.fairness.counter(e[1].tenant), e[0]),
        )
        return first + [r for _, r in rest]

    def taken(self, request: QueuedRequest) -> None:
        self.fairness.charge(request.tenant, request.prompt_len, request.max_new_tokens)

    def ahead(self, request: QueuedRequest, now: float) -> int:
        """About how many go first: resumed ones, the tenant's own starved ones and those of no
        larger class, and from every other tenant as many of no larger class as VTC interleaves
        (one per own)."""
        cls = self.classes.of(request)
        first = len(self._resumed)
        first += sum(
            1
            for _, r in self._entries.values()
            if r.tenant == request.tenant and now - r.enqueued >= self.starvation_s and self.classes.of(r) > cls
        )
        own = sum(self._counts.get(request.tenant, [])[: cls + 1])
        others = sum(
            min(sum(counts[: cls + 1]), own + 1) for tenant, counts in self._counts.items() if tenant != request.tenant
        )
        return min(len(self._entries), first + own + others)
