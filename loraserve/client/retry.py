"""Deadlines and retries of client calls, as plain objects (no I/O: the clients sleep and send).

A call has one deadline for all its tries. It is tried again only when it failed with UNAVAILABLE
(nothing could serve it: the gateway, a worker, the scheduler or the store was unreachable), it is
safe to repeat (a read, or a generation that returned nothing yet), tries are left, and the backoff
ends before the deadline.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from loraserve.client.api import ApiError, Call, Kind

RETRYABLE_CODES = frozenset({"UNAVAILABLE"})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and after how long a safe call that failed with UNAVAILABLE is tried again.

    Retry n (1-based) waits `min(max_backoff_s, initial_backoff_s * multiplier ** (n - 1))`, less a
    random fraction of it up to `jitter`; `max_attempts` counts the first try. Never retried: a stream
    that already yielded an event, uploads and deletes. `RetryPolicy(max_attempts=1)` turns retries off.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("need multiplier >= 1 and 0 <= jitter <= 1")

    def backoff_s(self, retry: int, rand: float) -> float:
        """The wait before retry number `retry` (1-based); `rand` in [0, 1) draws the jitter."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return ceiling * (1.0 - self.jitter * rand)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Deadlines:
    """Default deadline per kind of call, in seconds, for the whole call with its retries."""

    generate_s: float = 120.0
    stream_s: float = 300.0
    query_s: float = 10.0  # tokenize, model info, list and describe adapters
    upload_s: float = 300.0
    delete_s: float = 30.0

    def of(self, kind: Kind) -> float:
        return getattr(self, f"{kind}_s")


DEFAULT_DEADLINES = Deadlines()


class Attempts:
    """The tries of one call: the time left before its deadline, and whether a failure is tried again."""

    def __init__(
        self,
        policy: RetryPolicy,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ):
        self._policy = policy
        self._clock = clock
        self._rand = rand
        self._deadline = clock() + timeout_s
        self.retries = 0

    def timeout_s(self) -> float:
        """What is left of the call's deadline, for the next try."""
        return max(0.0, self._deadline - self._clock())

    def after(self, error: grpc.RpcError, started: bool = False) -> float:
        """Seconds to wait before trying again after `error`; raises it as an `ApiError` when it is final.

        `started`: the call already returned part of its answer (a streamed event), so it is final.
        """
        failure = ApiError.from_rpc(error)
        if failure.code in RETRYABLE_CODES and not started and self.retries + 1 < self._policy.max_attempts:
            delay = self._policy.backoff_s(self.retries + 1, self._rand())
            if delay < self.timeout_s():
                self.retries += 1
                return delay
        raise failure from error


@dataclass(frozen=True)
class Settings:
    """A client's per-call settings: auth metadata, default deadlines and the retry policy."""

    metadata: tuple[tuple[str, str], ...]
    deadlines: Deadlines
    retry: RetryPolicy

    def attempts(self, call: Call, timeout_s: float | None) -> Attempts:
        """The tries of `call`: `timeout_s` (or its kind's default) for all of them."""
        policy = self.retry if call.idempotent else NO_RETRY
        return Attempts(policy, self.deadlines.of(call.kind) if timeout_s is None else timeout_s)
