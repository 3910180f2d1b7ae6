"""Protobuf <-> plain dataclasses, at the gRPC edges only (inner code never sees generated classes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams
from loraserve.structured import KINDS, Constraint, grammar_for
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
    *,
    compile_structured: bool = True,
) -> SamplingParams:
    """Validated sampling parameters (raises InvalidRequestError naming the field). Zero values mean
    defaults. `structured_output` is compiled here, in this process, unless `compile_structured` is
    False: the gateway takes it out uncompiled (`constraint_from_pb`) and compiles it in its sandbox."""
    structured = compile_structured and pb.HasField("structured_output")
    return SamplingParams(
        **sampling_fields_of_pb(pb),
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_token_ids),
        grammar=grammar_from_pb(pb.structured_output) if structured else None,
    )


def sampling_fields_of_pb(pb: common_pb2.SamplingParameters) -> dict[str, Any]:
    """The SamplingParams fields `pb` sets, by their names (zero values mean defaults; unset optional ones
    are None), not checked yet; without max_new_tokens, stop_token_ids and the structured output, which
    the request carries beside them."""
    return {
        "temperature": pb.temperature,
        "top_k": pb.top_k,
        "top_p": pb.top_p or 1.0,
        "min_p": pb.min_p,
        "seed": pb.seed if pb.HasField("seed") else None,
        "repetition_penalty": pb.repetition_penalty or 1.0,
        "presence_penalty": pb.presence_penalty,
        "frequency_penalty": pb.frequency_penalty,
        "ignore_eos": pb.ignore_eos,
        "logprobs": pb.logprobs if pb.HasField("logprobs") else None,
        "prompt_logprobs": pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    }


def constraint_from_pb(pb: common_pb2.StructuredOutput) -> Constraint:
    """A StructuredOutput as the uncompiled Constraint it asks for, its field `structured_output.KIND`
    (InvalidRequestError naming the field if it asks for none)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", f"set one of its kinds: {', '.join(KINDS)}")
    value = getattr(pb, kind)
    field = f"structured_output.{kind}"
    if kind == "choice":
        value = list(value.choices)
    elif kind == "json_object" and not value:
        raise InvalidRequestError(field, "must be true when set")
    return Constraint(kind, value, field)


def grammar_from_pb(pb: common_pb2.StructuredOutput) -> str:
    """The llguidance grammar of a StructuredOutput, compiled in this process (InvalidRequestError naming
    the field if it is not one)."""
    constraint = constraint_from_pb(pb)
    return grammar_for(constraint.kind, constraint.value, constraint.field)
