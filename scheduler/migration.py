"""Migration: requests waiting on an overloaded worker move to an idle one (Punica §5.2, by recompute).

A worker's `waiting` requests were placed on it but are not running: its pool had no room for
their KV or their adapter is still loading. When one has waited there `after_s` and another worker
is idle enough to take it (nothing waiting, fewer requests, batch and pool room, and cheapest by
the placement cost), it moves: the policy fails it on its worker with `retry` set and cancels it
there, and the gateway submits it again (a new attempt, at the head of the queue, with any token
already streamed recomputed: the same path as failover). Nothing has run yet for a waiting
request, so the move costs one round trip. A request moves at most once (attempt 0 only), and a
worker gives up at most one request per round, so load evens out without oscillating.

A *running* request moves only when that is cheap and nothing else helps: its worker has had a
request waiting for `after_s` that could not move (it fits no idle worker), a worker is idle
(nothing at all), and the running request has computed at most `max_recompute_tokens` (prompt plus
the tokens it has probably generated): the idle worker recomputes those in one prefill, and the
pages it frees let a waiting request start. The youngest (least to recompute) goes first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loraserve.scheduler.placement import Demand, Placement, WorkerLoad


@dataclass(frozen=True)
class WaitingRequest:
    worker_id: str
    request_id: str
    demand: Demand
    waiting_since: float  # when it was placed on the worker


@dataclass(frozen=True)
class RunningRequest:
    worker_id: str
    request_id: str
    demand: Demand
    recompute_tokens: int  # what a new worker must recompute: the prompt and the tokens generated so far


@dataclass(frozen=True)
class Move:
    request_id: str
    source: str
    target: str


def plan_migrations(
    loads: list[WorkerLoad],
    waiting: list[WaitingRequest],
    now: float,
    after_s: float,
    placement: Placement,
    running: list[RunningRequest] = (),
    max_recompute_tokens: int = 256,
) -> list[Move]:
    by_id = {w.worker_id: w for w in loads}
    moves: list[Move] = []
    moved_from: set[str] = set()
    for item in sorted(waiting, key=lambda x: x.waiting_since):
        source = by_id.get(item.worker_id)
        if source is None or item.worker_id in moved_from or now - item.waiting_since < after_s:
            continue
        idle = [
            w
            for w in by_id.values()
            if w.worker_id != source.worker_id and w.waiting == 0 and w.requests + 1 < source.requests
        ]
        target = placement.choose(idle, item.demand)
        if target is None:
            continue
        moves.append(Move(item.request_id, source.worker_id, target.worker_id))
        moved_from.add(source.worker_id)
        by_id[target.worker_id] = replace(target, requests=target.requests + 1, waiting=target.waiting + 1)
    stuck = {item.worker_id for item in waiting if now - item.waiting_since >= after_s} - moved_from
    for item in sorted(running, key=lambda x: x.recompute_tokens):
        if item.worker_id not in stuck or item.recompute_tokens > max_recompute_tokens:
            continue
        idle = [w for w in by_id.values() if w.worker_id != item.worker_id and w.requests == 0]
        target = placement.choose(idle, item.demand)
        if target is None:
            continue
        moves.append(Move(item.request_id, item.worker_id, target.worker_id))
        stuck.discard(item.worker_id)
        by_id[target.worker_id] = replace(target, requests=1, waiting=1)
    return moves
