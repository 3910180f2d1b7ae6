"""Iteration-level scheduling inside one worker: which requests run in the next step.

A pure object over the page pool's bookkeeping (no tensors, no I/O), so its policies are tested
directly. Each `schedule()`:

1. Running requests, oldest first, get their next tokens (1 when decoding, a chunk of the prompt
   when prefilling) within the step's token budget. If the pool has no page for a request's new
   KV, unused adapters are evicted (LRU); if that is not enough, the newest running request is
   preempted: its KV is freed and it goes back to the front of the queue, to be recomputed later.
2. Waiting requests, first come first served, join while there is batch room, token budget and
   pool room (their adapter's pages plus KV for their first chunk). A request never preempts
   others to get in, and the queue's head is not overtaken.

The scheduled requests are ordered so that requests of one adapter are consecutive (Punica's
segments). An adapter a request needs is made resident through the unified pool, which copies it
in if no prefetch did. The plan is plain data: `scheduled` for the engine's update, `batch`, one
`SeqChunk` per scheduled request, and `kv_copies`, all the runner reads.

Shared prefill: a waiting request of a group (`Request.group`) whose prompt and adapter a running
member has (the donor) does not compute its prompt again. While the donor is still prefilling it
waits at the head of the queue; once the donor's KV covers all but the last prompt token, it is
admitted with that KV copied from the donor's pages (`kv_copies`, done by the runner before the
step's forward pass) and computes only the last prompt token, whose logits give its own first
token. A donor that finished or was preempted is none: the request then prefills on its own.

Only the engine's update changes a request's tokens, positions and timestamps; this scheduler
changes only its status (waiting / running) and what it holds in the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loraserve.prefix_keys import extend_chain, is_checkpoint
from loraserve.wire import AdapterKey
from loraserve.worker.request import FinishReason, Request, Status
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.unified_pool import AdapterSlot, UnifiedPool


@dataclass(frozen=True)
class SampleSpec:
    """How to choose a sequence's next token: its parameters, its seed, its history (penalties, position)."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    # Structured output: the request's grammar matcher (`worker/grammar.py`), which the runner only
    # reads (the step's mask); the engine's update advances it.
    guide: Any = None


@dataclass(frozen=True)
class PromptScoring:
    """Score prompt tokens in this chunk: row j of the chunk predicts targets[j] (the prompt token after
    it); report each one's log-probability and its `top` most likely alternatives (`worker/logprobs.py`)."""

    top: int
    targets: list[int]


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step, as plain data: what the runner computes for it."""

    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start: int  # the position of the first of them (= tokens already in the KV cache)
    kv_pages: list[int]  # the sequence's KV page table, covering start + len(token_ids) tokens
    adapter: AdapterSlot | None
    sample: SampleSpec | None  # set when this chunk ends the known tokens: sample the next one
    scoring: PromptScoring | None = None  # set when the request asked for its prompt's log-probabilities


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Request] = field(default_factory=list)
    batch: list[SeqChunk] = field(default_factory=list)  # `scheduled` as the runner sees it, same order
    kv_copies: list[tuple[int, int]] = field(default_factory=list)  # (donor's KV page, receiver's), before the step

    @property
    def adapters(self) -> list[AdapterKey]:
        """The distinct adapters of the step, in batch order."""
        return list(dict.fromkeys(r.spec.adapter_key for r, _ in self.scheduled if r.spec.adapter_key is not None))


class StepScheduler:
    """Which requests run in the next step, and how many tokens each: the waiting and running
    queues, admission against the pool, preemption by recompute. Pure: no tensors, no I/O."""

    def __init__(self, pool: UnifiedPool, max_batch_size: int, max_batched_tokens: int):
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.shared_prefill_tokens = 0  # cumulative: prompt tokens copied from a group's donor, not computed
        self.cached_tokens = 0  # cumulative: tokens whose KV admission found in cached pages
        self.admitted_tokens = 0  # cumulative: tokens of the requests admitted (what the cache could hold)

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Release everything `request` holds (KV pages, adapter pin) and mark it finished."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status, request.finish_reason, request.error = Status.FINISHED, reason, error

    def _release(self, request: Request) -> None:
        self.pool.pages.free_kv(request.request_id)
        if (key := request.spec.adapter_key) is not None:
            self.pool.pages.unpin(key)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        request.status, request.num_computed = Status.WAITING, 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._room_for_running(request, n, plan):
                continue  # it preempted itself
            plan.scheduled.append((request, n))
            budget -= n
        if not plan.preempted:  # after a preemption the pool is tight: let the running batch drain first
            self._admit(plan, budget)
        plan.scheduled.sort(key=lambda item: (item[0].spec.adapter_key is None, item[0].spec.adapter_key or ("", 0)))
        plan.batch = [self._chunk(request, n) for request, n in plan.scheduled]
        return plan

    def _chunk(self, request: Request, n: int) -> SeqChunk:
        start = request.num_computed
        sample = None
        if start + n == request.num_tokens:
            spec = request.spec
            sample = SampleSpec(spec.sampling, request.seed, spec.prompt_ids, request.output_ids, request.guide)
        key = request.spec.adapter_key
        adapter = self.pool.slot(key) if key is not None else None
        kv_pages = self.pool.pages.kv_page_table(request.request_id)
        tokens = request.token_ids(start, start + n)
        return SeqChunk(request.request_id, tokens, start, kv_pages, adapter, sample, _scoring(request, start, n))

    def _room_for_running(self, request: Request, n: int, plan: StepPlan) -> bool:
        target = request.num_computed + n
        while not self.pool.pages.grow_kv(request.request_id, target):
            need = self.pool.pages.kv_pages_to_grow(request.request_id, target)
            if self.pool.make_room(need, for_kv=True):
                continue
            victim = self.running[-1]
            if victim is request:
                self._preempt(request, plan)
                return False
            self._preempt(victim, plan)
            plan.scheduled = [(r, k) for r, k in plan.scheduled if r is not victim]
        return True

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            donor = self._donor(request)
            if donor is _PREFILLING:
                return  # its prompt's KV is being computed: it waits to copy it
            key = request.spec.adapter_key
            keep = frozenset(r.spec.adapter_key for r in self.running if r.spec.adapter_key is not None)
            if key is not None and not self.pool.ensure(key, keep):
                return
            looked_up = self._attach_cached(request)  # tokens whose KV is in cached pages, now its own first pages
            cached = looked_up or 0
            shared = len(request.spec.prompt_ids) - 1 if donor is not None else 0  # tokens whose KV it copies
            start = max(cached, shared)
            n = min(request.num_tokens - start, budget)
            target = start + n
            need = self.pool.pages.kv_pages_to_grow(request.request_id, target)
            keep_with_own = keep | ({key} if key else set())
            if not (
                self.pool.make_room(need, keep=frozenset(keep_with_own), for_kv=True)
                and self.pool.pages.grow_kv(request.request_id, target)
            ):
                self.pool.pages.free_kv(request.request_id)  # the cached pages it attached go back
                return
            self.waiting.popleft()
            request.num_computed = cached
            if request.first_token is None:
                request.cached_tokens = cached
            if looked_up is not None:  # counted once it is admitted: a failed admission is tried again
                self.admitted_tokens += request.num_tokens
                self.cached_tokens += cached
            if shared > cached:
                self._share_prefill(donor, request, shared, plan)
            if key is not None:
                self.pool.pages.pin(key)
            request.status = Status.RUNNING
            self.running.append(request)
            plan.scheduled.append((request, n))
            budget -= n

    def _donor(self, request: Request) -> Request | object | None:
        """The running member of `request`'s group whose prompt KV it can copy; `_PREFILLING` while that
        member is still computing it; None when there is none (it prefills on its own)."""
        spec = request.spec
        if spec.group is None or request.num_computed or len(spec.prompt_ids) < 2:
            return None
        for member in self.running:
            if (
                member.spec.group == spec.group
                and member.spec.adapter_key == spec.adapter_key
                and member.spec.prompt_ids == spec.prompt_ids
                and (request.prompt_logprobs is None or member.prompt_logprobs is not None)
            ):
                return member if member.num_computed >= len(spec.prompt_ids) - 1 else _PREFILLING
        return None

    def _share_prefill(self, donor: Request, request: Request, shared: int, plan: StepPlan) -> None:
        """Start `request` past its first `shared` tokens, their KV copied from `donor`'s pages (after
        the pages it attached from the cache, which hold the same KV already)."""
        per_page = self.pool.layout.tokens_per_page
        first, pages = request.num_computed // per_page, -(-shared // per_page)
        plan.kv_copies += zip(
            self.pool.pages.kv_page_table(donor.request_id)[first:pages],
            self.pool.pages.kv_page_table(request.request_id)[first:pages],
            strict=True,
        )
        copied = shared - request.num_computed  # the tokens past the pages found cached
        request.num_computed = shared
        if request.prompt_logprobs is not None:
            request.prompt_logprobs = list(donor.prompt_logprobs)
        request.shared_prefill_tokens = copied
        self.shared_prefill_tokens += copied

    def _attach_cached(self, request: Request) -> int | None:
        """Attach the cached pages of `request`'s longest cached prefix as its first pages; the tokens they
        hold. Never its last known token (its logits are needed), and not for a request scoring its prompt
        (every prompt row must be computed): None when it does not look (caching off, or such a request)."""
        if request.chain_root is None or request.num_computed or request.prompt_logprobs is not None:
            return None
        per_page = self.pool.layout.tokens_per_page
        usable = (request.num_tokens - 1) // per_page
        hashed = len(request.block_hashes) * per_page
        extend_chain(request.block_hashes, request.chain_root, request.token_ids(hashed, usable * per_page), per_page)
        pages = self.pool.pages.prefixes.lookup(request.block_hashes[:usable])
        if pages:
            self.pool.pages.attach_kv(request.request_id, pages)
        request.registered_pages = len(pages)
        return len(pages) * per_page

    def cache_computed(self, request: Request) -> None:
        """Register `request`'s pages its computed KV now fills (prefix caching; after each step)."""
        if request.chain_root is None or request.fingerprints is None:
            return
        per_page = self.pool.layout.tokens_per_page
        full = request.num_computed // per_page
        if full <= request.registered_pages:
            return
        hashed = len(request.block_hashes) * per_page
        if hashed < full * per_page:
            extend_chain(request.block_hashes, request.chain_root, request.token_ids(hashed, full * per_page), per_page)
        for index in range(request.registered_pages, full):
            blocks = index + 1  # a checkpoint prefix's last page carries its fingerprint, for the scheduler
            mark = request.fingerprints.at(blocks, request.token_ids, per_page) if is_checkpoint(blocks) else None
            self.pool.pages.register_kv_page(request.request_id, index, request.block_hashes[index], mark)
        request.registered_pages = full


_PREFILLING = object()  # `_donor`'s answer while the donor's prefill is under way


def _scoring(request: Request, start: int, n: int) -> PromptScoring | None:
    """The prompt tokens chunk [start, start + n) predicts, while the request's prompt is being scored:
    position p predicts token p + 1, and the last prompt position predicts the first output token,
    whose log-probability comes with its sampling."""
    if request.prompt_logprobs is None or request.output_ids:
        return None  # not asked for, or already reported with the first token
    targets = request.spec.prompt_ids[start + 1 : start + 1 + n]
    return PromptScoring(request.spec.sampling.prompt_logprobs or 0, targets) if targets else None
