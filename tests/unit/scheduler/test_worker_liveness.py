"""Worker liveness in the cluster view: any message keeps a worker, only silence drops it.

A worker in a long step sends no report but keeps heartbeating (its I/O thread): it stays registered,
its requests stay where they are, and nothing new is placed on it while its step runs long. A worker
that sends nothing at all for `worker_timeout_s` is dropped and its requests fail over. A heartbeat
registers nobody, nor keeps another process under the same id; and at most `max_workers` register.
"""

from __future__ import annotations

import pytest
from test_scheduler_policy import report, request

from loraserve.scheduler.cluster import ClusterView
from loraserve.scheduler.config import ClusterConfig
from loraserve.scheduler.decisions import WorkerGone
from loraserve.scheduler.policy import AssignTo, Fail, PolicyConfig, SchedulerPolicy
from loraserve.wire import Heartbeat

TIMEOUT_S = 2.0


@pytest.mark.parametrize("kind", ["adaptive", "fcfs"])
def test_heartbeats_keep_a_worker_in_a_long_step_and_silence_drops_one(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=TIMEOUT_S, stale_after_s=0.5))
    policy.on_report(report("slow", instance="s1"), 0.0)
    policy.on_report(report("mute", instance="m1"), 0.0)
    policy.add(request("r1"), 0.0)
    policy.add(request("r2"), 0.0)
    placed = {d.request.request_id: d.worker_id for d in policy.schedule(0.0) if isinstance(d, AssignTo)}
    assert set(placed) == {"r1", "r2"}

    now, decisions = 0.0, []
    while now < 3 * TIMEOUT_S:  # "slow" is in one long step: no report, a heartbeat every 0.25 s
        now += 0.25
        assert policy.on_heartbeat(Heartbeat("slow", "s1", step_s=now), now)
        decisions += policy.schedule(now)
    assert "slow" in policy.workers, "a worker that heartbeats is alive, however long its step"
    assert "mute" not in policy.workers, "a worker that sends nothing is dropped"
    failed = {d.request.request_id for d in decisions if isinstance(d, Fail)}
    assert failed == {r for r, w in placed.items() if w == "mute"}, "only the silent worker's requests fail over"
    assert all(d.retry and "stopped responding" in d.message for d in decisions if isinstance(d, Fail))

    policy.add(request("r3"), now)
    assert not [d for d in policy.schedule(now) if isinstance(d, AssignTo)], "nothing new on a worker mid long step"
    policy.on_report(report("slow", instance="s1"), now + 0.1)  # the step ended
    assigned = [d for d in policy.schedule(now + 0.1) if isinstance(d, AssignTo)]
    assert [(d.worker_id, d.request.request_id) for d in assigned] == [("slow", "r3")]


def test_a_heartbeat_registers_nobody_and_keeps_only_its_own_process():
    cluster = ClusterView(ClusterConfig(worker_timeout_s=TIMEOUT_S, stale_after_s=0.5))
    assert not cluster.on_heartbeat(Heartbeat("stranger", "x"), 0.0)
    assert "stranger" not in cluster.workers
    cluster.on_report(report("w", instance="old"), 0.0)
    assert not cluster.on_heartbeat(Heartbeat("w", "new"), 1.5), "another process under the same id"
    gone = [d for d in cluster.silent(TIMEOUT_S + 0.5) if isinstance(d, WorkerGone)]
    assert [d.worker_id for d in gone] == ["w"], "the registered process fell silent: its heartbeat was not heard"


def test_a_step_that_runs_long_takes_a_fresh_worker_off_the_placement_list():
    cluster = ClusterView(ClusterConfig(worker_timeout_s=TIMEOUT_S, stale_after_s=0.5))
    cluster.on_report(report("w", instance="i"), 0.0)
    assert [v.worker_id for v in cluster.fresh(0.1)] == ["w"]
    cluster.on_heartbeat(Heartbeat("w", "i", step_s=0.45), 0.2)
    assert [v.worker_id for v in cluster.fresh(0.2)] == ["w"]
    cluster.on_heartbeat(Heartbeat("w", "i", step_s=0.7), 0.3)  # reported 0.3 s ago, but its step is long
    assert cluster.fresh(0.3) == []
    cluster.on_report(report("w", instance="i"), 0.4)
    assert [v.worker_id for v in cluster.fresh(0.4)] == ["w"]


def test_at_most_max_workers_register():
    cluster = ClusterView(ClusterConfig(max_workers=3))
    for i in range(50):
        view, decisions, _ = cluster.on_report(report(f"w{i}", running=[f"r{i}"], instance=f"i{i}"), 0.0)
        assert (view is not None) == (i < 3) and not decisions
    assert sorted(cluster.workers) == ["w0", "w1", "w2"]
    assert sorted(cluster.placed) == ["r0", "r1", "r2"], "a refused worker's requests are not adopted"
    cluster.drop(cluster.workers["w0"], "gone")
    assert cluster.on_report(report("w9", instance="i9"), 1.0)[0] is not None, "a freed place is taken again"


def test_time_the_scheduler_did_not_listen_is_no_workers_silence():
    """The loop did not run for 4 s (a paused or starved process): what the worker sent meanwhile is still
    unread, so it is not dropped when the loop resumes; silence after that still counts from where it left."""
    cluster = ClusterView(ClusterConfig(worker_timeout_s=TIMEOUT_S, stale_after_s=0.5))
    cluster.on_report(report("w", instance="w1"), 0.0)
    cluster.on_report(report("gone", instance="g1"), 0.0)
    assert cluster.listening(0.2, stall_s=1.0) == 0.0  # a round
    assert cluster.listening(4.2, stall_s=1.0) == 4.0  # the next round: none ran from 0.2 to 4.2
    assert not cluster.silent(4.2) and set(cluster.workers) == {"w", "gone"}
    assert cluster.on_heartbeat(Heartbeat("w", "w1"), 4.25)  # read once the loop runs again
    gone = [d for d in cluster.silent(4.0 + TIMEOUT_S + 0.1) if isinstance(d, WorkerGone)]
    assert [d.worker_id for d in gone] == ["gone"], "a worker silent before and after the stall is still dropped"
