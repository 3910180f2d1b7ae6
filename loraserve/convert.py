"""Protobuf <-> plain dataclasses, at the gRPC edges only (inner code never sees generated classes)."""

from __future__ import annotations

from collections.abc import Sequence

from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams
from loraserve.structured import KINDS, grammar_for
from loraserve.v1 import common_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop_sequence": common_pb2.FINISH_REASON_STOP_SEQUENCE,
}


def sampling_from_pb(
    pb: common_pb2.SamplingParameters,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> SamplingParams:
    """Validated sampling parameters (raises InvalidRequestError naming the field). Zero values mean
    defaults."""
    return SamplingParams(
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
