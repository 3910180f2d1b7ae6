"""The scheduler's edge: a Submit's `RequestSpec`, as the gateway built it, decoded and checked.

Everything after this reads the spec (`loraserve/request_spec.py`): the loop keeps it while the
request queues, the ASSIGN carries it, the worker's `Request` holds it. Decoding refuses what a
worker's decoder would refuse in the ASSIGN (the spec's annotations); `check_spec` what could not be
served or delivered (INVALID_ARGUMENT naming the field).
"""

from __future__ import annotations

from loraserve.bounds import MAX_ID, MAX_LIST, MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES
from loraserve.errors import InvalidRequestError
from loraserve.names import SHA256_HEX, TENANT_NAME
from loraserve.prefix_keys import PrefixProbe, adapter_identity, chain_root
from loraserve.request_spec import MAX_ADAPTER_RANK, RequestSpec, decode_spec
from loraserve.scheduler.decisions import QueuedRequest
from loraserve.scheduler.submit_fields import spec_of_fields
from loraserve.v1 import scheduler_pb2


def spec_from_submit(request: scheduler_pb2.SubmitRequest, now: float) -> RequestSpec:
    """The request's spec (raises InvalidRequestError naming the field): the gateway's `spec` decoded, which
    checks every bound its annotations declare, or from a gateway of release 0.1 the one its own fields make
    (`submit_fields.py`, with the same checks); then what no annotation says (`check_spec`)."""
    if not request.spec:
        check_present(request.request_id, len(request.prompt_ids))  # what an empty Submit is refused for first
        spec = spec_of_fields(request, now)
    else:
        spec = decode_spec(request.spec)
        if spec.request_id != request.request_id:
            raise InvalidRequestError("request_id", "must be the request_id of its spec")
    check_spec(spec)
    return spec


def check_spec(spec: RequestSpec) -> None:
    """Refuse what a spec's annotations let through but no worker could serve or no gateway would send: an
    empty id or prompt, a malformed weights hash or tenant, a time before the epoch, or a continuation with
    no token left to generate."""
    check_present(spec.request_id, len(spec.prompt_ids))
    _check_adapter_and_tenant(spec.adapter_sha256, spec.adapter_rank, spec.tenant)
    for name, value in (("deadline_unix", spec.deadline or 0.0), ("arrival_unix", spec.arrival)):
        if value < 0:
            raise InvalidRequestError(name, f"must be a finite time in unix seconds (0: unset), got {value}")
    if spec.output_ids and len(spec.output_ids) >= spec.sampling.max_new_tokens:
        raise InvalidRequestError(
            "output_ids", f"holds {len(spec.output_ids)} tokens; max_new_tokens is {spec.sampling.max_new_tokens}"
        )


def check_present(request_id: str, prompt_len: int) -> None:
    """A request has an id and a prompt (what an empty Submit lacks first)."""
    if not request_id:
        raise InvalidRequestError("request_id", f"must be 1-{MAX_ID} characters")
    if not 1 <= prompt_len <= MAX_LIST:
        raise InvalidRequestError("prompt_ids", f"must hold 1-{MAX_LIST} tokens, got {prompt_len}")


def queued_from_spec(spec: RequestSpec) -> QueuedRequest:
    """The policy's view of an accepted request: the spec, and what placement asks about its cached prefixes."""
    return QueuedRequest(spec, prefix=_prefix_probe(spec))


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
    _check_adapter_and_tenant(request.adapter_sha256, request.adapter_rank, request.tenant)


def _check_adapter_and_tenant(sha256: str, rank: int, tenant: str) -> None:
    """The fields a request and a hint share: the adapter's weights hash and rank, and the tenant."""
    if sha256 and not SHA256_HEX.fullmatch(sha256):
        raise InvalidRequestError("adapter_sha256", "must be empty or 64 lowercase hex digits")
    if rank > MAX_ADAPTER_RANK:
        raise InvalidRequestError("adapter_rank", f"must be at most {MAX_ADAPTER_RANK} (0: unknown)")
    if tenant and not TENANT_NAME.fullmatch(tenant):
        raise InvalidRequestError("tenant", "must be letters, digits, '-' or '_', at most 64 characters")
