"""The gateway's early hints: which worker should start fetching an adapter before its request is submitted.

A gateway that has parsed a request and resolved its adapter calls `PrepareAdapter` before it tokenizes the
prompt and submits. The scheduler then asks the policy where a request like it would go (`hint_target`),
and tells that worker to fetch the adapter at once (a PREFETCH scored 1.0: a request for it follows); the
policy counts the adapter as being loaded there, so the request's placement follows the hint (adaptive:
affinity to an adapter being loaded). By the time the ASSIGN arrives the fetch is under way or done, and
the worker joins it instead of starting one.

`AdapterHints` is pure (time passed in): it builds the hint's request view, asks the policy, and sends a
hint for one (worker, adapter) at most once per `repeat_after_s`, so a burst of requests for one cold
adapter makes one fetch.
"""

from __future__ import annotations

from collections import OrderedDict

from loraserve.params import SamplingParams
from loraserve.request_spec import NO_REPLY, RequestSpec
from loraserve.scheduler.policy import PrefetchOn, QueuedRequest, SchedulerPolicy
from loraserve.wire import AdapterKey

REPEAT_AFTER_S = 1.0  # a hint for the same adapter and worker within this is not sent again
MAX_REMEMBERED = 4096  # (worker, adapter) hints remembered, the most recent


class AdapterHints:
    """Turns hints into PREFETCH decisions (see the module docstring)."""

    def __init__(self, repeat_after_s: float = REPEAT_AFTER_S):
        self.repeat_after_s = repeat_after_s
        self._sent: OrderedDict[tuple[str, AdapterKey], float] = OrderedDict()  # (worker, adapter) -> when

    def hint(
        self, policy: SchedulerPolicy, adapter: AdapterKey, rank: int, tenant: str, now: float
    ) -> PrefetchOn | None:
        """The PREFETCH to send for a request about to come for `adapter`, or None (nothing to do)."""
        request = QueuedRequest(_like(adapter, rank, tenant, now))
        worker_id = policy.hint_target(request, now)
        if worker_id is None:
            return None
        key = (worker_id, adapter)
        sent = self._sent.get(key)
        if sent is not None and now - sent < self.repeat_after_s:
            return None
        self._sent[key] = now
        self._sent.move_to_end(key)
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)
        return PrefetchOn(worker_id, (adapter,), (1.0,))


def _like(adapter: AdapterKey, rank: int, tenant: str, now: float) -> RequestSpec:
    """A request like the one the hint announces: its adapter, rank and tenant; its prompt is unknown yet (one
    token, one to generate)."""
    name, version = adapter
    return RequestSpec(
        request_id="",
        prompt_ids=[0],
        sampling=SamplingParams(max_new_tokens=1),
        reply_to=NO_REPLY,
        arrival=now,
        adapter=name,
        adapter_version=version,
        adapter_rank=rank,
        tenant=tenant,
    )
