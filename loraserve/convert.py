"""Protobuf <-> plain dataclasses, at the gRPC edges only (inner code never sees generated classes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams
from loraserve.request_spec import Sampling
from loraserve.structured import KINDS, grammar_for
from loraserve.v1 import common_pb2

S = TypeVar("S", SamplingParams, Sampling)

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop_sequence": common_pb2.FINISH_REASON_STOP_SEQUENCE,
}


def sampling_from_pb(
    pb: common_pb2.SamplingParameters,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    into: type[S] = SamplingParams,
) -> S:
    """Validated sampling parameters (raises InvalidRequestError naming the field): SamplingParams, or the
    request spec's `Sampling` (the scheduler's edge). Zero values mean defaults."""
    return into(
        max_new_tokens=max_new_tokens,
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p or 1.0,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        grammar=grammar_from_pb(pb.structured_output) if pb.HasField("structured_output") else None,
    )


def grammar_from_pb(pb: common_pb2.StructuredOutput) -> str:
    """The llguidance grammar of a StructuredOutput (InvalidRequestError naming the field if it is not one)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", f"set one of its kinds: {', '.join(KINDS)}")
    value = getattr(pb, kind)
    if kind == "choice":
        value = list(value.choices)
    elif kind == "json_object" and not value:
        raise InvalidRequestError("structured_output.json_object", "must be true when set")
    return grammar_for(kind, value, f"structured_output.{kind}")


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParameters:
    pb = common_pb2.SamplingParameters(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        ignore_eos=params.ignore_eos,
    )
    for name in ("seed", "logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(pb, name, getattr(params, name))
    if params.grammar is not None:
        pb.structured_output.llguidance = params.grammar
    return pb
