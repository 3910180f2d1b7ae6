"""Queued requests for the scheduler's policy tests: a `RequestSpec` of the given sizes, in the policy's view."""

from __future__ import annotations

from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.scheduler.decisions import QueuedRequest
from loraserve.wire import AdapterKey

REPLY_TO = "tcp://127.0.0.1:1"  # the gateway's token sink; the policy never sends to it


def queued(
    request_id: str,
    adapter: AdapterKey | None = None,
    prompt_len: int = 16,
    max_new_tokens: int = 16,
    *,
    rank: int = 0,
    enqueued: float = 0.0,
    **fields,
) -> QueuedRequest:
    """A request of `prompt_len` prompt tokens and `max_new_tokens` to generate; `fields`: the spec's others
    (arrival 0 unless given)."""
    spec = RequestSpec(
        request_id=request_id,
        prompt_ids=[0] * prompt_len,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        reply_to=fields.pop("reply_to", REPLY_TO),
        arrival=fields.pop("arrival", 0.0),
        adapter=adapter[0] if adapter else None,
        adapter_version=adapter[1] if adapter else 0,
        adapter_rank=rank,
        **fields,
    )
    return QueuedRequest(spec, enqueued=enqueued)
