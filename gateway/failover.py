"""One request's token stream across the workers it takes: transparent failover.

The gateway is the one place that knows a request's prompt and every token already streamed to
its client, so it owns failover. A request runs as a series of *attempts*, each submitted to the
scheduler under its own id (`<request id>`, then `<request id>.1`, `.2`, ...). An attempt ends in
one of three ways:

- its TOKENS end normally, or fail for a reason of the request's own: the stream ends with it;
- it is *lost* (its worker died, stopped answering, or drained past its timeout): the scheduler or
  the worker says so with `retry` set, or the gateway's cluster watch sees the worker leave the
  cluster, or sees that the scheduler that queued it restarted before a worker took it. The next
  attempt is submitted with the prompt plus every token streamed so far (`output_ids`); its
  worker recomputes that prefix and continues. Greedy and seeded sampling draw exactly the tokens
  the lost attempt would have (draws are keyed by (seed, position)), so the client sees one
  stream with no token missing or repeated;
- it makes no progress for `inactivity_timeout_s`: UNAVAILABLE.

A lost attempt's successor waits for a worker: while its submission is refused UNAVAILABLE (no
worker is ready, as in a one-worker stack whose worker the supervisor is replacing, or no scheduler
answers), it is tried again with backoff for up to `failover_wait_s` from the loss, and only then
does the request end UNAVAILABLE.

A separate id per attempt means a late message from a lost attempt (a stopped worker resumed) can
never mix into the stream: the sink drops messages for ids nobody reads. After `max_failovers`
lost attempts the request ends UNAVAILABLE.

A request may itself be what stops its workers (a constraint that wedges the engine, an input that
crashes a step): resubmitting it would take down one worker after another, and every request on
them with it. So an attempt that a worker took (acknowledged) and lost with that worker before the
stream got a new token counts as *lost without progress* (a migration, the scheduler moving the
request off a worker that is fine, does not count; any new token resets the count). After
`max_losses_without_progress` such losses in a row the request is not resubmitted: it ends INTERNAL
(`NotResubmittedError`), never UNAVAILABLE, which clients retry: the message says why, so whoever
sent it can look at it before sending it again.

`FailoverStream` is one request's attempts; `Streams` holds the live ones and applies what the
cluster watch sees to them. Neither does gRPC itself: the service passes `submit` and `cancel`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError, LoraserveError, UnavailableError, error_for_status
from loraserve.gateway import metrics
from loraserve.gateway.token_sink import TokenSink
from loraserve.wire import Tokens

log = logging.getLogger(__name__)

# submit(attempt_id, attempt number, output_ids) -> the instance of the scheduler that queued it
Submit = Callable[[str, int, list[int]], Awaitable[str]]
Cancel = Callable[[str, str], None]  # cancel(attempt_id, reason), fire and forget


@dataclass(frozen=True)
class FailoverConfig:
    max_failovers: int = setting(
        3, "times a request may lose its worker and continue on another before it fails UNAVAILABLE"
    )
    inactivity_timeout_s: float = setting(
        60.0, "fail a request that makes no progress this long", flag="--inactivity-timeout"
    )  # no message for this long: the request failed somewhere
    scheduler_grace_s: float = setting(
        10.0,
        "seconds without a scheduler before requests no worker has taken fail UNAVAILABLE",
        flag="--scheduler-grace",
    )
    failover_wait_s: float = setting(
        15.0,
        "seconds a request that lost its worker waits for another one (e.g. a restarted worker) before it fails",
        flag="--failover-wait",
    )
    max_losses_without_progress: int = setting(
        2,
        "a request whose attempts lose their worker this many times in a row before a new token is not "
        "resubmitted (it may be what stops the workers) and ends INTERNAL; 0: no such limit",
    )

    def __post_init__(self) -> None:
        if self.max_failovers < 0 or self.inactivity_timeout_s <= 0 or self.scheduler_grace_s <= 0:
            raise InvalidConfigError(f"invalid failover config {self}")
        if self.max_losses_without_progress < 0:
            raise InvalidConfigError(
                f"max_losses_without_progress must be >= 0 (0: no limit), not {self.max_losses_without_progress}"
            )
        if not 0 <= self.failover_wait_s < math.inf:
            raise InvalidConfigError(
                f"failover_wait_s must be a finite number of seconds >= 0, not {self.failover_wait_s}"
            )


UNAVAILABLE = "UNAVAILABLE"
RESUBMIT_BACKOFF_S = (0.1, 1.0)  # first and longest pause between submissions of a waiting successor


class NotResubmittedError(LoraserveError):
    """Attempts of the request kept losing their worker before producing a token: it is not resubmitted.

    INTERNAL, not UNAVAILABLE: clients retry UNAVAILABLE, and this request may be what stops the workers."""

    status = "INTERNAL"


class _Lost(Exception):
    """The current attempt was lost with its worker or scheduler; another may succeed. `worker_lost`: a worker
    had taken it and was lost under it (not a migration, not a scheduler that never placed it)."""

    def __init__(self, reason: str, worker_lost: bool = False):
        super().__init__(reason)
        self.worker_lost = worker_lost


class _Inactivity:
    """An attempt's inactivity deadline: one timer per attempt, not one per message. When no message has come
    for `timeout_s` and none waits to be read, it ends the attempt UNAVAILABLE through its queue."""

    def __init__(self, queue: asyncio.Queue[Tokens], timeout_s: float, attempt_id: str):
        self.loop = asyncio.get_running_loop()
        self.queue, self.timeout_s = queue, timeout_s
        self.notice = Tokens(
            attempt_id,
            [],
            finished=True,
            error_status=UNAVAILABLE,
            error=f"no progress for {timeout_s:.0f} s; the serving stack may be degraded",
        )
        self.last = self.loop.time()  # when the reader last got a message
        self.timer = self.loop.call_at(self.last + timeout_s, self._check)

    def progressed(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        now = self.loop.time()
        if not self.queue.empty():  # messages wait for a slow reader: that is progress
            self.timer = self.loop.call_at(now + self.timeout_s, self._check)
        elif now - self.last < self.timeout_s:
            self.timer = self.loop.call_at(self.last + self.timeout_s, self._check)
        else:
            self.queue.put_nowait(self.notice)

    def cancel(self) -> None:
        self.timer.cancel()


class FailoverStream:
    """The TOKENS of one request, attempt after attempt, as one stream (see the module docstring)."""

    def __init__(self, request_id: str, sink: TokenSink, submit: Submit, cancel: Cancel, config: FailoverConfig):
        self.request_id = request_id
        self.sink, self._submit, self._cancel, self.config = sink, submit, cancel, config
        self.attempt_id = request_id
        self.failovers = 0
        self.output_ids: list[int] = []  # every token streamed to the client so far
        self.worker_id = ""  # the current attempt's worker, once it acknowledged the request
        self.placed_at: float | None = None  # monotonic time of that acknowledgement
        self.scheduler_instance = ""  # the scheduler that queued the current attempt
        self.lost_at: float | None = None  # monotonic time the last attempt was lost
        self.attempt_tokens = 0  # len(output_ids) when the current attempt began
        self.losses_without_progress = 0  # attempts in a row whose worker was lost before a new token came
        self._queue: asyncio.Queue[Tokens] | None = None

    async def messages(self) -> AsyncIterator[Tokens]:
        """Every TOKENS message of the request, the lost attempts' failures left out."""
        while True:
            attempt_id = self.attempt_id
            self._queue = queue = self.sink.open(attempt_id)
            self.attempt_tokens = len(self.output_ids)
            inactivity = None
            try:
                self.scheduler_instance = await self._submit_attempt(attempt_id)
                inactivity = _Inactivity(queue, self.config.inactivity_timeout_s, attempt_id)
                while True:
                    message = await queue.get()
                    inactivity.progressed()
                    if self._accepted(message):
                        yield message
                        if message.finished:
                            return
            except _Lost as e:
                self._next_attempt(str(e), e.worker_lost)
            finally:
                if inactivity is not None:
                    inactivity.cancel()
                self.sink.close(attempt_id)

    def lose(self, reason: str) -> None:
        """End the current attempt as lost: the next one continues the stream elsewhere."""
        self._inject(UNAVAILABLE, reason, retry=True)

    def fail(self, reason: str) -> None:
        """End the request UNAVAILABLE, with no further attempt."""
        self._inject(UNAVAILABLE, reason, retry=False)

    @property
    def placed(self) -> bool:
        return self.placed_at is not None

    @property
    def backlog(self) -> bool:
        """Whether messages of the current attempt already wait to be read (its reader is behind)."""
        return self._queue is not None and not self._queue.empty()

    # ---- internals -----------------------------------------------------------------------------
    def _inject(self, status: str, reason: str, retry: bool) -> None:
        if self._queue is not None:  # a notice for an attempt that already ended is skipped by _accepted
            self._queue.put_nowait(
                Tokens(self.attempt_id, [], finished=True, error_status=status, error=reason, retry=retry)
            )

    async def _submit_attempt(self, attempt_id: str) -> str:
        """Submit the current attempt; a successor of a lost one waits (bounded) for a worker to take it."""
        if self.lost_at is None:
            return await self._submit(attempt_id, self.failovers, list(self.output_ids))
        deadline = self.lost_at + self.config.failover_wait_s
        pause, longest = RESUBMIT_BACKOFF_S
        while True:
            try:
                return await self._submit(attempt_id, self.failovers, list(self.output_ids))
            except UnavailableError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(
                        f"the request lost its worker and no worker could take it over within "
                        f"{self.config.failover_wait_s:g} s ({e}); retry it"
                    ) from None
                await asyncio.sleep(min(pause, left))
                pause = min(2 * pause, longest)

    def _accepted(self, message: Tokens) -> bool:
        """Whether `message` goes to the client (False: a late notice of an attempt that moved on); raises
        `_Lost` for a lost attempt and the request's own failure as its error."""
        if message.request_id != self.attempt_id:
            return False
        taken = self.placed  # a worker had acknowledged the attempt before this message
        if message.worker_id and self.placed_at is None:
            self.worker_id, self.placed_at = message.worker_id, time.monotonic()
        if message.error_status:
            if message.retry:
                raise _Lost(message.error or "the worker was lost", worker_lost=taken and not message.moved)
            raise error_for_status(message.error_status, message.error or message.error_status)
        self.output_ids += message.token_ids
        return True

    def _next_attempt(self, reason: str, worker_lost: bool) -> None:
        lost = self.attempt_id
        self._cancel(lost, "failed over")  # in case it still runs somewhere (a stopped worker resumed)
        if len(self.output_ids) > self.attempt_tokens:
            self.losses_without_progress = 0
        if worker_lost and len(self.output_ids) == self.attempt_tokens:
            self.losses_without_progress += 1
            limit = self.config.max_losses_without_progress
            if limit and self.losses_without_progress >= limit:
                log.warning("request %s: not resubmitted (%d workers lost under it; last: %s)", lost, limit, reason)
                raise NotResubmittedError(
                    f"the request was not resubmitted: {self.losses_without_progress} attempts in a row lost their "
                    f"worker before producing a token (last: {reason}); the request itself may be what stops the "
                    "workers (e.g. a structured-output constraint too costly to follow): check it before sending "
                    "it again"
                )
        self.failovers += 1
        metrics.FAILOVERS.inc()
        if self.failovers > self.config.max_failovers:
            raise UnavailableError(
                f"the request was lost with its worker {self.failovers} times (last: {reason}); retry it"
            )
        self.attempt_id = f"{self.request_id}.{self.failovers}"
        self.worker_id, self.placed_at, self._queue = "", None, None
        self.scheduler_instance, self.lost_at = "", time.monotonic()  # no scheduler holds the successor yet
        log.info(
            "request %s: attempt %s lost (%s); continuing as %s after %d tokens",
            self.request_id,
            lost,
            reason,
            self.attempt_id,
            len(self.output_ids),
        )


class Streams:
    """The gateway's live FailoverStreams, and what the cluster watch's view means for them."""

    SETTLE_S = 3.0  # after a scheduler restart, workers need a few reports to be listed again

    def __init__(self, config: FailoverConfig) -> None:
        self.config = config
        self._live: dict[str, FailoverStream] = {}
        self._scheduler_down_since: float | None = None
        self._instance = ""  # the scheduler instance last seen
        self._instance_since = -math.inf  # when it was first seen, if it replaced another

    def add(self, stream: FailoverStream) -> None:
        self._live[stream.request_id] = stream

    def remove(self, stream: FailoverStream) -> None:
        self._live.pop(stream.request_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def on_cluster(self, scheduler_instance: str, workers: set[str], any_ready: bool, asked_at: float) -> None:
        """A ClusterState asked for at `asked_at` (monotonic): lose the attempts it shows are lost.

        An attempt is lost when its worker is no longer in the cluster (it acknowledged before the
        question was asked, so the answer should have listed it), or when it was queued by a
        scheduler that is not the one answering and no worker has taken it (resubmitted once the
        new scheduler has a ready worker). For `SETTLE_S` after a scheduler restart, workers
        missing from its list are given time to report again.
        """
        self._scheduler_down_since = None
        if scheduler_instance != self._instance:
            if self._instance:  # a restart, not the first answer this gateway got
                self._instance_since = asked_at
            self._instance = scheduler_instance
        settled = asked_at - self._instance_since >= self.SETTLE_S
        for stream in list(self._live.values()):
            if stream.placed:
                if settled and stream.placed_at < asked_at and stream.worker_id not in workers:
                    stream.lose(f"worker {stream.worker_id} left the cluster")
            elif any_ready and stream.scheduler_instance and stream.scheduler_instance != scheduler_instance:
                stream.scheduler_instance = ""  # lose it once
                stream.lose("the scheduler restarted before a worker took the request")

    def on_scheduler_unreachable(self, now: float) -> None:
        """No ClusterState: after `scheduler_grace_s`, requests no worker took fail (UNAVAILABLE)."""
        self._scheduler_down_since = self._scheduler_down_since or now
        if now - self._scheduler_down_since < self.config.scheduler_grace_s:
            return
        for stream in list(self._live.values()):
            if not stream.placed and stream.scheduler_instance:
                stream.scheduler_instance = ""  # fail it once
                stream.fail(f"the scheduler has not answered for {self.config.scheduler_grace_s:.0f} s; retry later")
