"""The adaptive policy's parts, each alone with a simulated clock, then composed in `SchedulerPolicy`.

Cost model (fit), multi-queue (short first, starvation bound), VTC (no starving, counter lift),
admission (early refusal), placement (affinity against load), migration, prefetch (target and
scores), and a small simulation of a flooding tenant against a calm one.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import replace

import grpc
import msgspec
import pytest
import zmq
from queued import queued
from scheduler_proc import SchedulerProcess
from scheduler_proc import report as proc_report

from loraserve.errors import DeadlineExceededError, InvalidConfigError, InvalidRequestError, ResourceExhaustedError
from loraserve.gateway.generation_request import grpc_fields, parse
from loraserve.gateway.validation import Limits, fairness_tenant
from loraserve.prefix_keys import PrefixProbe, chain_root
from loraserve.scheduler.admission import ClusterEstimate, check_admission
from loraserve.scheduler.cost_model import BatchShape, StepCost, StepCostModel
from loraserve.scheduler.fairness import TenantRates, VirtualTokenCounter, flooder_cap
from loraserve.scheduler.migration import RunningRequest, WaitingRequest, plan_migrations
from loraserve.scheduler.placement import Demand, Placement, WorkerLoad
from loraserve.scheduler.policy import (
    AssignTo,
    Migrate,
    PolicyConfig,
    PrefetchOn,
    SchedulerPolicy,
)
from loraserve.scheduler.popularity import AdapterPopularity, ReturningAdapters, plan_prefetch
from loraserve.scheduler.queues import MultiQueue, SizeClasses
from loraserve.sockets import make_socket, send
from loraserve.v1 import gateway_pb2
from loraserve.wire import WorkerReport


def request(rid, adapter=None, prompt=16, new=16, tenant="", slo=None, deadline=None, arrival=0.0, rank=0):
    return queued(
        rid, adapter, prompt, new, arrival=arrival, deadline=deadline, tenant=tenant, ttft_slo_s=slo, rank=rank
    )


def report(worker_id, running=(), waiting=(), free_pages=1000, max_batch=4, resident=(), finished=()):
    return WorkerReport(
        worker_id=worker_id,
        ready=True,
        max_batch_size=max_batch,
        total_pages=1000,
        free_pages=free_pages,
        kv_pages=1000 - free_pages,
        adapter_pages=0,
        running=list(running),
        waiting=list(waiting),
        resident=[list(k) for k in resident],
        finished=list(finished),
        tokens_per_page=16,
    )


def assigned(decisions):
    return [(d.worker_id, d.request.request_id) for d in decisions if isinstance(d, AssignTo)]


# ---- cost model -------------------------------------------------------------------------------
def test_the_cost_model_fit_recovers_known_coefficients():
    truth = StepCost(base_s=0.01, per_token_s=5e-4, per_rank_token_s=3e-6, per_adapter_s=4e-3, per_kv_page_s=1e-4)
    model = StepCostModel(StepCost(), forget=1.0)  # starts from other values
    rng = random.Random(0)
    for _ in range(400):
        shape = BatchShape(rng.randint(1, 512), rng.randint(0, 512 * 64), rng.randint(0, 8), rng.randint(0, 512))
        model.observe(shape, float(truth.base_s + BatchShape.features(shape)[1:] @ _coefs(truth)))
    fitted = model.coefficients
    for name in ("base_s", "per_token_s", "per_rank_token_s", "per_adapter_s", "per_kv_page_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def _coefs(cost: StepCost):
    return [cost.per_token_s, cost.per_rank_token_s, cost.per_adapter_s, cost.per_kv_page_s]


def test_the_cost_model_predicts_its_prior_before_any_measurement():
    model = StepCostModel(StepCost(base_s=0.02, per_token_s=1e-3, per_rank_token_s=0, per_adapter_s=0, per_kv_page_s=0))
    assert model.step_s(BatchShape(tokens=10)) == pytest.approx(0.03)


# ---- multi-queue and VTC ----------------------------------------------------------------------
def multiqueue(starvation_s=5.0):
    return MultiQueue(SizeClasses(bounds=(100.0, 1000.0)), starvation_s, VirtualTokenCounter())


def pop(queue, now):
    candidate = queue.next_candidate(now, set())
    queue.remove(candidate.request_id)
    queue.taken(candidate)
    return candidate.request_id


def push(queue, r, now):
    r.enqueued = now
    queue.push(r)


def test_short_requests_pass_long_ones_but_a_long_one_waits_at_most_the_starvation_bound():
    queue = multiqueue(starvation_s=5.0)
    push(queue, request("long", prompt=800, new=100), 0.0)
    for i in range(3):
        push(queue, request(f"short{i}", prompt=10, new=10), 0.1)
    assert [pop(queue, 1.0) for _ in range(2)] == ["short0", "short1"]
    push(queue, request("short3", prompt=10, new=10), 1.0)
    assert pop(queue, 5.0) == "long"  # waited 5 s: nothing overtakes it any more
    assert queue.next_candidate(5.0, {"short2"}) is queue.next_candidate(5.0, {"short2"})


def test_a_starved_request_that_cannot_be_placed_blocks_the_others():
    queue = multiqueue(starvation_s=1.0)
    push(queue, request("long", prompt=800, new=100), 0.0)
    push(queue, request("short", prompt=10, new=10), 0.5)
    assert queue.next_candidate(0.6, {"short"}).request_id == "long"  # before the bound: others may pass
    assert queue.next_candidate(2.0, {"long"}) is None  # after it: nobody overtakes the starved one


def test_vtc_a_flooding_tenant_does_not_starve_another():
    queue = multiqueue()
    for i in range(50):
        push(queue, request(f"flood{i}", tenant="flooder"), 0.0)
    served = [pop(queue, 0.1) for _ in range(5)]
    push(queue, request("calm", tenant="calm"), 0.2)
    assert pop(queue, 0.2) == "calm"  # next, ahead of the 45 flood requests queued before it
    assert served == [f"flood{i}" for i in range(5)]


def test_vtc_lifts_the_counter_of_a_tenant_that_was_idle():
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    vtc.activate("busy")
    vtc.charge("busy", 100, 50)  # 100 + 2·50
    assert vtc.counter("busy") == 200
    vtc.activate("idle")  # no credit for idling: lifted to the smallest backlogged counter
    assert vtc.counter("idle") == 200
    vtc.deactivate("busy")
    vtc.deactivate("idle")
    vtc.activate("late")  # nobody backlogged: lifted to the last one that left
    assert vtc.counter("late") == 200


def test_a_flooding_tenant_is_refused_when_the_queue_is_nearly_full_and_others_are_not():
    policy = SchedulerPolicy(PolicyConfig.of(max_queue_length=8))
    policy.on_report(report("w", max_batch=0), 0.0)  # nothing is placed: the queue fills
    policy.add(request("calm0", tenant="calm"), 0.0)
    for i in range(5):
        policy.add(request(f"flood{i}", tenant="flooder"), 0.0)
    with pytest.raises(ResourceExhaustedError, match="'flooder' holds 5"):
        policy.add(request("flood5", tenant="flooder"), 0.0)
    policy.add(request("calm1", tenant="calm"), 0.0)


def test_the_tenant_with_the_largest_backlog_is_held_to_a_share_of_the_slots():
    assert flooder_cap(Counter({"a": 3}), {"a": 10}, slots=8, share=0.5) is None  # alone: every slot
    assert flooder_cap(Counter({"a": 3, "b": 1}), {"a": 10}, slots=8, share=0.5) == ("a", 2)
    share = PolicyConfig().adaptive.flooder_slot_share
    assert flooder_cap(Counter({"a": 3, "b": 1}), {"a": 10}, slots=8, share=share) == (
        "a",
        1,
    )
    # tenants that send alike are not capped, whatever their backlogs; one sending twice the others' is
    rates = TenantRates(half_life_s=5.0)
    for t in range(100):
        for tenant in ("t0", "t1", "t2"):
            rates.arrived(tenant, t * 0.01)
        if t % 4 == 0:
            rates.arrived("light", t * 0.01)
    balanced = Counter({"t0": 50, "t1": 50, "t2": 50})
    assert flooder_cap(balanced, {"t0": 30, "t1": 3}, 512, 0.1, lambda t: rates.rate(t, 1.0)) is None
    for t in range(200):
        rates.arrived("t0", 1.0 + t * 0.005)  # t0 now sends 3 times as much
    assert flooder_cap(balanced, {"t0": 30, "t1": 3}, 512, 0.1, lambda t: rates.rate(t, 2.0)) == ("t0", 17)
    assert rates.rate("t1", 6.0) == pytest.approx(rates.rate("t1", 1.0) / 2, rel=1e-6)  # one half-life later
    policy = SchedulerPolicy(PolicyConfig.of(flooder_slot_share=0.5))
    policy.on_report(report("w", max_batch=8), 0.0)
    policy.add(request("calm0", tenant="calm", new=200), 0.0)
    for i in range(10):
        policy.add(request(f"flood{i}", tenant="flooder"), 0.0)
    placed = [rid for _, rid in assigned(policy.schedule(0.0))]
    assert placed == ["calm0", "flood0", "flood1"]  # 2 of 8 slots: the rest stay free for the calm one
    policy.add(request("calm1", tenant="calm"), 0.1)
    assert [rid for _, rid in assigned(policy.schedule(0.1))] == ["calm1"]  # at once, no slot to wait for


# ---- admission --------------------------------------------------------------------------------
def test_admission_refuses_what_cannot_meet_its_target_and_accepts_what_can():
    busy = ClusterEstimate(ahead=20, slots=4, free_slots=0, service_s=1.0, prefill_s=0.05)  # ~5.3 s
    with pytest.raises(ResourceExhaustedError, match="time-to-first-token target"):
        check_admission(busy, now=10.0, arrival=10.0, ttft_slo_s=2.0, deadline=None)
    with pytest.raises(DeadlineExceededError, match="after the deadline"):
        check_admission(busy, now=10.0, arrival=10.0, ttft_slo_s=None, deadline=12.0)
    check_admission(busy, now=10.0, arrival=10.0, ttft_slo_s=10.0, deadline=20.0)
    idle = ClusterEstimate(ahead=0, slots=4, free_slots=4, service_s=1.0, prefill_s=0.05)
    check_admission(idle, now=10.0, arrival=10.0, ttft_slo_s=0.1, deadline=10.2)


def test_the_policy_refuses_a_tight_slo_early_when_a_queue_exists():
    policy = SchedulerPolicy()
    policy.on_report(report("w", running=["x"], max_batch=1), 0.0)  # full: everything queues
    for i in range(10):
        policy.add(request(f"q{i}", new=200), 0.0)
    with pytest.raises(ResourceExhaustedError, match="refused early"):
        policy.add(request("tight", slo=0.05, arrival=0.0), 0.0)
    with pytest.raises(DeadlineExceededError, match="refused early"):
        policy.add(request("doomed", deadline=0.05), 0.0)
    assert policy.add(request("patient", slo=1000.0), 0.0) == 10
    assert "tight" not in policy.queue and "patient" in policy.queue


# ---- placement --------------------------------------------------------------------------------
def load(worker_id, requests=0, adapters=(), max_batch=8, room=1000):
    return WorkerLoad(
        worker_id,
        requests,
        0,
        max_batch,
        room,
        16,
        BatchShape(tokens=requests, rank_tokens=16 * requests, adapters=1 if requests else 0, kv_pages=4 * requests),
        frozenset(adapters),
        frozenset(),
    )


def test_placement_prefers_the_worker_holding_the_adapter_unless_its_load_costs_more():
    placement = Placement(StepCostModel(), adapter_load_s=0.2)
    demand = Demand(("a", 1), 16, 32, 32, 16.0)
    holder, other = load("holder", 1, adapters=[("a", 1)]), load("other", 0)
    assert placement.choose([holder, other], demand).worker_id == "holder"
    crowded = load("holder", 7, adapters=[("a", 1)])  # its batch is slower for everyone now
    assert placement.choose([crowded, other], demand).worker_id == "other"
    full = load("holder", 8, adapters=[("a", 1)])  # no batch room at all
    assert placement.choose([full, other], demand).worker_id == "other"


def test_placement_consolidates_when_costs_tie():
    flat = StepCostModel(StepCost(base_s=0.02, per_token_s=0, per_rank_token_s=0, per_adapter_s=0, per_kv_page_s=0))
    placement = Placement(flat)
    demand = Demand(None, 0, 16, 16, 8.0)
    assert placement.choose([load("idle", 0), load("busy", 3)], demand).worker_id == "busy"  # Punica


def _probe(prompt_len: int, salt: str = "t") -> PrefixProbe:
    return PrefixProbe(chain_root(salt, ""), list(range(3, 3 + prompt_len)))


def test_placement_prefers_the_worker_holding_the_prefix_unless_its_load_costs_more():
    """Prefix caching: the worker reporting the prompt's prefix cached skips that prefill, which the
    cost model weighs against its load (prefill is 2 ms a token here: 512 cached tokens save ~1 s)."""
    placement = Placement(StepCostModel(StepCost(per_token_s=2e-3)))
    probe = _probe(520)
    demand = Demand(None, 0, 520, 32, 16.0, probe)
    cached = frozenset(fp for _, fp in probe.fingerprints(16))
    assert demand.cached_tokens(replace(load("holder"), prefixes=cached)) == 512
    holder, other = replace(load("holder", 3), prefixes=cached), load("other", 1)
    assert placement.choose([holder, other], demand).worker_id == "holder"
    assert placement.choose([load("holder", 3), other], demand).worker_id == "other"  # the less loaded, without it
    crowded = replace(load("holder", 7), waiting=6, prefixes=cached)  # six prefills ahead of it there
    assert placement.choose([crowded, other], Demand(None, 0, 40, 32, 16.0, _probe(40))).worker_id == "other"
    # another salt (tenant) or a prompt that differs in its first page finds nothing there
    assert Demand(None, 0, 520, 32, 16.0, _probe(520, "u")).cached_tokens(holder) == 0
    shifted = PrefixProbe(chain_root("t", ""), [9, *range(4, 523)])
    assert Demand(None, 0, 520, 32, 16.0, shifted).cached_tokens(holder) == 0


def test_a_probe_counts_the_longest_checkpoint_cached_and_never_the_last_token():
    probe = _probe(8 * 16 + 1)  # 8 whole pages before the last token
    lengths = [n for n, _ in probe.fingerprints(16)]
    assert lengths == [128, 96, 64, 48, 32, 16]  # checkpoints 8, 6, 4, 3, 2, 1 pages
    assert [n for n, _ in _probe(8 * 16).fingerprints(16)] == [96, 64, 48, 32, 16]  # 7 usable: 6 is the longest
    by_length = dict(probe.fingerprints(16))
    assert probe.cached_tokens(16, {by_length[48], by_length[16]}) == 48
    assert probe.cached_tokens(16, set()) == 0 and _probe(16).fingerprints(16) == ()


def test_the_policy_keeps_a_prefix_on_the_worker_that_caches_it_and_its_burst_together():
    policy = SchedulerPolicy(PolicyConfig.of(max_queue_length=64))
    probe = _probe(520)
    cached = b"".join(fp for _, fp in probe.fingerprints(16))
    for worker, prefixes in (("w0", cached), ("w1", b"")):
        policy.on_report(msgspec.structs.replace(report(worker, max_batch=8), cached_prefixes=prefixes), 0.0)
    for i in range(3):
        policy.add(replace(request(f"r{i}", prompt=520, new=8), prefix=probe), 0.0)
    assert assigned(policy.schedule(0.0)) == [("w0", "r0"), ("w0", "r1"), ("w0", "r2")]
    # a new prefix goes where placement puts it; the requests placed right after it follow it there
    # before that worker reports the prefix cached
    fresh = _probe(520, "other-tenant")
    policy.add(replace(request("n0", prompt=520, new=8), prefix=fresh), 0.1)
    (first,) = assigned(policy.schedule(0.1))
    policy.add(replace(request("n1", prompt=520, new=8), prefix=fresh), 0.2)
    assert assigned(policy.schedule(0.2)) == [(first[0], "n1")]


# ---- migration --------------------------------------------------------------------------------
def test_migration_plans_a_waiting_request_off_an_overloaded_worker():
    placement = Placement(StepCostModel())
    over = WorkerLoad("over", 8, 3, 8, 0, 16, BatchShape(8, 128, 1, 40), frozenset(), frozenset())
    idle = load("idle", 0)
    waiting = [WaitingRequest("over", "r", Demand(None, 0, 16, 16, 8.0), waiting_since=0.0)]
    assert plan_migrations([over, idle], waiting, now=0.5, after_s=1.0, placement=placement) == []
    [move] = plan_migrations([over, idle], waiting, now=2.0, after_s=1.0, placement=placement)
    assert (move.request_id, move.source, move.target) == ("r", "over", "idle")


def test_a_young_running_request_moves_by_recompute_only_when_a_stuck_waiter_cannot():
    placement = Placement(StepCostModel())
    # `over` runs two requests; a big one waits for its pool room and fits no other worker's pool
    over = WorkerLoad("over", 3, 1, 8, 0, 16, BatchShape(2, 32, 1, 10), frozenset(), frozenset())
    idle = WorkerLoad("idle", 0, 0, 8, 40, 16, BatchShape(), frozenset(), frozenset())
    big = [WaitingRequest("over", "big", Demand(None, 0, 900, 100, 50.0), waiting_since=0.0)]
    young = RunningRequest("over", "young", Demand(None, 0, 30, 30, 15.0), recompute_tokens=40)
    old = RunningRequest("over", "old", Demand(None, 0, 30, 600, 300.0), recompute_tokens=400)
    plan = lambda waiting, running, now=2.0: plan_migrations(  # noqa: E731
        [over, idle], waiting, now, 1.0, placement, running, max_recompute_tokens=256
    )
    [move] = plan(big, [old, young])  # the youngest, within the recompute bound; one per worker and round
    assert (move.request_id, move.source, move.target) == ("young", "over", "idle")
    assert plan(big, [old]) == []  # too much to recompute
    assert plan(big, [young], now=0.5) == []  # nobody has waited long enough
    assert plan([], [young]) == []  # nothing waits there: the running request stays
    busy = replace(idle, requests=1)
    assert plan_migrations([over, busy], big, 2.0, 1.0, placement, [young]) == []  # no idle worker


def test_the_policy_migrates_a_request_stuck_on_its_worker():
    policy = SchedulerPolicy(PolicyConfig.of(migrate_after_s=1.0, worker_timeout_s=100.0, stale_after_s=100.0))
    policy.on_report(report("a", max_batch=4), 0.0)
    for rid in ("r0", "r1", "r2"):
        policy.add(request(rid), 0.0)
    placed = assigned(policy.schedule(0.0))
    assert len(placed) == 3
    by_worker = {}
    for w, rid in placed:
        by_worker.setdefault(w, []).append(rid)
    [(worker, rids)] = by_worker.items()
    # the worker runs one and cannot start the others (no KV room); a new idle worker joins
    policy.on_report(report(worker, running=rids[:1], waiting=rids[1:], free_pages=0), 0.5)
    policy.on_report(report("b", max_batch=4), 0.5)
    assert not [d for d in policy.schedule(0.6) if isinstance(d, Migrate)]  # not waiting long enough
    policy.on_report(report(worker, running=rids[:1], waiting=rids[1:], free_pages=0), 1.5)
    policy.on_report(report("b", max_batch=4), 1.5)
    [move] = [d for d in policy.schedule(1.5) if isinstance(d, Migrate)]
    assert move.worker_id == worker and move.request.request_id == rids[1] and "migrated" in move.reason
    assert rids[1] not in policy.placed and rids[1] not in policy.workers[worker].assigned


# ---- prefetch ---------------------------------------------------------------------------------
def test_popularity_is_an_ewma_of_arrival_rates():
    popularity = AdapterPopularity(half_life_s=10.0)
    for t in range(100):
        popularity.arrived(("hot", 1), t * 0.1)  # 10 per second
    popularity.arrived(("cold", 1), 9.9)
    hot, cold = popularity.rate(("hot", 1), 10.0), popularity.rate(("cold", 1), 10.0)
    assert 3.0 < hot < 10.0 and cold < 0.1
    assert popularity.rate(("hot", 1), 20.0) == pytest.approx(hot / 2, rel=1e-6)  # one half-life later
    assert [k for k, _ in popularity.most_popular(10.0, 2)] == [("hot", 1), ("cold", 1)]
    assert popularity.likelihood(("hot", 1), 10.0, 1.0) > 0.9 > popularity.likelihood(("cold", 1), 10.0, 1.0)


def test_popularity_forgets_the_least_popular_half_and_ranks_without_recomputing_rates():
    popularity = AdapterPopularity(half_life_s=10.0, max_adapters=4, refresh_s=1.0)
    for i in range(12):
        for _ in range(12 - i):  # adapter i arrives 12 - i times: 0 the most popular
            popularity.arrived((f"a{i}", 1), 0.0)
    assert len(popularity._keys) <= 8 and popularity.rate(("a0", 1), 0.0) > popularity.rate(("a3", 1), 0.0) > 0
    assert [k for k, _ in popularity.most_popular(0.0, 2)] == [("a0", 1), ("a1", 1)]
    popularity.arrived(("new", 1), 0.5)
    for _ in range(50):
        popularity.arrived(("new", 1), 0.5)
    assert [k for k, _ in popularity.most_popular(0.5, 2)] == [("a0", 1), ("a1", 1)]  # the ranking is 0.5 s old
    assert next(k for k, _ in popularity.most_popular(1.5, 2)) == ("new", 1)  # refreshed after refresh_s


def test_an_adapter_whose_requests_come_back_is_learnt_apart_from_one_whose_do_not():
    returns = ReturningAdapters(window_s=5.0, prior=2.0)
    chat, tail = ("chat", 1), ("tail", 1)
    for turn in range(4):
        t = 10.0 * turn
        returns.ended(chat, 16, t)
        returns.arrived(chat, t + 2.0)  # the next turn, 2 s later
        returns.ended(tail, 8, t)  # nobody asks for it again
    returns.expire(100.0)
    assert returns.probability(chat) > 0.8 and returns.probability(tail) < 0.3
    assert 0.4 < returns.p_all() < 0.6  # and an adapter never seen gets the average
    returns.ended(tail, 8, 100.0)
    returns.ended(chat, 16, 100.5)
    assert [(a, rank) for a, _, rank in returns.candidates(101.0, 0.2, limit=8)] == [(chat, 16)]  # tail: unlikely
    assert [a for a, _, _ in returns.candidates(101.0, 0.0, limit=8)] == [chat, tail]  # the likeliest first
    assert [a for a, _, _ in returns.candidates(101.0, 0.0, limit=1)] == [chat]  # the most recently ended
    returns.arrived(chat, 102.0)  # the next turn came: no longer pending
    assert [a for a, _, _ in returns.candidates(102.0, 0.0, limit=8)] == [tail]
    assert returns.candidates(106.0, 0.0, limit=8) == []  # past the window: it did not return


def test_the_policy_fetches_an_evicted_conversation_adapter_again_before_the_next_turn():
    policy = SchedulerPolicy()
    chat = ("chat", 1)
    policy.on_report(report("w", resident=[chat]), 0.0)
    policy.on_report(report("v"), 0.0)
    now = 0.0
    for turn in range(4):  # turns end on w and come back 2 s later: the policy learns it
        policy.add(request(f"turn{turn}", adapter=chat), now)
        (placed,) = assigned(policy.schedule(now))
        assert placed == ("w", f"turn{turn}")  # affinity: where the adapter is
        now += 0.5
        policy.on_report(report("w", resident=[chat], finished=[f"turn{turn}"]), now)
        for _ in range(4):  # the user thinks; the workers report
            now += 0.5
            policy.on_report(report("w", resident=[chat]), now)
            policy.on_report(report("v"), now)
    policy.on_report(report("w", resident=[("other", 1)]), now)  # w evicted it while the user thinks
    policy.on_report(report("v"), now)
    hints = [d for d in policy.schedule(now) if isinstance(d, PrefetchOn)]
    assert [(d.worker_id, d.adapters) for d in hints] == [("w", (chat,))] and hints[0].scores[0] >= 0.5
    policy.on_report(report("w", resident=[("other", 1), chat]), now + 0.1)  # back in w's pool
    assert not [d for d in policy.schedule(now + 0.1) if isinstance(d, PrefetchOn)]


def test_the_prefetch_planner_sends_to_the_chosen_worker_only_with_scores():
    plan = plan_prefetch(
        queued=[(("a", 1), "w1"), (("b", 1), "w2"), (("c", 1), "w1")],
        popular=[(("p", 1), 0.8, ["w2"]), (("rare", 1), 0.05, ["w2"]), (("held", 1), 0.9, ["w1"])],
        holds=lambda w, a: (w, a) in {("w1", ("c", 1)), ("w1", ("held", 1))},
    )
    assert plan.for_worker("w1") == ((("a", 1),), (1.0,))
    adapters, scores = plan.for_worker("w2")
    assert adapters == (("b", 1), ("p", 1)) and scores[1] == 0.8 and 0.5 <= scores[0] < 1.0
    assert plan.for_worker("w3") == ((), ())


def test_the_policy_prefetches_to_the_worker_that_will_serve_and_not_to_others():
    policy = SchedulerPolicy()
    policy.on_report(report("holder", max_batch=0, resident=[("x", 1)]), 0.0)
    policy.on_report(report("other", max_batch=0), 0.0)
    policy.add(request("a", adapter=("y", 2)), 0.0)
    hints = [d for d in policy.schedule(0.0) if isinstance(d, PrefetchOn)]
    assert len(hints) == 1 and hints[0].adapters == (("y", 2),) and hints[0].scores[0] == 1.0
    assert not [d for d in policy.schedule(0.1) if isinstance(d, PrefetchOn)], "unchanged hints are not resent"


def test_a_request_whose_adapter_is_cold_waits_briefly_for_its_prefetch():
    policy = SchedulerPolicy(PolicyConfig.of(prefetch_hold_s=0.1))
    policy.on_report(report("w"), 0.0)
    policy.add(request("first", adapter=("idle", 1)), 0.0)
    assert assigned(policy.schedule(0.0)) == [("w", "first")]  # an idle worker: nobody waits for its copy
    policy.add(request("a", adapter=("cold", 1)), 0.0)
    decisions = policy.schedule(0.0)
    assert not assigned(decisions) and [d.adapters for d in decisions if isinstance(d, PrefetchOn)] == [(("cold", 1),)]
    policy.on_report(report("w", resident=[("cold", 1)]), 0.03)  # prefetched: now it goes
    assert assigned(policy.schedule(0.03)) == [("w", "a")]
    policy.add(request("b", adapter=("other", 1)), 0.05)
    assert not assigned(policy.schedule(0.05))
    assert assigned(policy.schedule(0.16)) == [("w", "b")]  # the hold is bounded: it goes anyway
    policy.add(request("c", adapter=("third", 1), slo=0.06, arrival=0.2), 0.2)
    assert not assigned(policy.schedule(0.21))
    assert assigned(policy.schedule(0.231)) == [("w", "c")]  # held at most half of its TTFT target


# ---- configuration ----------------------------------------------------------------------------
def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(InvalidConfigError, match=r"unknown scheduling policy .sjf.*adaptive, fcfs"):
        PolicyConfig(policy="sjf")
    assert PolicyConfig().policy == "adaptive"


# ---- a flood, simulated -----------------------------------------------------------------------
def simulate(policy_name: str, flood: bool, seconds: float = 30.0, service_s: float = 1.0) -> list[float]:
    """One worker with 4 slots; each request holds a slot `service_s`. A calm tenant sends one
    request per second; with `flood`, another sends 10 per second. Returns the calm tenant's waits."""
    policy = SchedulerPolicy(PolicyConfig.of(policy_name, max_queue_length=10_000, worker_timeout_s=1e9))
    running: dict[str, float] = {}  # request id -> finishes at
    waits, arrivals = [], {}
    dt, now, n = 0.05, 0.0, 0
    while now < seconds:
        finished = [r for r, end in running.items() if end <= now]
        for r in finished:
            del running[r]
        policy.on_report(report("w", running=list(running), finished=finished, max_batch=4), now)
        if round(now / dt) % 20 == 0:
            policy.add(request(f"calm{n}", tenant="calm"), now)
            arrivals[f"calm{n}"] = now
            n += 1
        if flood and round(now / dt) % 2 == 0:
            policy.add(request(f"flood{n}", tenant="flood"), now)
            n += 1
        for _, rid in assigned(policy.schedule(now)):
            running[rid] = now + service_s
            if rid in arrivals:
                waits.append(now - arrivals.pop(rid))
        now += dt
    return sorted(waits)


def test_a_flooding_tenant_barely_raises_the_calm_tenants_waits_under_adaptive():
    calm = simulate("adaptive", flood=False)
    flooded = simulate("adaptive", flood=True)
    p99 = lambda waits: waits[int(0.99 * (len(waits) - 1))]  # noqa: E731
    assert p99(flooded) <= max(1.5 * p99(calm), 0.3)  # at most one slot's turnover (service_s / 4) more
    assert p99(simulate("fcfs", flood=True)) > 5.0  # the baseline: behind the whole flood


# ---- through a real scheduler process ---------------------------------------------------------
def test_a_real_scheduler_refuses_a_tight_ttft_target_at_once_when_a_queue_exists():
    scheduler = SchedulerProcess(worker_timeout=5.0)
    ctx = zmq.Context()
    worker = make_socket(ctx, zmq.DEALER, connect=scheduler.worker_address, identity="busy")
    stop = threading.Event()

    def heartbeat() -> None:  # one slot, taken: everything submitted queues
        while not stop.is_set():
            send(worker, proc_report("busy", max_batch_size=1, running=["someone"]))
            stop.wait(0.1)

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        scheduler.wait_serving()
        scheduler.wait_worker("busy")
        sink = "tcp://127.0.0.1:9"
        for i in range(10):
            scheduler.submit(f"q{i}", sink, tenant="alice")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            scheduler.submit("tight", sink, tenant="alice", ttft_slo_s=0.01)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "refused early" in refused.value.details() and time.monotonic() - started < 2.0
        assert scheduler.submit("patient", sink, tenant="bob", ttft_slo_s=3600).queue_position >= 1
        with pytest.raises(grpc.RpcError) as invalid:
            scheduler.submit("bad", sink, tenant="no spaces/allowed")
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in invalid.value.details()
    finally:
        stop.set()
        thread.join(5)
        worker.close(linger=0)
        ctx.term()
        scheduler.stop()


# ---- the gateway's side: whose request, and its target ----------------------------------------
def test_the_gateway_names_the_tenant_for_fairness_and_checks_the_ttft_target():
    assert fairness_tenant("acme", open_access=False, metadata={"x-loraserve-client": "spoof"}) == "acme"
    assert fairness_tenant("default", open_access=True, metadata={}) == "default"
    assert fairness_tenant("default", open_access=True, metadata={"x-loraserve-client": "team-a"}) == "team-a"
    with pytest.raises(InvalidRequestError, match="x-loraserve-client"):
        fairness_tenant("default", open_access=True, metadata={"x-loraserve-client": "a/b"})
    limits = Limits(vocab_size=100, max_context=512)
    valid = parse(grpc_fields(gateway_pb2.GenerateRequest(text="hi", ttft_slo_s=0.5)), limits)
    assert valid.ttft_slo_s == 0.5
    with pytest.raises(InvalidRequestError, match="ttft_slo_s"):
        parse(grpc_fields(gateway_pb2.GenerateRequest(text="hi", ttft_slo_s=-1.0)), limits)


def test_the_policy_moves_a_young_running_request_when_its_worker_is_stuck():
    """Through the policy: worker a runs `young` and holds `big`, which waits for pool room and fits
    no pool of worker b; b is idle. `young` moves (its gateway resubmits it, b recomputes it)."""
    policy = SchedulerPolicy(PolicyConfig.of(migrate_after_s=1.0, worker_timeout_s=100.0, stale_after_s=100.0))
    policy.on_report(report("a", max_batch=4), 0.0)
    policy.add(request("young", prompt=30, new=30), 0.0)
    policy.add(request("big", prompt=900, new=100), 0.0)
    assert sorted(assigned(policy.schedule(0.0))) == [("a", "big"), ("a", "young")]
    moves = {}
    for now in (0.5, 1.5):
        policy.on_report(report("a", running=["young"], waiting=["big"], free_pages=0), now)
        policy.on_report(report("b", max_batch=4, free_pages=40), now)  # 40 pages: big (63) does not fit
        moves[now] = [d for d in policy.schedule(now) if isinstance(d, Migrate)]
    assert moves[0.5] == []  # big has not waited long enough
    [move] = moves[1.5]
    assert (move.worker_id, move.request.request_id) == ("a", "young") and "migrated" in move.reason
