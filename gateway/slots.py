"""Per-tenant generation slots (`max_concurrent`), counted by this gateway process. A pure object.

A generation (or a tokenize or detokenize call, `gateway/metered.py`) holds one of its tenant's slots
from when it is let in until it ends (however it ends); over `max_concurrent` a new one is refused
RESOURCE_EXHAUSTED with a short retry hint. Each gateway
process counts its own generations, so N gateways admit up to N × `max_concurrent`.

Token quotas (`tokens_per_minute`) are not kept here: the scheduler, which sees every gateway's
requests, meters prompt and output tokens for the whole cluster (`scheduler/quotas.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraserve.gateway.events import RetryLaterError
from loraserve.gateway.tenants import QuotaLimits

SLOT_RETRY_S = 0.5  # a generation's slot frees when it ends; nothing predicts when


class SlotLimitError(RetryLaterError):
    """A tenant's `max_concurrent` generations are all in flight: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message, math.ceil(retry_after_s * 1000))
        self.retry_after_s = retry_after_s


@dataclass
class TenantSlots:
    """Generations in flight per tenant, in this gateway."""

    _in_flight: dict[str, int] = field(default_factory=dict)

    def admit(self, tenant: str, limits: QuotaLimits) -> None:
        """Take a slot for a new generation, or raise SlotLimitError; `release` gives it back."""
        in_flight = self._in_flight.get(tenant, 0)
        if limits.max_concurrent is not None and in_flight >= limits.max_concurrent:
            raise SlotLimitError(
                f"tenant {tenant!r} has {in_flight} requests in flight (generations and tokenizer calls), its limit "
                f"(max_concurrent = {limits.max_concurrent}); retry when one ends",
                SLOT_RETRY_S,
            )
        self._in_flight[tenant] = in_flight + 1

    def release(self, tenant: str) -> None:
        """A generation admitted by `admit` ended."""
        in_flight = self._in_flight.get(tenant, 0)
        if in_flight > 1:
            self._in_flight[tenant] = in_flight - 1
        else:
            self._in_flight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)
