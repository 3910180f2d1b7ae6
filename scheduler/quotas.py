"""Per-tenant token quotas (`tokens_per_minute`), for the whole cluster. A pure object: no I/O, the
time passed in.

The scheduler sees every request of every gateway, so the quota is kept here, once. Each request
(SubmitRequest) carries its tenant and the tenant's `tokens_per_minute` as the gateway's auth file
says (0: unlimited). The rule:

- A request costs its prompt tokens plus its `max_new_tokens`, charged in full when the scheduler
  admits it: what it may use, so a tenant can never run past its quota, however long its prompts
  or generations. Nothing is refunded when a generation ends early (EOS, a stop sequence, a
  cancel): lower `max_tokens` to pay less.
- Each tenant has a token bucket of `tokens_per_minute` tokens that starts full and refills
  continuously at `tokens_per_minute / 60` a second, kept as the tokens *used* recently (they
  drain at that rate), so a changed limit applies at once to what was used before it.
- A request whose cost does not fit in what is left is refused RESOURCE_EXHAUSTED, naming the
  tenant and its limit, with the seconds until it would fit; a request costing more than the whole
  `tokens_per_minute` can never fit and is refused saying so (no retry hint). A refusal takes
  nothing.
- A failover attempt (attempt > 0) was charged as its first attempt: the caller does not charge it
  again (`SchedulerLoop.submit`).

Tenants never share a bucket. A bucket that has drained empty is forgotten (checked at most once a
`PRUNE_INTERVAL_S`), so memory follows the tenants active in the last minute. The quotas live in
the scheduler process: a restarted scheduler starts every bucket full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.errors import ResourceExhaustedError

PRUNE_INTERVAL_S = 60.0


class QuotaExceededError(ResourceExhaustedError):
    """A tenant's request does not fit its `tokens_per_minute`; `retry_after_s` is when it would
    (None: never, it is larger than the whole quota)."""

    def __init__(self, message: str, retry_after_s: float | None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    used: float  # tokens charged and not yet drained, as of `at`
    at: float
    per_minute: int  # the limit last seen: the drain rate is per_minute / 60 a second

    def drained(self, now: float) -> float:
        """What is still used at `now`."""
        return max(0.0, self.used - (now - self.at) * self.per_minute / 60.0)


@dataclass
class TokenQuotas:
    """A token bucket per tenant; `now` in seconds from any fixed origin (the loop's time.time())."""

    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _pruned_at: float = float("-inf")

    def charge(self, tenant: str, per_minute: int, cost: int, now: float) -> None:
        """Take `cost` tokens from `tenant`'s bucket of `per_minute` (0: unlimited), or raise
        QuotaExceededError and take nothing."""
        self._prune(now)
        if per_minute <= 0:
            return
        if cost > per_minute:
            raise QuotaExceededError(
                f"tenant {tenant!r}: this request needs {cost} tokens (prompt + max_tokens), more than its whole "
                f"quota (tokens_per_minute = {per_minute}): it can never be admitted; shorten the prompt or "
                "lower max_tokens",
                None,
            )
        bucket = self._buckets.get(tenant)
        used = bucket.drained(now) if bucket is not None else 0.0
        if used + cost > per_minute:
            wait = (used + cost - per_minute) / (per_minute / 60.0)
            raise QuotaExceededError(
                f"tenant {tenant!r} used its quota (tokens_per_minute = {per_minute}): this request needs {cost} "
                f"tokens (prompt + max_tokens) and {max(0, int(per_minute - used))} are left; retry in {wait:.1f} s",
                wait,
            )
        self._buckets[tenant] = _Bucket(used + cost, now, per_minute)

    def refund(self, tenant: str, per_minute: int, tokens: int, now: float) -> None:
        """Give back `tokens` charged to `tenant` (a request refused after `charge`, by the queue)."""
        bucket = self._buckets.get(tenant)
        if per_minute <= 0 or bucket is None:
            return
        self._buckets[tenant] = _Bucket(max(0.0, bucket.drained(now) - tokens), now, per_minute)

    def tenants(self) -> int:
        """Tenants with a bucket kept (one not drained empty at the last prune)."""
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        for tenant in [t for t, b in self._buckets.items() if b.drained(now) == 0.0]:
            del self._buckets[tenant]
