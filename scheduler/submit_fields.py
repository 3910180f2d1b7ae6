"""The spec of a Submit from a gateway of release 0.1, which sends the request's fields one by one instead of
its `spec` (the fields scheduler.proto marks deprecated).

The fields become the spec's with `msgspec.convert`, so the spec's annotations check them as decoding a
spec would; an error names the Submit's field (`deadline_unix`, not the spec's `deadline`). Its sampling
parameters are the gateway's SamplingParams as sent (`sampling_params`), or made here from the protobuf
fields.
"""

from __future__ import annotations

import msgspec

from loraserve.convert import sampling_from_pb
from loraserve.params import SamplingParams, decode_sampling
from loraserve.request_spec import RequestSpec
from loraserve.struct_errors import invalid_field
from loraserve.v1 import scheduler_pb2

# the spec's field -> the Submit's, where they differ
SUBMIT_NAMES = {"deadline": "deadline_unix", "arrival": "arrival_unix", "group": "prefill_group"}


def spec_of_fields(request: scheduler_pb2.SubmitRequest, now: float) -> RequestSpec:
    """The spec the Submit's own fields describe (raises InvalidRequestError naming the field)."""
    fields = {
        "request_id": request.request_id,
        "prompt_ids": request.prompt_ids[:],  # a slice: 4× faster than list() of a protobuf field
        "sampling": submitted_sampling(request),
        "reply_to": request.reply_to,
        "arrival": request.arrival_unix or now,
        "adapter": request.adapter or None,
        "adapter_version": request.adapter_version,
        "adapter_sha256": request.adapter_sha256,
        "adapter_rank": request.adapter_rank if request.adapter else 0,
        "output_ids": request.output_ids[:],
        "deadline": request.deadline_unix or None,
        "tenant": request.tenant,
        "ttft_slo_s": request.ttft_slo_s or None,
        "attempt": request.attempt,
        "group": request.prefill_group or None,
        "cache_salt": request.cache_salt,
        "request_key": request.request_key,
    }
    try:
        return msgspec.convert(fields, RequestSpec)
    except msgspec.ValidationError as e:
        raise invalid_field(e, SUBMIT_NAMES) from None


def submitted_sampling(request: scheduler_pb2.SubmitRequest) -> SamplingParams:
    """The Submit's sampling parameters, checked: `sampling_params` when set, else the protobuf fields."""
    if request.sampling_params:
        return decode_sampling(request.sampling_params)
    return sampling_from_pb(request.sampling, request.max_new_tokens, request.stop_token_ids)
