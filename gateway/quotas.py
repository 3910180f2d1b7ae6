"""Per-tenant quotas: generations in flight, and generated tokens per minute. A pure object.

- `max_concurrent`: a generation holds one slot from admission until it ends (however it ends).
- `tokens_per_minute`: a token bucket per tenant holding at most `tokens_per_minute` tokens,
  refilled continuously at `tokens_per_minute / 60` per second. Each generated token takes one
  as it is streamed; a running generation is never cut off, so the bucket may go below zero,
  and that debt delays the next admission. A generation is admitted while at least one token is
  in the bucket.

An admission refused raises ResourceExhaustedError carrying `retry_after_s`: when a slot may be
free (no better guess than soon: a short constant) or when the bucket holds a token again.
Tenants never share state: one tenant over its quota leaves every other untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.errors import ResourceExhaustedError
from loraserve.gateway.tenants import QuotaLimits

SLOT_RETRY_S = 0.5  # a generation's slot frees when it ends; nothing predicts when


class QuotaExceededError(ResourceExhaustedError):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: float = 0.0  # in the bucket, as of `at`
    at: float = 0.0
    full: bool = True  # the bucket has not been used yet: it starts full


@dataclass
class Quotas:
    """Slots and token buckets per tenant; `clock()` in seconds (time.monotonic in the gateway)."""

    clock: Callable[[], float]
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def admit(self, tenant: str, limits: QuotaLimits) -> None:
        """Take a slot for a new generation, or raise QuotaExceededError; `release` gives it back."""
        usage = self._usage.setdefault(tenant, _Usage())
        if limits.max_concurrent is not None and usage.in_flight >= limits.max_concurrent:
            raise QuotaExceededError(
                f"tenant {tenant!r} has {usage.in_flight} generations in flight, its limit "
                f"(max_concurrent = {limits.max_concurrent}); retry when one ends",
                SLOT_RETRY_S,
            )
        if limits.tokens_per_minute is not None:
            tokens = self._refill(usage, limits.tokens_per_minute)
            if tokens < 1.0:
                rate = limits.tokens_per_minute / 60.0
                raise QuotaExceededError(
                    f"tenant {tenant!r} used its tokens_per_minute ({limits.tokens_per_minute}); "
                    f"retry in {(1.0 - tokens) / rate:.1f} s",
                    (1.0 - tokens) / rate,
                )
        usage.in_flight += 1

    def generated(self, tenant: str, limits: QuotaLimits, count: int) -> None:
        """`count` more tokens were generated for `tenant`."""
        if limits.tokens_per_minute is None or count <= 0:
            return
        usage = self._usage.setdefault(tenant, _Usage())
        usage.tokens = self._refill(usage, limits.tokens_per_minute) - count

    def release(self, tenant: str) -> None:
        """A generation admitted by `admit` ended."""
        usage = self._usage.get(tenant)
        if usage is not None and usage.in_flight > 0:
            usage.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        usage = self._usage.get(tenant)
        return usage.in_flight if usage is not None else 0

    def _refill(self, usage: _Usage, per_minute: int) -> float:
        now = self.clock()
        if usage.full:
            usage.tokens, usage.full = float(per_minute), False
        else:
            usage.tokens = min(float(per_minute), usage.tokens + (now - usage.at) * per_minute / 60.0)
        usage.at = now
        return usage.tokens
