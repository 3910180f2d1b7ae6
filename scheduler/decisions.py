"""What the policy is given and what it decides: the queued request, and the decisions it returns to the loop.

`QueuedRequest` is the policy's view of one request (the loop builds it at Submit); the decisions are
plain data the loop executes: ASSIGN, CANCEL and PREFETCH to workers, failures to gateways.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.prefix_keys import PrefixProbe
from loraserve.request_spec import RequestSpec
from loraserve.wire import AdapterKey


@dataclass
class QueuedRequest:
    """One request as the policy sees it, from Submit until it ends: its spec as the scheduler accepted it
    (never changed here) and the policy's own state. The properties are what placement and fairness read
    of the spec; a continued request's tokens already generated count as prompt, and against its
    max_new_tokens."""

    spec: RequestSpec
    enqueued: float = 0.0  # when it joined the queue (set by the policy)
    placed_at: float = 0.0  # when it was assigned to a worker (set by the policy)
    prefix: PrefixProbe | None = None  # prefix caching: its checkpoint fingerprints (adaptive placement)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def adapter(self) -> AdapterKey | None:
        return self.spec.adapter_key

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt_ids) + len(self.spec.output_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.spec.sampling.max_new_tokens - len(self.spec.output_ids)

    @property
    def reply_to(self) -> str:
        return self.spec.reply_to

    @property
    def arrival(self) -> float:
        return self.spec.arrival

    @property
    def deadline(self) -> float | None:
        return self.spec.deadline

    @property
    def tenant(self) -> str:
        """Whose request (VTC fairness); "" is a tenant like any other."""
        return self.spec.tenant

    @property
    def ttft_slo_s(self) -> float | None:
        """Its time-to-first-token target from `arrival`; refused early if missed."""
        return self.spec.ttft_slo_s

    @property
    def rank(self) -> int:
        """Its adapter's LoRA rank; 0: unknown (SizeClasses.default_rank is assumed)."""
        return self.spec.adapter_rank

    @property
    def attempt(self) -> int:
        """Earlier attempts lost (failover, migration): only attempt 0 migrates."""
        return self.spec.attempt

    @property
    def group(self) -> str | None:
        """Shared prefill: placed beside the group's other requests when there is room."""
        return self.spec.group

    @property
    def request_key(self) -> str:
        """The client request it belongs to (its batch share is counted per key): its own id when alone."""
        return self.spec.request_key or self.spec.request_id


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
