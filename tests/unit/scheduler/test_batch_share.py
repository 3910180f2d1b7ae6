"""Batch shares (`scheduler/batch_share.py`) in the policy object, alone: one client request holds at most
`request_batch_share` of a worker's slots (the rest stays queued and follows as its generations end),
and, under the adaptive policy, a tenant at most `tenant_batch_share` of them while another tenant has
requests queued, never while it is alone."""

from __future__ import annotations

import pytest
from queued import queued

from loraserve.errors import InvalidConfigError
from loraserve.scheduler.policy import AssignTo, PolicyConfig, QueuedRequest, SchedulerPolicy
from loraserve.wire import WorkerReport


@pytest.fixture(params=["fcfs", "adaptive"])
def kind(request):
    return request.param


def report(worker_id: str, max_batch: int, running=(), finished=()) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        ready=True,
        max_batch_size=max_batch,
        total_pages=100_000,
        free_pages=100_000,
        kv_pages=0,
        adapter_pages=0,
        running=list(running),
        waiting=[],
        resident=[],
        finished=list(finished),
        tokens_per_page=16,
    )


def generation(rid: str, tenant: str, key: str = "", group: str | None = None) -> QueuedRequest:
    keyed = {"request_key": key} if key else {}  # "": a request of its own
    return queued(rid, None, 8, 16, tenant=tenant, group=group, **keyed)


def placed(decisions) -> list[tuple[str, str]]:
    return [(d.worker_id, d.request.request_id) for d in decisions if isinstance(d, AssignTo)]


def test_the_shares_and_their_bounds():
    from loraserve.scheduler.batch_share import BatchShareConfig, slots_of

    config = BatchShareConfig()
    assert (config.request_batch_share, config.tenant_batch_share) == (0.25, 0.5)
    assert slots_of(0.25, 64) == 16 and slots_of(0.25, 3) == 1 and slots_of(0.5, 1) == 1  # at least one slot
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidConfigError, match="request_batch_share must be in"):
            BatchShareConfig(request_batch_share=bad)
    assert PolicyConfig.of("fcfs", request_batch_share=0.5).share.request_batch_share == 0.5


def test_one_request_of_64_generations_takes_a_quarter_of_the_batch_and_another_tenant_goes_at_once(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1e9))
    policy.on_report(report("w", max_batch=64), 0.0)
    for i in range(64):  # one HTTP body: a prompt × n=64, one prefill group, one client request
        policy.add(generation(f"a{i}", "a", key="a/cmpl-1", group="a/cmpl-1-0"), 0.0)
    first = placed(policy.schedule(0.0))
    assert len(first) == 16 and {w for w, _ in first} == {"w"}
    policy.add(generation("b0", "b"), 0.01)  # another tenant's short request: a free slot is there
    assert placed(policy.schedule(0.01)) == [("w", "b0")]
    assert len(policy.queue) == 48  # the excess waits in the queue, not on the worker
    running = [r for _, r in first]
    policy.on_report(report("w", max_batch=64, running=running[4:], finished=[*running[:4], "b0"]), 0.1)
    assert len(placed(policy.schedule(0.1))) == 4  # as its generations end, the next ones follow


def test_a_request_held_by_its_share_neither_blocks_the_round_nor_idles_other_workers(kind):
    policy = SchedulerPolicy(PolicyConfig.of(kind, worker_timeout_s=1e9))
    for w in ("w1", "w2", "w3", "w4"):
        policy.on_report(report(w, max_batch=8), 0.0)
    for i in range(12):
        policy.add(generation(f"a{i}", "a", key="a/cmpl-1", group="a/cmpl-1-0"), 0.0)
    policy.add(generation("c0", "a"), 0.0)  # the same tenant's next request, queued behind them (FCFS too)
    decisions = placed(policy.schedule(0.0))
    per_worker = {w: sum(1 for x, r in decisions if x == w and r.startswith("a")) for w in ("w1", "w2", "w3", "w4")}
    assert sorted(per_worker.values()) == [2, 2, 2, 2]  # 2 of 8 slots each: the group spreads past its share
    assert ("c0" in {r for _, r in decisions}) and len(policy.queue) == 4


def test_a_tenant_is_held_to_its_share_while_another_waits_and_fills_the_batch_alone():
    policy = SchedulerPolicy(PolicyConfig.of("adaptive", worker_timeout_s=1e9))
    policy.on_report(report("w", max_batch=12), 0.0)
    for i in range(6):
        policy.add(generation(f"a{i}", "a"), 0.0)
    assert len(placed(policy.schedule(0.0))) == 6  # alone: no tenant share
    now = 20.0  # arrival rates have decayed: neither tenant floods the other (that is the flooder cap's case)
    policy.on_report(report("w", max_batch=12, running=[f"a{i}" for i in range(6)]), now)
    for i in range(6, 9):
        policy.add(generation(f"a{i}", "a"), now)
    for i in range(4):
        policy.add(generation(f"b{i}", "b"), now)
    assert {r for _, r in placed(policy.schedule(now))} == {"b0", "b1", "b2", "b3"}  # a holds 6 of 12 while b waits
    assert {r for _, r in placed(policy.schedule(now + 0.1))} == {"a6", "a7"}  # b has nothing queued: a fills up

    alone = SchedulerPolicy(PolicyConfig.of("adaptive", worker_timeout_s=1e9))
    alone.on_report(report("w", max_batch=8), 0.0)
    for i in range(10):
        alone.add(generation(f"a{i}", "a"), 0.0)
    assert len(placed(alone.schedule(0.0))) == 8  # a single tenant: every slot is used

    fcfs = SchedulerPolicy(PolicyConfig.of("fcfs", worker_timeout_s=1e9))  # the baseline: no fairness, no share
    fcfs.on_report(report("w", max_batch=8), 0.0)
    for i in range(8):
        fcfs.add(generation(f"a{i}", "a"), 0.0)
    fcfs.add(generation("b0", "b"), 0.0)
    assert [r for _, r in placed(fcfs.schedule(0.0))] == [f"a{i}" for i in range(8)]


def test_holdings_follow_requests_that_end_fail_over_or_move():
    policy = SchedulerPolicy(PolicyConfig.of("fcfs", worker_timeout_s=1.0, request_batch_share=0.5))
    policy.on_report(report("w1", max_batch=4), 0.0)
    for i in range(4):
        policy.add(generation(f"a{i}", "a", key="k"), 0.0)
    assert [r for _, r in placed(policy.schedule(0.0))] == ["a0", "a1"]
    holdings = policy.cluster.holdings
    assert holdings.by_request == {"k": {"w1": 2}} and holdings.by_tenant == {"a": {"w1": 2}}
    policy.on_report(report("w1", max_batch=4, running=["a1"], finished=["a0"]), 0.1)
    assert [r for _, r in placed(policy.schedule(0.1))] == ["a2"]
    policy.schedule(5.0)  # w1 stopped reporting: dropped, what it held fails over
    assert holdings.by_request == {} and holdings.by_tenant == {}
