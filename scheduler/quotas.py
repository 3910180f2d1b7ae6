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
- A client request of several generations (an HTTP body's prompts × n, or best_of) is admitted or
  refused whole: each of its Submits carries the request's key and its whole cost (the sum of prompt
  + max_new_tokens over its generations; `group`). The first Submit of a key charges the whole cost
  once; for GROUP_MEMORY_S its siblings share that outcome: admitted (charged nothing more) or refused
  (the same refusal, its retry hint shortened by the time since). A sibling the queue refuses after
  its request was charged gives the whole charge back (`refund`), and the request counts as refused
  from then on. So a list that can never fit is refused with no retry hint, like a single prompt, and
  burns nothing; one that fits is charged once.

Tenants never share a bucket. A bucket that has drained empty is forgotten (checked at most once a
`PRUNE_INTERVAL_S`), so memory follows the tenants active in the last minute. The quotas live in
the scheduler process: a restarted scheduler starts every bucket full.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from loraserve.errors import LoraserveError, ResourceExhaustedError, error_for_status

PRUNE_INTERVAL_S = 60.0
GROUP_MEMORY_S = 30.0  # a client request's outcome is remembered this long for its later generations
MAX_GROUPS = 16384  # client requests remembered at most (the oldest are forgotten first)
Group = tuple[str, int]  # (the client request's key, its whole cost); ("", 0): a Submit charged alone


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
class _Outcome:
    """What became of a client request charged as a whole (`group`)."""

    at: float  # when it was charged or refused
    tokens: int  # charged for all its generations (0 once refused)
    refusal: LoraserveError | None = None  # the refusal its later generations share


@dataclass
class TokenQuotas:
    """A token bucket per tenant; `now` in seconds from any fixed origin (the loop's time.time())."""

    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _pruned_at: float = float("-inf")
    _groups: OrderedDict[str, _Outcome] = field(default_factory=OrderedDict)  # client request key -> outcome

    def charge(self, tenant: str, per_minute: int, cost: int, now: float, group: Group = ("", 0)) -> int:
        """Take `cost` tokens from `tenant`'s bucket of `per_minute` (0: unlimited), or raise
        QuotaExceededError and take nothing; returns the tokens taken. With `group` (a client request's key
        and its whole cost), the request is charged once, by its first generation, and its other
        generations share the outcome (module docstring)."""
        self._prune(now)
        key, whole = group
        if per_minute <= 0:
            return 0
        if not key or whole <= 0:
            self._take(tenant, per_minute, cost, now, "this request needs")
            return cost
        known = self._outcome(key, now)
        if known is not None:
            if known.refusal is not None:
                raise _again(known, now)
            return 0
        whole = max(whole, cost)
        try:
            self._take(tenant, per_minute, whole, now, "this request's generations need")
        except QuotaExceededError as e:
            self._remember(key, _Outcome(now, 0, e))
            raise
        self._remember(key, _Outcome(now, whole))
        return whole

    def refund(
        self,
        tenant: str,
        per_minute: int,
        tokens: int,
        now: float,
        group: Group = ("", 0),
        refusal: Exception | None = None,
    ) -> None:
        """Give back `tokens` charged to `tenant` (a request refused after `charge`, by the queue). With
        `group`: give back the whole client request's charge, and its later generations share `refusal`."""
        key, whole = group
        known = self._outcome(key, now) if key and whole > 0 else None
        if known is not None:
            tokens, known.tokens = known.tokens, 0
            if known.refusal is None:
                if not isinstance(refusal, LoraserveError):
                    refusal = ResourceExhaustedError("another generation of this request was refused")
                known.refusal, known.at = refusal, now
        bucket = self._buckets.get(tenant)
        if per_minute <= 0 or bucket is None or tokens <= 0:
            return
        self._buckets[tenant] = _Bucket(max(0.0, bucket.drained(now) - tokens), now, per_minute)

    def _take(self, tenant: str, per_minute: int, cost: int, now: float, needs: str) -> None:
        if cost > per_minute:
            raise QuotaExceededError(
                f"tenant {tenant!r}: {needs} {cost} tokens (prompt + max_tokens), more than its whole quota "
                f"(tokens_per_minute = {per_minute}): it can never be admitted; send fewer prompts or choices, "
                "shorten the prompt or lower max_tokens",
                None,
            )
        bucket = self._buckets.get(tenant)
        used = bucket.drained(now) if bucket is not None else 0.0
        if used + cost > per_minute:
            wait = (used + cost - per_minute) / (per_minute / 60.0)
            raise QuotaExceededError(
                f"tenant {tenant!r} used its quota (tokens_per_minute = {per_minute}): {needs} {cost} tokens "
                f"(prompt + max_tokens) and {max(0, int(per_minute - used))} are left; retry in {wait:.1f} s",
                wait,
            )
        self._buckets[tenant] = _Bucket(used + cost, now, per_minute)

    def _outcome(self, key: str, now: float) -> _Outcome | None:
        known = self._groups.get(key)
        if known is not None and now - known.at > GROUP_MEMORY_S:
            del self._groups[key]
            return None
        return known

    def _remember(self, key: str, outcome: _Outcome) -> None:
        self._groups[key] = outcome
        self._groups.move_to_end(key)
        while self._groups:  # the oldest first: forget those past the memory, and beyond MAX_GROUPS
            oldest = next(iter(self._groups.values()))
            if len(self._groups) <= MAX_GROUPS and outcome.at - oldest.at <= GROUP_MEMORY_S:
                break
            self._groups.popitem(last=False)

    def requests(self) -> int:
        """Client requests whose outcome is remembered (`group`)."""
        return len(self._groups)

    def tenants(self) -> int:
        """Tenants with a bucket kept (one not drained empty at the last prune)."""
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        for tenant in [t for t, b in self._buckets.items() if b.drained(now) == 0.0]:
            del self._buckets[tenant]


def _again(known: _Outcome, now: float) -> LoraserveError:
    """A refused client request's refusal, for another of its generations: the same status and message,
    and a quota's retry hint shortened by the time since."""
    refusal = known.refusal
    assert refusal is not None
    if isinstance(refusal, QuotaExceededError):
        hint = refusal.retry_after_s
        return QuotaExceededError(str(refusal), None if hint is None else max(0.0, hint - (now - known.at)))
    return error_for_status(refusal.status, str(refusal))
