"""The scheduler's edge: a Submit is checked, then turned into the request's one `RequestSpec`.

Everything after this reads the spec (`loraserve/request_spec.py`): the loop keeps it while the
request queues, the ASSIGN carries it, the worker's `Request` holds it. The checks here refuse
(INVALID_ARGUMENT naming the field) what a worker's decoder would refuse in the ASSIGN, or what
could not be delivered.
"""

from __future__ import annotations

import math

from loraserve.bounds import MAX_ID, MAX_LIST, MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES
from loraserve.convert import sampling_from_pb
from loraserve.errors import InvalidRequestError
from loraserve.names import SHA256_HEX, TENANT_NAME
from loraserve.params import SamplingParams, decode_sampling
from loraserve.prefix_keys import PrefixProbe, adapter_identity, chain_root
from loraserve.request_spec import MAX_ADAPTER_RANK, RequestSpec
from loraserve.scheduler.decisions import QueuedRequest
from loraserve.v1 import scheduler_pb2

MAX_TTFT_SLO_S = 86400.0


def spec_from_submit(request: scheduler_pb2.SubmitRequest, now: float) -> RequestSpec:
    """The request's spec (raises InvalidRequestError naming the field). Its sampling parameters are the
    gateway's SamplingParams as sent (`sampling_params`), or made here from the protobuf fields."""
    check_submit(request)
    sampling = submitted_sampling(request)
    if request.output_ids and len(request.output_ids) >= sampling.max_new_tokens:
        raise InvalidRequestError(
            "output_ids", f"holds {len(request.output_ids)} tokens; max_new_tokens is {sampling.max_new_tokens}"
        )
    return RequestSpec(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids[:],  # a slice: 4× faster than list() of a protobuf field
        sampling=sampling,
        reply_to=request.reply_to,
        arrival=request.arrival_unix or now,
        adapter=request.adapter or None,
        adapter_version=request.adapter_version,
        adapter_sha256=request.adapter_sha256,
        adapter_rank=request.adapter_rank if request.adapter else 0,
        output_ids=request.output_ids[:],
        deadline=request.deadline_unix or None,
        tenant=request.tenant,
        ttft_slo_s=request.ttft_slo_s or None,
        attempt=request.attempt,
        group=request.prefill_group or None,
        cache_salt=request.cache_salt,
        request_key=request.request_key,
    )


def submitted_sampling(request: scheduler_pb2.SubmitRequest) -> SamplingParams:
    """The Submit's sampling parameters, checked: `sampling_params` when set, else the protobuf fields."""
    if request.sampling_params:
        return decode_sampling(request.sampling_params)
    return sampling_from_pb(request.sampling, request.max_new_tokens, request.stop_token_ids)


def check_submit(request: scheduler_pb2.SubmitRequest) -> None:
    """Refuse what a worker's decoder would refuse in the ASSIGN: the lengths and values of the Submit's
    own fields. What crosses fields (the token total, the reply address) the spec checks as it is built,
    and the sampling parameters check themselves (`submitted_sampling`)."""
    if not request.request_id or len(request.request_id) > MAX_ID:
        raise InvalidRequestError("request_id", f"must be 1-{MAX_ID} characters")
    if len(request.adapter) > MAX_ID:
        raise InvalidRequestError("adapter", f"must be at most {MAX_ID} characters")
    for name in ("prefill_group", "cache_salt", "request_key"):
        if len(getattr(request, name)) > MAX_ID:
            raise InvalidRequestError(name, f"must be at most {MAX_ID} characters")
    _check_adapter_and_tenant(request)
    if not 1 <= len(request.prompt_ids) <= MAX_LIST:
        raise InvalidRequestError("prompt_ids", f"must hold 1-{MAX_LIST} tokens, got {len(request.prompt_ids)}")
    if not math.isfinite(request.ttft_slo_s) or not 0 <= request.ttft_slo_s <= MAX_TTFT_SLO_S:
        raise InvalidRequestError("ttft_slo_s", f"must be 0 (none) or seconds up to {MAX_TTFT_SLO_S:g}")
    for name in ("deadline_unix", "arrival_unix"):
        value = getattr(request, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidRequestError(name, f"must be a finite time in unix seconds (0: unset), got {value}")


def queued_from_spec(spec: RequestSpec) -> QueuedRequest:
    """The policy's view of an accepted request: what placement and fairness read (a continued one's
    tokens already generated count as prompt, and against its max_new_tokens)."""
    generated = len(spec.output_ids)
    return QueuedRequest(
        request_id=spec.request_id,
        adapter=spec.adapter_key,
        prompt_len=len(spec.prompt_ids) + generated,
        max_new_tokens=spec.sampling.max_new_tokens - generated,
        reply_to=spec.reply_to,
        arrival=spec.arrival,
        deadline=spec.deadline,
        tenant=spec.tenant,
        ttft_slo_s=spec.ttft_slo_s,
        rank=spec.adapter_rank,
        attempt=spec.attempt,
        group=spec.group,
        prefix=_prefix_probe(spec),
        request_key=spec.request_key,
    )


def _prefix_probe(spec: RequestSpec) -> PrefixProbe | None:
    """What placement asks about the request's cached prefixes (`loraserve/prefix_keys.py`): keyed as the
    worker keys its KV, by the salt and the adapter version's weights. None when those are not known."""
    identity = ""
    if spec.adapter:
        if not spec.adapter_sha256:
            return None
        identity = adapter_identity(spec.adapter, spec.adapter_version, spec.adapter_sha256)
    tokens = spec.prompt_ids + spec.output_ids if spec.output_ids else spec.prompt_ids
    return PrefixProbe(chain_root(spec.cache_salt, identity), tokens)


def check_batch(batch: scheduler_pb2.SubmitStreamRequest) -> None:
    """Refuse a SubmitStream batch over the caps (`loraserve/bounds.py`), before any of it is looked at:
    the gateway splits its writes under both, so a larger one is a caller's mistake (or an attack on the
    scheduler's loop), and ends the call."""
    entries = len(batch.requests) + len(batch.hints)
    if entries > MAX_SUBMIT_BATCH:
        raise InvalidRequestError(
            "SubmitStreamRequest",
            f"holds {entries} requests and hints; a batch may hold at most {MAX_SUBMIT_BATCH}: split it into writes",
        )
    size = batch.ByteSize()
    if size > MAX_SUBMIT_BATCH_BYTES:
        raise InvalidRequestError(
            "SubmitStreamRequest",
            f"is {size} bytes encoded; a batch may be at most {MAX_SUBMIT_BATCH_BYTES}: split it into writes",
        )


def check_hint(request: scheduler_pb2.PrepareAdapterRequest) -> None:
    """Refuse a hint naming what no ASSIGN could carry (the worker's decoder would drop the PREFETCH)."""
    if not request.adapter or len(request.adapter) > MAX_ID:
        raise InvalidRequestError("adapter", f"must be 1-{MAX_ID} characters")
    _check_adapter_and_tenant(request)


def _check_adapter_and_tenant(
    request: scheduler_pb2.SubmitRequest | scheduler_pb2.PrepareAdapterRequest,
) -> None:
    """The fields a Submit and a hint share: the adapter's weights hash and rank, and the tenant."""
    if request.adapter_sha256 and not SHA256_HEX.fullmatch(request.adapter_sha256):
        raise InvalidRequestError("adapter_sha256", "must be empty or 64 lowercase hex digits")
    if request.adapter_rank > MAX_ADAPTER_RANK:
        raise InvalidRequestError("adapter_rank", f"must be at most {MAX_ADAPTER_RANK} (0: unknown)")
    if request.tenant and not TENANT_NAME.fullmatch(request.tenant):
        raise InvalidRequestError("tenant", "must be letters, digits, '-' or '_', at most 64 characters")
