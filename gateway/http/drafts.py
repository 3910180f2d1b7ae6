"""One generation an HTTP request asks for, in plain values, before validation: a `Draft`.

The routes build a draft per choice (`app.py`); the generation core validates it after admission
with the same checks the gRPC API's requests get (`validate_request`), so both edges accept and
refuse the same requests with the same messages. Numbers are read as the gRPC API reads them:
floats at its float32 precision (`wire_float`), and a top_p or repetition_penalty of 0 as unset.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from loraserve.gateway.core import Validate
from loraserve.gateway.validation import Limits, validate_request
from loraserve.params import SamplingParams
from loraserve.structured import Constraint

FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
)


@dataclass(frozen=True)
class Draft:
    """The fields of one generation (`sampling`: SamplingParams' fields, unset ones left out)."""

    adapter: str  # "": the base model
    sampling: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 0  # 0: the gateway's default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop: bool = False
    keep_special_tokens: bool = False
    cache_salt: str = ""
    prompt_text: str | None = None  # exactly one of prompt_text and prompt_ids
    prompt_ids: tuple[int, ...] | None = None
    prefill_group: str = ""
    client_request_id: str = ""
    constraint: Constraint | None = None  # structured output, compiled by the core after validation

    def validator(self, limits: Limits) -> Validate:
        """The validation the core runs (with the caller's adapter check) to make this a ValidRequest."""
        return partial(
            validate_request,
            limits,
            adapter=self.adapter,
            prompt_text=self.prompt_text,
            prompt_ids=None if self.prompt_ids is None else list(self.prompt_ids),
            sampling=partial(sampling_params, self.sampling),
            constraint=lambda: self.constraint,
            max_new_tokens=self.max_new_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            client_request_id=self.client_request_id,
            include_stop=self.include_stop,
            keep_special_tokens=self.keep_special_tokens,
            prefill_group=self.prefill_group,
            cache_salt=self.cache_salt,
        )


def sampling_params(fields: dict[str, Any], max_new_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
    """Checked SamplingParams of `fields` (InvalidRequestError naming the field)."""
    values = {name: wire_float(v) if name in FLOAT_FIELDS else v for name, v in fields.items()}
    values["top_p"] = values.get("top_p") or 1.0
    values["repetition_penalty"] = values.get("repetition_penalty") or 1.0
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids), **values)


def wire_float(value: float) -> float:
    """`value` as a proto `float` (float32) holds it: rounded to nearest, infinite beyond its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
