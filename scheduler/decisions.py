"""What the policy is given and what it decides: the queued request, and the decisions it returns to the loop.

`QueuedRequest` is the policy's view of one request (the loop builds it at Submit); the decisions are
plain data the loop executes: ASSIGN, CANCEL and PREFETCH to workers, failures to gateways.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.prefix_keys import PrefixProbe
from loraserve.wire import AdapterKey


@dataclass
class QueuedRequest:
    """One request as the policy sees it, from Submit until it ends: what placement and fairness need."""

    request_id: str
    adapter: AdapterKey | None
    prompt_len: int
    max_new_tokens: int
    reply_to: str
    arrival: float
    deadline: float | None = None
    enqueued: float = 0.0
    tenant: str = ""  # whose request (VTC fairness); "" is a tenant like any other
    ttft_slo_s: float | None = None  # time-to-first-token target from `arrival`; refused early if missed
    rank: int = 0  # the adapter's LoRA rank; 0: unknown (SizeClasses.default_rank is assumed)
    attempt: int = 0  # earlier attempts lost (failover, migration): only attempt 0 migrates
    placed_at: float = 0.0  # when it was assigned to a worker (set by the policy)
    group: str | None = None  # shared prefill: placed beside the group's other requests when there is room
    prefix: PrefixProbe | None = None  # prefix caching: its checkpoint fingerprints (adaptive placement)
    request_key: str = ""  # the client request it belongs to (its batch share is counted per key); "": its id

    def __post_init__(self) -> None:
        if not self.request_key:  # a request of its own
            self.request_key = self.request_id


# ---- decisions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AssignTo:
    worker_id: str
    request: QueuedRequest


@dataclass(frozen=True)
class CancelOn:
    worker_id: str
    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class PrefetchOn:
    worker_id: str
    adapters: tuple[AdapterKey, ...]
    scores: tuple[float, ...] = ()  # parallel to adapters, each in [0, 1]; empty: unknown (fcfs)
    trace: tuple[tuple[str, str], ...] = ()  # a hint's: the trace of the request it is for (`scheduler/hints.py`)


@dataclass(frozen=True)
class Fail:
    request: QueuedRequest
    status: str  # grpc.StatusCode name
    message: str
    retry: bool = False  # its worker was lost: the gateway may resubmit it elsewhere


@dataclass(frozen=True)
class WorkerGone:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Migrate:
    """Move `request` off `worker_id` by recompute: cancel it there, and fail it to its gateway with
    `retry` set, which submits it again (attempt + 1, queued at the head)."""

    worker_id: str
    request: QueuedRequest
    reason: str


Decision = AssignTo | CancelOn | PrefetchOn | Fail | WorkerGone | Migrate
