"""The policy's parts alone: the configs, the cluster view's incremental counts, the load index, and the
FCFS strategy's prediction. What the composed policy does is tested in test_scheduler_policy.py and
test_scheduling_policies.py, under both strategies."""

from __future__ import annotations

import random
from dataclasses import fields, is_dataclass, replace
from typing import get_type_hints

import msgspec
import pytest
from test_scheduler_policy import report, request
from test_scheduling_policies import load

from loraserve.errors import InvalidConfigError
from loraserve.scheduler.adaptive.strategy import AdaptiveStrategy
from loraserve.scheduler.cluster import ClusterView, kv_pages
from loraserve.scheduler.config import AdaptiveConfig, ClusterConfig, FcfsConfig, PolicyConfig, SchedulerConfig
from loraserve.scheduler.cost_model import StepCostModel
from loraserve.scheduler.fcfs import FcfsStrategy
from loraserve.scheduler.load_index import LoadIndex
from loraserve.scheduler.placement import Demand, Placement
from loraserve.scheduler.policy import PrefetchOn, SchedulerPolicy


# ---- configuration ----------------------------------------------------------------------------
def test_every_setting_has_help_and_one_default():
    def check(config: type) -> None:  # a nested settings dataclass (size classes, step costs): each of its fields
        hints = get_type_hints(config)
        for f in fields(config):
            if is_dataclass(hints[f.name]):
                check(hints[f.name])
            else:
                assert f.metadata.get("help"), f"{config.__name__}.{f.name} has no help"

    for config in (ClusterConfig, FcfsConfig, AdaptiveConfig, PolicyConfig, SchedulerConfig):
        check(config)
    # adaptive shares fcfs's settings (the same fields, so the same defaults), and adds its own
    shared = {f.name: f for f in fields(FcfsConfig)}
    assert all(f is shared[f.name] for f in fields(AdaptiveConfig) if f.name in shared)
    cluster, adaptive = ClusterConfig(), AdaptiveConfig()
    liveness = (cluster.worker_timeout_s, cluster.stale_after_s, cluster.max_zombies, cluster.max_workers)
    assert liveness == (5.0, 0.75, 1024, 1024)
    assert (adaptive.max_queue_length, adaptive.prefetch_depth, adaptive.starvation_s) == (1024, 16, 5.0)
    assert (adaptive.flooder_slot_share, adaptive.prefetch_hold_s, adaptive.predict_interval_s) == (0.1, 0.0, 0.02)


def test_settings_by_name_go_to_the_part_that_has_them():
    config = PolicyConfig.of("fcfs", max_queue_length=8, worker_timeout_s=3.0, migrate_after_s=0.0)
    assert config.policy == "fcfs" and config.cluster.worker_timeout_s == 3.0
    assert config.fcfs.max_queue_length == config.adaptive.max_queue_length == 8  # shared: both
    assert config.adaptive.migrate_after_s == 0.0
    with pytest.raises(InvalidConfigError, match="unknown scheduler policy settings: bogus"):
        PolicyConfig.of(bogus=1)
    with pytest.raises(InvalidConfigError):
        PolicyConfig.of(flood_share=2.0)
    assert type(SchedulerPolicy(PolicyConfig.of("fcfs")).strategy) is FcfsStrategy
    assert type(SchedulerPolicy().strategy) is AdaptiveStrategy


# ---- the cluster view -------------------------------------------------------------------------
def _recount(cluster: ClusterView, worker_id: str) -> tuple[int, int]:
    """A worker's held requests and reserved pages, from scratch."""
    view = cluster.workers[worker_id]
    unreported = [r for r in view.assigned if r not in view.reported]
    pages = sum(kv_pages(cluster.placed[r][1], 16) for r in unreported if cluster.placed[r][1] is not None)
    return len(view.reported) + len(unreported), pages


def test_the_cluster_view_keeps_counts_true_as_requests_come_and_go():
    rng = random.Random(7)
    cluster = ClusterView(ClusterConfig(worker_timeout_s=100.0, stale_after_s=100.0))
    workers = {w: [] for w in ("a", "b")}  # what each worker reports running
    for w in workers:
        cluster.on_report(report(w, max_batch=64), 0.0)
    for step in range(300):
        now = step * 0.01
        w = rng.choice(sorted(workers))
        action = rng.random()
        if action < 0.5:  # an assignment
            cluster.place(cluster.workers[w], request(f"r{step}", prompt=rng.randint(1, 64)), now)
        elif action < 0.8:  # a report: some assignments show up, some finish
            view = cluster.workers[w]
            running = [r for r in view.assigned if rng.random() < 0.7]
            finished = [r for r in workers[w] if r not in running and rng.random() < 0.5]
            workers[w] = [r for r in running if r not in finished]
            cluster.on_report(report(w, running=workers[w], finished=finished, max_batch=64), now)
        elif cluster.workers[w].assigned:  # one ends outside the policy
            cluster.unplace(rng.choice(sorted(cluster.workers[w].assigned)))
        for worker_id, view in cluster.workers.items():
            assert (view.held, view.reserved_pages) == _recount(cluster, worker_id)
    assert sum(cluster.in_flight.values()) == sum(1 for _, r in cluster.placed.values() if r is not None)


def test_a_report_without_resident_adapters_keeps_the_last_set_it_named():
    cluster = ClusterView()
    cluster.on_report(report("w", resident=[("a", 1), ("b", 1)]), 0.0)
    unchanged = msgspec.structs.replace(report("w"), resident=None)
    cluster.on_report(unchanged, 0.1)
    assert cluster.workers["w"].resident == {("a", 1), ("b", 1)}
    cluster.on_report(report("w", resident=[("b", 1)]), 0.2)
    assert cluster.workers["w"].resident == {("b", 1)}
    empty = report("w", resident=[])  # an empty list says none; None says "as before"
    cluster.on_report(empty, 0.3)
    assert cluster.workers["w"].resident == frozenset()


def test_the_fresh_list_follows_reports_and_time_without_a_pass_per_question():
    cluster = ClusterView(ClusterConfig(worker_timeout_s=1.0, stale_after_s=0.5))
    cluster.on_report(report("a"), 0.0)
    cluster.on_report(report("b"), 0.0)
    first = cluster.fresh(0.1)
    assert [w.worker_id for w in first] == ["a", "b"] and cluster.fresh(0.2) is first  # the same list
    cluster.on_report(report("a"), 0.4)
    assert [w.worker_id for w in cluster.fresh(0.6)] == ["a"]  # b is stale: nothing new goes there
    cluster.on_report(report("b"), 0.7)
    assert [w.worker_id for w in cluster.fresh(0.7)] == ["a", "b"] and cluster.slots(0.7) == 8
    assert [d.worker_id for d in cluster.silent(1.5)] == ["a"] and list(cluster.workers) == ["b"]
    assert cluster.fits_ever(request("r", prompt=1000, new=600))  # 100 pages of 16 tokens
    assert not cluster.fits_ever(request("r", prompt=1001, new=600))


# ---- the load index ---------------------------------------------------------------------------
def test_the_load_index_keeps_its_order_and_holders_true_and_prunes_like_placement():
    rng = random.Random(3)
    adapters = [(f"a{i}", 1) for i in range(20)]

    def random_load(i: int):
        resident = rng.sample(adapters, 4)
        return load(f"w{i:02d}", rng.randint(0, 8), resident, max_batch=8, room=rng.randint(0, 50))

    loads = [random_load(i) for i in range(40)]
    index = LoadIndex(list(loads))
    for _ in range(200):
        i = rng.randrange(len(loads))
        loads[i] = random_load(i)
        index.set(i, loads[i])
    assert index._order == sorted((w.requests, w.worker_id) for w in loads)
    for adapter in adapters:
        assert index._holders.get(adapter, set()) == {w.worker_id for w in loads if adapter in w.adapters}
    placement = Placement(StepCostModel(), adapter_load_s=0.2)
    for adapter in adapters[:5]:
        d = Demand(adapter, 16, 32, 32, 16.0)
        chosen = index.choose(placement, d)
        fitting = [w for w in loads if placement.fits(w, d)]
        assert chosen is not None and placement.fits(chosen, d)
        best = min(placement.cost_on(w, d) for w in fitting)  # pruning keeps the winner within the tie
        assert placement.cost_on(chosen, d) <= best * (1 + placement.tie) + 1e-9 or adapter in chosen.adapters
    small = LoadIndex(loads[:10])  # a small cluster: every worker is costed, as placement does
    d = Demand(adapters[0], 16, 32, 32, 16.0)
    assert small.choose(placement, d) == placement.choose(loads[:10], d)


# ---- the strategies ---------------------------------------------------------------------------
def test_fcfs_prediction_looks_again_only_at_workers_that_changed():
    cluster = ClusterView(ClusterConfig(worker_timeout_s=100.0, stale_after_s=100.0))
    strategy = FcfsStrategy(FcfsConfig(), cluster)
    cluster.on_change = strategy.worker_changed
    cluster.on_report(report("a", max_batch=0), 0.0)
    cluster.on_report(report("b", max_batch=0, resident=[("x", 1)]), 0.0)
    strategy.admit(request("r", adapter=("x", 1)), 0.0)
    assert [(d.worker_id, d.adapters) for d in strategy.plan(0.0, False)] == [("a", (("x", 1),))]
    assert strategy.plan(0.1, False) == []  # nothing changed
    cluster.on_report(report("b", max_batch=0), 0.2)  # b evicted it
    hints = strategy.plan(0.2, False)
    assert [(d.worker_id, d.adapters) for d in hints] == [("b", (("x", 1),))] and isinstance(hints[0], PrefetchOn)


def test_adaptive_placement_views_stay_true_as_requests_are_assigned():
    """The views kept in place (assignments between reports) equal views made from scratch."""
    policy = SchedulerPolicy(PolicyConfig.of(worker_timeout_s=100.0, stale_after_s=100.0))
    for w in ("a", "b", "c"):
        policy.on_report(report(w, max_batch=8), 0.0)
    for i in range(12):
        policy.add(request(f"r{i}", adapter=(f"x{i % 3}", 1), prompt=16 + i), 0.0)
    policy.schedule(0.0)
    strategy = policy.strategy
    assert isinstance(strategy, AdaptiveStrategy)
    for view in policy.cluster.fresh(0.0):
        kept = strategy.load_of(view, 0.0)
        made = strategy._make(view, 0.0)
        assert replace(kept, adapters=frozenset(kept.adapters), prefixes=frozenset()) == replace(
            made, adapters=frozenset(made.adapters), prefixes=frozenset()
        )


def test_the_step_cost_fit_folds_samples_as_if_added_one_by_one():
    """Steps are kept until a fit and folded in then: the sums equal those of adding each step at once."""
    import numpy as np

    from loraserve.scheduler.cost_model import BatchShape

    rng = random.Random(1)
    model = StepCostModel()
    xtx, xty = np.zeros((5, 5)), np.zeros(5)
    for i in range(2000):
        shape = BatchShape(rng.randint(1, 64), rng.randint(1, 4000), rng.randint(1, 8), rng.randint(1, 400))
        seconds = 0.01 + 0.05 * rng.random()
        model.observe(shape, seconds)
        x = shape.features()
        xtx, xty = model.forget * xtx + np.outer(x, x), model.forget * xty + seconds * x
        if i % 37 == 0:
            model.coef()  # a fit now and then, as placement asks
    model.coefficients  # noqa: B018 - fits
    assert np.allclose(model._xtx, xtx, rtol=1e-9) and np.allclose(model._xty, xty, rtol=1e-9)
