"""Batch shares: how many of a worker's batch slots one client request, and one tenant, may hold. Pure.

Fair ordering (VTC, `fairness.py`) decides who goes first when a slot frees; it cannot help once one
request has filled a worker's batch: an HTTP body of 64 generations (prompts × n, or best_of), or a gRPC
client's n calls of one prefill group, would hold all 64 slots of a worker and every other tenant waits
for them to end. So placement bounds, per worker:

- a client request (`QueuedRequest.request_key`: the generations of one HTTP body, or of one gRPC
  prefill group; a request of its own otherwise) to `request_batch_share` of its `max_batch_size`
  slots (at least 1), always;
- a tenant to `tenant_batch_share` of them (at least 1), only while another tenant has requests
  queued: a tenant alone (a single-tenant deployment) may fill every slot. Only under the `adaptive`
  policy: `fcfs`, the baseline, has no fairness between tenants.

A request held back by its share stays queued, where fair ordering applies, and goes where its share
allows (another worker) or when its own generations end. `Holdings` counts, per worker, the requests
this scheduler placed there by client request and by tenant (the cluster view keeps it as requests
are placed and end); `BatchShare.full` answers which workers a request may not go to now.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError

if TYPE_CHECKING:
    from loraserve.scheduler.cluster import WorkerView
    from loraserve.scheduler.decisions import QueuedRequest


@dataclass(frozen=True)
class BatchShareConfig:
    """The shares of a worker's batch slots a client request and a tenant may hold."""

    request_batch_share: float = setting(
        0.25,
        "share of a worker's batch slots (max_batch_size) one client request may hold, at least 1: the "
        "generations of one HTTP body (prompts x n, best_of) or of one gRPC prefill_group; the rest stays queued",
    )
    tenant_batch_share: float = setting(
        0.5,
        "share of a worker's batch slots one tenant may hold, at least 1, while another tenant has requests "
        "queued (a tenant alone may fill the batch); adaptive policy only",
    )

    def __post_init__(self) -> None:
        for name in ("request_batch_share", "tenant_batch_share"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise InvalidConfigError(f"{name} must be in (0, 1], got {value}")


def slots_of(share: float, max_batch: int) -> int:
    """The slots `share` of a batch of `max_batch` allows: at least 1."""
    return max(1, math.floor(share * max_batch))


@dataclass
class Holdings:
    """Per worker, the requests placed there (and not ended) by client request key and by tenant."""

    by_request: dict[str, Counter[str]] = field(default_factory=dict)  # request key -> worker id -> held
    by_tenant: dict[str, Counter[str]] = field(default_factory=dict)  # tenant -> worker id -> held
    tenants: Counter[str] = field(default_factory=Counter)  # tenant -> held on every worker (positive only)

    def add(self, worker_id: str, request: QueuedRequest) -> None:
        self.by_request.setdefault(request.request_key, Counter())[worker_id] += 1
        self.by_tenant.setdefault(request.tenant, Counter())[worker_id] += 1
        self.tenants[request.tenant] += 1

    def remove(self, worker_id: str, request: QueuedRequest) -> None:
        _take(self.by_request, request.request_key, worker_id)
        _take(self.by_tenant, request.tenant, worker_id)
        self.tenants[request.tenant] -= 1
        if self.tenants[request.tenant] <= 0:
            del self.tenants[request.tenant]


def _take(counts: dict[str, Counter[str]], key: str, worker_id: str) -> None:
    held = counts.get(key)
    if held is None:
        return
    held[worker_id] -= 1
    if held[worker_id] <= 0:
        del held[worker_id]
        if not held:
            del counts[key]


@dataclass(frozen=True)
class Full:
    """The workers a request may not go to now: where its client request, or its tenant, holds its share."""

    by_request: frozenset[str] = frozenset()
    by_tenant: frozenset[str] = frozenset()

    @property
    def workers(self) -> frozenset[str]:
        return self.by_request | self.by_tenant


NOT_FULL = Full()


class BatchShare:
    """The share rule (module docstring) over the cluster view's `Holdings`."""

    def __init__(self, config: BatchShareConfig, holdings: Holdings):
        self.config = config
        self.holdings = holdings

    def full(self, request: QueuedRequest, workers: Mapping[str, WorkerView], others_waiting: bool) -> Full:
        """The workers where `request` may not go now (`others_waiting`: another tenant has requests
        queued). Costs the workers holding its client request's (and, with others waiting, its tenant's)
        requests, not the cluster: ask the tenant's only when `tenant_full` says the chosen worker is."""
        config = self.config
        by_request = _at_share(self.holdings.by_request.get(request.request_key), config.request_batch_share, workers)
        by_tenant: frozenset[str] = frozenset()
        if others_waiting:
            by_tenant = _at_share(self.holdings.by_tenant.get(request.tenant), config.tenant_batch_share, workers)
        return Full(by_request, by_tenant) if by_request or by_tenant else NOT_FULL

    def tenant_full(self, request: QueuedRequest, view: WorkerView) -> bool:
        """Whether `request`'s tenant holds its share of `view`'s slots (a question about one worker)."""
        held = self.holdings.by_tenant.get(request.tenant)
        slots = slots_of(self.config.tenant_batch_share, view.report.max_batch_size)
        return held is not None and held.get(view.worker_id, 0) >= slots


def _at_share(held: Counter[str] | None, share: float, workers: Mapping[str, WorkerView]) -> frozenset[str]:
    """The workers of `held` where it holds `share` of the slots or more."""
    if not held:
        return frozenset()
    full = []
    for worker_id, n in held.items():
        view = workers.get(worker_id)
        if view is not None and n >= slots_of(share, view.report.max_batch_size):
            full.append(worker_id)
    return frozenset(full)
