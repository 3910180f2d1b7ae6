"""Per-request sampling parameters, validated on construction (no torch: the gateway uses them too).

`SamplingParams` is one type from the gateway's validation to the worker's sampler: a frozen msgspec
Struct, so it also is its own wire schema. The gateway sends it to the scheduler as msgpack
(`encode_sampling`), the scheduler decodes it into the same type (`decode_sampling`: bounds from the
annotations, unknown fields refused, `check_sampling` run), and the request spec carries it to the
worker unchanged.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from loraserve.bounds import Count, Finite, TokenId
from loraserve.errors import InvalidRequestError
from loraserve.struct_errors import DECODE_ERRORS, decode_problem
from loraserve.structured import MAX_GRAMMAR_BYTES

# Below these the arithmetic stops meaning anything: logits / 1e-45 overflow float32 to infinity.
# A temperature in (0, MIN_TEMPERATURE) is greedy (SamplingParams stores it as 0): clients send 1e-4 or
# 1e-6 to mean greedy, and dividing by it would only approach argmax. A repetition penalty divides or
# multiplies logits, so it stays within [MIN_REPETITION_PENALTY, 10].
MIN_TEMPERATURE = 1e-3
MIN_REPETITION_PENALTY = 1e-2
MAX_LOGPROBS = 20  # alternatives reported per token (OpenAI's limit)
MAX_STOP_TOKENS = 1024

Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one request's tokens are chosen. Keyword construction (and decoding) checks every value
    (`check_sampling`: InvalidRequestError naming the field) after one normalization: a temperature in
    (0, MIN_TEMPERATURE) becomes 0, greedy, so every edge and the offline engine read it the same way.
    `msgspec.structs.replace` makes a changed copy."""

    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 64
    temperature: Finite = 0.0  # 0: greedy (and so is anything below MIN_TEMPERATURE: stored as 0)
    top_k: Count = 0  # 0: off
    top_p: Finite = 1.0
    min_p: Finite = 0.0  # drop tokens less likely than min_p times the most likely one; 0: off
    seed: Count | None = None  # None: a fresh random seed per request
    repetition_penalty: Finite = 1.0
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    stop_token_ids: Annotated[tuple[TokenId, ...], msgspec.Meta(max_length=MAX_STOP_TOKENS)] = ()
    ignore_eos: bool = False
    # Log-probabilities (`worker/logprobs.py`): None asks for none; k reports each token's own and the k
    # most likely alternatives' (0 to MAX_LOGPROBS), for every generated token and for the prompt's.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # Structured output: an llguidance grammar (`loraserve/structured.py`) the output must match; each
    # token is sampled among those the grammar allows next, and the output ends when the grammar does.
    grammar: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_BYTES)] | None = None

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # a tiny temperature means greedy (NaN compares False)
            msgspec.structs.force_setattr(self, "temperature", 0.0)
        check_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def check_sampling(p: Any) -> None:
    """Raise InvalidRequestError naming the first field of `p` (a SamplingParams) that is out of range."""

    def bad(name: str, why: str):
        raise InvalidRequestError(name, f"{why}, got {getattr(p, name)!r}")

    if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
        bad("max_new_tokens", "must be a positive integer")
    if not (math.isfinite(p.temperature) and (p.temperature == 0.0 or MIN_TEMPERATURE <= p.temperature <= 100.0)):
        bad("temperature", f"must be in [0, 100] (below {MIN_TEMPERATURE:g}: greedy)")
    if not isinstance(p.top_k, int) or p.top_k < 0:
        bad("top_k", "must be >= 0 (0 turns it off)")
    if not (math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0):
        bad("top_p", "must be in (0, 1]")
    if not (math.isfinite(p.min_p) and 0.0 <= p.min_p <= 1.0):
        bad("min_p", "must be in [0, 1] (0 turns it off)")
    if not (math.isfinite(p.repetition_penalty) and MIN_REPETITION_PENALTY <= p.repetition_penalty <= 10.0):
        bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 10] (1 turns it off)")
    for name in ("presence_penalty", "frequency_penalty"):
        if not (math.isfinite(getattr(p, name)) and -2.0 <= getattr(p, name) <= 2.0):
            bad(name, "must be in [-2, 2]")
    if p.seed is not None and not (0 <= p.seed < 2**63):
        bad("seed", "must be in [0, 2^63)")
    if any(t < 0 for t in p.stop_token_ids):
        bad("stop_token_ids", "must be token ids >= 0")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and (
            isinstance(value, bool) or not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS)
        ):
            bad(name, f"must be in [0, {MAX_LOGPROBS}] (alternatives reported per token)")
    if p.grammar is not None:
        if not isinstance(p.grammar, str) or not p.grammar or len(p.grammar) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError("grammar", f"must be a grammar of 1 to {MAX_GRAMMAR_BYTES} characters")
        check_constrainable(p)


def check_constrainable(p: Any) -> None:
    """InvalidRequestError unless `p` (a SamplingParams) can take an output constraint (a grammar): the
    gateway checks it before compiling the constraint, every SamplingParams with a grammar on construction."""
    if p.ignore_eos:
        raise InvalidRequestError(
            "ignore_eos", "cannot be combined with structured output (the output ends where its grammar does), got True"
        )


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SamplingParams)


def encode_sampling(params: SamplingParams) -> bytes:
    """`params` as msgpack: what a SubmitRequest's `sampling_params` carries."""
    return _ENCODER.encode(params)


def decode_sampling(data: bytes, field: str = "sampling_params") -> SamplingParams:
    """The SamplingParams `data` holds (`encode_sampling`); InvalidRequestError naming `field` and what
    is wrong if it is not one, or a value is out of range."""
    try:
        return _DECODER.decode(data)
    except DECODE_ERRORS as e:  # a ValidationError too: a value of the wrong type or out of bounds
        raise InvalidRequestError(field, decode_problem(e)) from None
