"""The bounds of values that cross a process boundary, as msgspec annotations: a decoded message whose
number or list is out of range is refused where it is decoded (`loraserve/wire.py`,
`loraserve/request_spec.py`, `loraserve/params.py`)."""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec

MAX_ID = 256  # request ids, worker ids, adapter names
MAX_LIST = 1 << 20  # tokens of one request (prompt + output): a 1M-token prompt
# One SubmitStream write (SubmitStreamRequest): its requests and hints together, and its encoded size. The
# gateway splits its outbox under both; the scheduler refuses a batch over either (INVALID_ARGUMENT).
MAX_SUBMIT_BATCH = 256
MAX_SUBMIT_BATCH_BYTES = 8 << 20

MAX_TTFT_SLO_S = 86400.0  # a time-to-first-token target of at most a day

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Short = Annotated[str, msgspec.Meta(max_length=64)]  # hashes, tenants, instance ids
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]  # uint32 in the protos
# Finite, any sign (clocks of two hosts may disagree a little): NaN and infinities fail both bounds.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Seconds = Finite
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LIST)]
TtftSlo = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TTFT_SLO_S)]  # seconds from arrival (NaN fails)
