"""One generation an HTTP request asks for, before validation: a draft, the `GenerationRequest` fields
(`Fields`) the routes map the body to (`app.py`), one per choice.

The generation core parses a draft after admission with the same struct and checks the gRPC API's
requests get (`generation_request.parse`), so both edges accept and refuse the same requests with the
same messages. Numbers are read as the gRPC API reads them: floats at its float32 precision
(`wire_float`), and a top_p or repetition_penalty of 0 as unset.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

from loraserve.gateway.generation_request import Fields

FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
)


def sampling_fields(values: dict[str, Any], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Fields:
    """A draft's `sampling`: `values` (SamplingParams' fields, unset ones left out) read as the gRPC API
    reads them, with `max_new_tokens` (0: the gateway's default) and `stop_token_ids`."""
    fields = {name: wire_float(v) if name in FLOAT_FIELDS else v for name, v in values.items()}
    fields["top_p"] = fields.get("top_p") or 1.0
    fields["repetition_penalty"] = fields.get("repetition_penalty") or 1.0
    return fields | {"max_new_tokens": max_new_tokens, "stop_token_ids": list(stop_token_ids)}


def wire_float(value: float) -> float:
    """`value` as a proto `float` (float32) holds it: rounded to nearest, infinite beyond its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
