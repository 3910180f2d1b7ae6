"""Protobuf <-> plain dataclasses, at the gRPC edges only (inner code never sees generated classes)."""

from __future__ import annotations

from loraserve.params import SamplingParams
from loraserve.v1 import common_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop_sequence": common_pb2.FINISH_REASON_STOP_SEQUENCE,
}


def sampling_from_pb(
    pb: common_pb2.SamplingParameters, max_new_tokens: int, stop_token_ids: list[int]
) -> SamplingParams:
    """Validated SamplingParams (raises InvalidRequestError naming the field). Zero values mean defaults."""
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p or 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=pb.ignore_eos,
    )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParameters:
    pb = common_pb2.SamplingParameters(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        pb.seed = params.seed
    return pb
