"""The order of a worker's adapter fetches (`worker/fetch_queue.py`): demand before prefetch."""

from __future__ import annotations

import threading

from loraserve.worker.fetch_queue import FetchQueue


def _drain(queue: FetchQueue) -> list[tuple[str, bool]]:
    out = []
    while (job := queue.take(timeout=0)) is not None:
        out.append((job.key[0], job.demand))
    return out


def test_a_waiting_requests_fetch_goes_before_every_queued_prefetch():
    queue = FetchQueue()
    for name in ("p1", "p2", "p3"):
        queue.put((name, 1), demand=False)
    queue.put(("d1", 1), demand=True)
    queue.put(("d2", 1), demand=True)
    assert _drain(queue) == [("d1", True), ("d2", True), ("p1", False), ("p2", False), ("p3", False)]


def test_a_queued_prefetch_a_request_now_waits_for_is_promoted_once():
    queue = FetchQueue()
    for name in ("p1", "p2", "p3"):
        queue.put((name, 1), demand=False, trace={"traceparent": name})
    queue.put(("d1", 1), demand=True)
    assert queue.promote(("p3", 1)) and queue.promote(("p3", 1))  # still queued: promoted (once)
    queue.put(("p2", 1), demand=True)  # asking again for a queued one promotes it too
    queue.put(("p1", 1), demand=False)  # a second hint for a queued one adds nothing
    assert len(queue) == 4
    job = queue.take(timeout=0)
    assert (job.key, job.demand) == (("d1", 1), True)
    promoted = queue.take(timeout=0)
    assert (promoted.key, promoted.demand, promoted.trace) == (("p3", 1), True, {"traceparent": "p3"})
    assert _drain(queue) == [("p2", True), ("p1", False)]
    assert not queue.promote(("p3", 1))  # handed out already: under way, nothing to promote


def test_take_waits_for_a_job_and_close_wakes_every_taker():
    queue = FetchQueue()
    got: list = []
    takers = [threading.Thread(target=lambda: got.append(queue.take(timeout=30))) for _ in range(2)]
    for t in takers:
        t.start()
    queue.put(("a", 1), demand=False)
    queue.close()
    for t in takers:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in takers)
    assert sorted(job.key[0] if job else "" for job in got) in (["", "a"], ["", ""])
    assert queue.take(timeout=0) is None
