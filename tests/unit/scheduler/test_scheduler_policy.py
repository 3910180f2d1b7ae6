"""The scheduler's policy object, alone: admission, Punica placement, prediction, failure handling.

Tests of FCFS's own order name it; the rest run under every policy (the adaptive policy's own
parts are tested in test_scheduling_policies.py)."""

from __future__ import annotations

import msgspec
import pytest
from queued import queued

from loraserve.errors import ResourceExhaustedError, UnavailableError
from loraserve.scheduler.policy import (
    AssignTo,
    CancelOn,
    Fail,
    PolicyConfig,
    PrefetchOn,
    SchedulerPolicy,
    WorkerGone,
)
from loraserve.wire import WorkerReport


@pytest.fixture(params=["fcfs", "adaptive"])
def kind(request):
    """The policies every test that is not about FCFS's own order runs under."""
    return request.param


def report(
    worker_id, running=(), free_pages=100, max_batch=4, resident=(), finished=(), ready=True, fatal=None, instance=""
):
    return WorkerReport(
        worker_id=worker_id,
        ready=ready,
        max_batch_size=max_batch,
        total_pages=100,
        free_pages=free_pages,
        kv_pages=100 - free_pages,
        adapter_pages=0,
        running=list(running),
        waiting=[],
        resident=[list(k) for k in resident],
        finished=list(finished),
        tokens_per_page=16,
        fatal=fatal,
        instance=instance,
    )


def request(rid, adapter=None, prompt=16, new=16, deadline=None):
    return queued(rid, adapter, prompt, new, deadline=deadline)


def assigned(decisions):
    return [(d.worker_id, d.request.request_id) for d in decisions if isinstance(d, AssignTo)]


def test_no_ready_worker_means_unavailable(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    with pytest.raises(UnavailableError):
        policy.add(request("r"), 0.0)
    policy.on_report(report("w", ready=False), 0.0)
    with pytest.raises(UnavailableError):
        policy.add(request("r"), 0.0)


def test_bounded_queue(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, max_queue_length=2))
    policy.on_report(report("w", max_batch=0), 0.0)  # no batch room: everything stays queued
    policy.add(request("a"), 0.0)
    policy.add(request("b"), 0.0)
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        policy.add(request("c"), 0.0)


def test_request_larger_than_any_pool_is_refused(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w"), 0.0)
    with pytest.raises(ResourceExhaustedError, match="can ever hold"):
        policy.add(request("huge", prompt=100 * 16, new=16), 0.0)


def test_fcfs_places_on_the_least_loaded_worker_with_room():
    policy = SchedulerPolicy(PolicyConfig(policy="fcfs"))
    policy.on_report(report("light", running=["x"]), 0.0)
    policy.on_report(report("busy", running=["y", "z"]), 0.0)
    policy.on_report(report("full", free_pages=0), 0.0)  # the least loaded (holds nothing) but no pool room
    policy.add(request("a"), 0.0)
    assert assigned(policy.schedule(0.0)) == [("light", "a")]
    # light and busy now hold 2 each: the tie goes to the smaller id (busy), then light is the less loaded
    for rid in ("b", "c"):
        policy.add(request(rid), 0.0)
    assert assigned(policy.schedule(0.0)) == [("busy", "b"), ("light", "c")]


def test_fcfs_breaks_a_load_tie_toward_the_worker_holding_the_adapter():
    policy = SchedulerPolicy(PolicyConfig(policy="fcfs"))
    policy.on_report(report("a", running=["x"]), 0.0)
    policy.on_report(report("b", running=["y"], resident=[("lora", 1)]), 0.0)
    policy.add(request("r", adapter=("lora", 1)), 0.0)
    assert assigned(policy.schedule(0.0)) == [("b", "r")]


def test_pool_room_is_respected_including_unreported_assignments(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w", free_pages=3, max_batch=10), 0.0)  # 3 pages: one request of 2 pages
    policy.on_report(report("v", free_pages=50, max_batch=10), 0.0)
    for rid in ("a", "b"):
        policy.add(request(rid), 0.0)
    decisions = assigned(policy.schedule(0.0))
    assert sorted(w for w, _ in decisions) == ["v", "w"]


def test_head_of_line_is_not_overtaken():
    policy = SchedulerPolicy(PolicyConfig(policy="fcfs"))
    policy.on_report(report("w", free_pages=3, max_batch=10), 0.0)
    policy.add(request("big", prompt=60, new=20), 0.0)  # 5 pages: does not fit now
    policy.add(request("small"), 0.0)
    assert assigned(policy.schedule(0.0)) == []
    policy.on_report(report("w", free_pages=80, max_batch=10), 0.1)
    assert assigned(policy.schedule(0.1)) == [("w", "big"), ("w", "small")]


def test_silent_worker_is_dropped_and_its_requests_fail(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1.0))
    policy.on_report(report("dead"), 0.0)
    policy.on_report(report("alive"), 0.0)
    policy.add(request("a"), 0.0)
    [(worker, _)] = assigned(policy.schedule(0.0))
    policy.on_report(report("alive" if worker == "dead" else "dead"), 0.9)
    policy.on_report(report(worker), 0.9)
    other = "alive" if worker == "dead" else "dead"
    policy.on_report(report(other), 2.0)
    decisions = policy.schedule(2.0)
    gone = [d for d in decisions if isinstance(d, WorkerGone)]
    failed = [d for d in decisions if isinstance(d, Fail)]
    assert [g.worker_id for g in gone] == [worker]
    assert [(f.request.request_id, f.status) for f in failed] == [("a", "UNAVAILABLE")]
    assert "stopped responding" in failed[0].message
    policy.add(request("b"), 2.0)
    assert assigned(policy.schedule(2.0)) == [(other, "b")]


def test_fatal_report_drops_the_worker_at_once(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w"), 0.0)
    policy.add(request("a"), 0.0)
    policy.schedule(0.0)
    decisions = policy.on_report(report("w", fatal="CUDA error"), 0.1)
    assert any(isinstance(d, Fail) and "CUDA error" in d.message for d in decisions)
    assert "w" not in policy.workers


def test_queued_deadline_expires(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=100.0))
    policy.on_report(report("w", max_batch=0), 0.0)
    policy.add(request("a", deadline=5.0), 0.0)
    assert policy.schedule(4.9) == []
    [failure] = [d for d in policy.schedule(5.0) if isinstance(d, Fail)]
    assert failure.status == "DEADLINE_EXCEEDED" and not policy.queue


def test_cancel_in_queue_and_on_worker(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w", max_batch=1), 0.0)
    policy.add(request("running"), 0.0)
    policy.schedule(0.0)
    policy.add(request("queued"), 0.0)
    assert policy.cancel("queued", "client") == (True, [])
    found, decisions = policy.cancel("running", "client")
    assert found and decisions == [CancelOn("w", ("running",), "client")]
    assert policy.cancel("unknown", "client") == (False, [])


def test_finished_requests_free_their_worker(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w", max_batch=1), 0.0)
    policy.add(request("a"), 0.0)
    policy.add(request("b"), 0.0)
    assert assigned(policy.schedule(0.0)) == [("w", "a")]
    policy.on_report(report("w", max_batch=1, running=["a"]), 0.1)
    assert assigned(policy.schedule(0.1)) == []
    policy.on_report(report("w", max_batch=1, finished=["a"]), 0.2)
    assert assigned(policy.schedule(0.2)) == [("w", "b")]


def test_prefetch_predictions_from_the_queue():
    policy = SchedulerPolicy(PolicyConfig(policy="fcfs"))
    policy.on_report(report("w", max_batch=0, resident=[("x", 1)]), 0.0)
    policy.add(request("a", adapter=("x", 1)), 0.0)
    policy.add(request("b", adapter=("y", 2)), 0.0)
    policy.add(request("c", adapter=("y", 2)), 0.0)
    [hint] = [d for d in policy.schedule(0.0) if isinstance(d, PrefetchOn)]
    assert hint == PrefetchOn("w", (("y", 2),))
    assert not [d for d in policy.schedule(0.1) if isinstance(d, PrefetchOn)], "unchanged hints are not resent"


def test_a_request_whose_assign_failed_is_forgotten_by_its_worker_too(kind):
    """The loop could not send an ASSIGN and failed the request itself; when that worker is dropped
    later, the policy must neither fail the request a second time nor crash on its missing entry."""
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1.0))
    policy.on_report(report("w"), 0.0)
    policy.add(request("a"), 0.0)
    assert assigned(policy.schedule(0.0)) == [("w", "a")]
    policy.forget("a")  # what SchedulerLoop._fail does after the failed send
    assert "a" not in policy.placed and "a" not in policy.workers["w"].assigned
    decisions = policy.schedule(5.0)  # "w" went silent: dropped
    assert [d.worker_id for d in decisions if isinstance(d, WorkerGone)] == ["w"]
    assert not [d for d in decisions if isinstance(d, Fail)]


def test_an_unreachable_worker_is_dropped_at_once_and_the_bounced_request_queued_again(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("dead"), 0.0)
    policy.add(request("held"), 0.0)
    policy.add(request("bounced"), 0.0)
    assert assigned(policy.schedule(0.1)) == [("dead", "held"), ("dead", "bounced")]
    decisions = policy.unreachable("dead", "bounced")
    assert [type(d) for d in decisions] == [WorkerGone, Fail]
    assert decisions[1].request.request_id == "held" and decisions[1].status == "UNAVAILABLE"
    assert "dead" not in policy.workers and list(policy.queue) == ["bounced"]
    policy.on_report(report("alive"), 0.2)
    assert assigned(policy.schedule(0.3)) == [("alive", "bounced")]


def test_a_report_from_a_new_process_drops_what_the_old_one_held(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("w", instance="first"), 0.0)
    policy.add(request("r"), 0.0)
    assert assigned(policy.schedule(0.1)) == [("w", "r")]
    decisions = policy.on_report(report("w", instance="second", ready=False), 0.5)  # restarted, loading
    assert [type(d) for d in decisions] == [WorkerGone, Fail]
    assert "restarted" in decisions[0].reason and decisions[1].request.request_id == "r"
    assert policy.workers["w"].report.instance == "second" and not policy.workers["w"].assigned
    assert policy.on_report(report("w", instance="second"), 1.0) == []  # the same process again: nothing


def test_failed_over_requests_are_marked_retry(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1.0))
    policy.on_report(report("w"), 0.0)
    policy.add(request("r"), 0.0)
    policy.schedule(0.1)
    decisions = policy.schedule(2.0)  # silent past the timeout
    fail = next(d for d in decisions if isinstance(d, Fail))
    assert fail.status == "UNAVAILABLE" and fail.retry


def test_no_placement_on_a_stale_or_draining_worker(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=10.0, stale_after_s=0.5))
    policy.on_report(report("quiet"), 0.0)
    policy.add(request("r"), 0.0)
    assert policy.schedule(1.0) == []  # silent for 1 s: not dead yet, but nothing new goes there
    policy.on_report(msgspec.structs.replace(report("busy"), draining=True), 1.0)
    assert policy.schedule(1.1) == []
    policy.on_report(report("fresh"), 1.2)
    assert assigned(policy.schedule(1.3)) == [("fresh", "r")]


def test_a_dropped_worker_that_comes_back_is_told_to_drop_everything_before_it_rejoins(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1.0))
    policy.on_report(report("w", instance="one"), 0.0)
    policy.add(request("r"), 0.0)
    policy.schedule(0.1)
    assert any(isinstance(d, Fail) for d in policy.schedule(5.0))  # dropped (SIGSTOP)
    back = policy.on_report(report("w", running=["r"], instance="one"), 6.0)  # SIGCONT
    assert back == [CancelOn("w", ("r",), "this worker was dropped")]
    assert "w" not in policy.workers and "r" not in policy.placed
    assert policy.on_report(report("w", instance="one"), 6.5) == []  # empty now: registered again
    assert "w" in policy.workers


def test_a_new_scheduler_adopts_the_requests_workers_report_so_cancels_still_reach_them(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))  # a restarted scheduler: it never placed "r"
    assert policy.on_report(report("w", running=["r"]), 0.0) == []
    found, decisions = policy.cancel("r", "client cancelled")
    assert found and decisions == [CancelOn("w", ("r",), "client cancelled")]
    dropped = policy.unreachable("w")
    assert [type(d) for d in dropped] == [WorkerGone], "an adopted request has no gateway known here"


def test_a_failed_over_request_goes_to_the_head_of_the_queue_even_when_it_is_full(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, max_queue_length=2))
    policy.on_report(report("w", max_batch=0), 0.0)  # no room: everything queues
    policy.add(request("a"), 0.0)
    policy.add(request("b"), 0.0)
    with pytest.raises(ResourceExhaustedError):
        policy.add(request("c"), 0.0)
    assert policy.add(request("resumed"), 0.0, resumed=True) == 0
    assert list(policy.queue) == ["resumed", "a", "b"]


def test_a_prefill_group_goes_where_its_first_request_went_while_there_is_room(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind))
    policy.on_report(report("light", running=["x"]), 0.0)
    first = queued("g0", group="tenant/g")
    policy.add(first, 0.0)
    assert assigned(policy.schedule(0.0)) == [("light", "g0")]  # the only worker then
    policy.on_report(report("busy", running=["y", "z"]), 0.0)  # a busier worker joins
    for i in range(1, 4):
        member = queued(f"g{i}", group="tenant/g")
        policy.add(member, 0.0)
    # light holds x and g0 of 4: two members join g0 there, the third spills over
    assert assigned(policy.schedule(0.0)) == [("light", "g1"), ("light", "g2"), ("busy", "g3")]
