"""The scheduling benchmark (`loraserve bench --suite scheduling`): seeded traces, the simulated
workers' invariants, the cost model's fit, and a tiny run of the whole suite through the CLI."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from loraserve.bench import main as bench_main
from loraserve.bench import scheduling
from loraserve.bench import scheduling_traces as traces
from loraserve.bench.scheduling_costs import TINY_GRID, fit_step_model, fixed_costs, measure_costs
from loraserve.bench.scheduling_sim import SimConfig, SimPool, Simulation, SimWorker
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.flags import EnvArgumentParser
from loraserve.model_config import ModelConfig
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.step_costs import StepFeatures, step_features

RECORD_FIELDS = ("scenario", "policy", "ttft_p50_s", "ttft_p99_s", "slo_attainment", "req_per_s", "prefetch_hit_rate")
MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)


# ---- traces --------------------------------------------------------------------------------------
def test_traces_are_seeded_and_shaped():
    a, b = traces.heavy_tail(50.0, 40.0, seed=1), traces.heavy_tail(50.0, 40.0, seed=1)
    assert a == b and a != traces.heavy_tail(50.0, 40.0, seed=2)
    n = len(a.requests)
    assert n == pytest.approx(2000, rel=0.1)
    assert [r.arrival_s for r in a.requests] == sorted(r.arrival_s for r in a.requests)
    sizes = Counter(r.size for r in a.requests)
    assert sizes["long"] / n == pytest.approx(0.1, abs=0.025)
    assert all(r.prompt_len + r.output_len <= MODEL.max_position_embeddings for r in a.requests)
    counts = Counter(r.adapter for r in a.requests)
    top = sorted(a.adapters)[0]
    assert counts[top] == max(counts.values())  # Zipf: the first adapter is the most popular
    assert set(a.adapters.values()) == set(traces.RANKS)

    flood = traces.flood(10.0, 50.0, 20.0, seed=3)
    tenants = Counter(r.tenant for r in flood.requests)
    assert tenants["flooder"] / tenants["victim"] == pytest.approx(5.0, rel=0.25)
    calm = flood.only("victim")
    assert {r.tenant for r in calm.requests} == {"victim"}
    assert calm.requests == tuple(r for r in flood.requests if r.tenant == "victim")


def test_burst_arrives_at_once():
    burst = traces.burst(traces.popularity(100.0, 5.0, seed=0, n_adapters=50), 40)
    assert len(burst.requests) == 40 and {r.arrival_s for r in burst.requests} == {0.0}


# ---- the cost model ------------------------------------------------------------------------------
def test_step_shape_pads_each_attention_group_to_its_longest_member():
    shape = step_features([(1, 100, 8, "a"), (1, 20, 16, "b"), (50, 60, 0, None), (10, 10, 8, "a")])
    assert shape == StepFeatures(seqs=4, tokens=62, adapters=2, token_rank=104, key_slots=320, score_slots=6200)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 1e-4, 3e-5, 2e-4, 5e-7, 2e-6, 1e-8])
    shapes = [
        StepFeatures(int(s), int(t), int(a), int(tr), int(at), int(kv))
        for s, t, a, tr, at, kv in zip(
            rng.integers(1, 33, 200),
            rng.integers(1, 2048, 200),
            rng.integers(0, 9, 200),
            rng.integers(0, 50_000, 200),
            rng.integers(0, 500_000, 200),
            rng.integers(0, 10_000, 200),
            strict=True,
        )
    ]
    seconds = [float(np.dot(truth, s.vector())) for s in shapes]
    coef, quality = fit_step_model(shapes, seconds)
    assert np.allclose(coef, truth, rtol=1e-3)
    assert quality["fit_median_rel_error"] < 1e-3


def test_measuring_the_engine_gives_positive_costs():
    costs = measure_costs(DEMO_MODEL_DIR, TINY_GRID)
    assert costs.measured_on["step_samples"] > 10
    assert all(c >= 0 for c in costs.step_coef) and costs.step_coef[0] > 0
    small = costs.step_s(step_features([(1, 1, 0, None)]))
    big = costs.step_s(step_features([(64, 128, 32, ("a", 1))] * 4))
    assert 0 < small < big < 5.0
    assert 0 < costs.copy_s(8) <= costs.copy_s(64) and 0 < costs.fetch_s(8) <= costs.fetch_s(64)


# ---- the simulation ------------------------------------------------------------------------------
class Checked(Simulation):
    """Checks every report the policy gets and every time a worker goes idle."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reports = 0
        self.idle_with_work = 0

    def _report(self, report):
        assert len(report.running) <= report.max_batch_size
        assert report.kv_pages + report.adapter_pages + report.free_pages == report.total_pages
        assert report.evictable_pages <= report.adapter_pages
        self.reports += 1
        super()._report(report)

    def _begin(self, worker: SimWorker):
        super()._begin(worker)
        # work conservation: idle while holding requests only when waiting for a copy into the pool
        if not worker.busy and worker.scheduler.has_work() and not worker.pool.copying():
            self.idle_with_work += 1


def _run(trace, policy: str, pool_pages: int = 1536, **config):
    config = SimConfig(pool_pages=pool_pages, max_batch_size=8, check_invariants=True, **config)
    sim = Checked(trace, scheduling.make_policy(policy), config, fixed_costs(), MODEL, lambda r: 0.5)
    return sim, sim.run()


@pytest.mark.parametrize("policy", scheduling.policies())
def test_every_request_is_served_once_within_the_batch_and_the_pool(policy):
    trace = traces.heavy_tail(60.0, 3.0, seed=4, n_adapters=12)
    sim, result = _run(trace, policy)
    assert [o.status for o in result.outcomes] == ["ok"] * len(trace.requests)
    assert sim.reports > 0 and sim.idle_with_work == 0
    for o in result.outcomes:
        assert o.request.arrival_s <= o.assigned_s <= o.first_token_s <= o.finished_s
    counters = result.workers.values()
    assert all(c["max_running"] <= 8 for c in counters)
    assert all(c["stuck"] == 0 for c in counters)
    assert len(counters) == 2 and sum(c["steps"] for c in counters) > 0
    # work conservation in tokens: every prompt once, every output token but the last once (no preemption here)
    assert sum(c["preemptions"] for c in counters) == 0
    expected = sum(r.prompt_len + r.output_len - 1 for r in trace.requests)
    assert sum(c["tokens"] for c in counters) == expected


def test_a_small_pool_evicts_and_still_serves_everything():
    trace = traces.popularity(80.0, 3.0, seed=5, n_adapters=200)
    sim, result = _run(trace, "fcfs", pool_pages=160)
    assert {o.status for o in result.outcomes} == {"ok"}
    assert sim.idle_with_work == 0
    assert sum(c["evictions"] for c in result.workers.values()) > 0


def test_the_simulation_is_deterministic():
    trace = traces.flood(15.0, 75.0, 2.0, seed=6)
    runs = [_run(trace, scheduling.policies()[0])[1] for _ in range(2)]
    first, second = (
        [(o.request.request_id, o.status, o.first_token_s, o.finished_s) for o in r.outcomes] for r in runs
    )
    assert first == second


def test_prefetch_never_evicts_a_likelier_adapter():
    layout = PoolLayout.for_model(MODEL, 32, 40)
    now = [0.0]
    pool = SimPool(layout, lambda key: (10, 100), lambda key: 0.01, lambda: now[0])
    for name in ("a", "b", "c", "d"):
        assert pool.ensure((name, 1))  # 40 pages: full, all idle
    pool.remember_scores([(("a", 1), 0.9), (("b", 1), 0.9), (("c", 1), 0.9), (("d", 1), 0.9)])
    assert pool.prefetch([("x", 1)], reserve_pages=0) == []  # x (unknown: 0.5) may not evict any of them
    pool.remember_scores([(("x", 1), 0.8), (("d", 1), 0.1)])  # only d is less likely than x
    assert pool.prefetch([("x", 1)], reserve_pages=0) == [("x", 1)]
    assert pool.resident_adapters() == [("a", 1), ("b", 1), ("c", 1), ("x", 1)]
    assert pool.wait_ready(("x", 1)) == pytest.approx(0.01)  # needed at once: the step waits for the copy
    assert (pool.stats.prefetch_late, pool.stats.prefetch_hits) == (1, 0)
    pool.check_invariants()


# ---- the suite -----------------------------------------------------------------------------------
def test_tiny_suite_through_the_cli(tmp_path, monkeypatch):
    costs = tmp_path / "run.json"
    costs.write_text(json.dumps({"costs": fixed_costs().as_dict()}))
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--suite", "scheduling", "--quick", "--sched-duration-scale", "0.05"),
            *("--sched-costs", str(costs), "--out", str(tmp_path / "out")),
        ]
    )
    monkeypatch.setattr(scheduling, "BURST", 120)  # a small capacity burst
    assert bench_main.main(args) == 0
    records = json.loads((tmp_path / "out" / "results.json").read_text())
    default, baseline = scheduling.policies()
    for scenario in scheduling.SCENARIOS:
        mine = [r for r in records if r["scenario"] == scenario]
        assert {r["role"] for r in mine} == {"default", "baseline"}
        assert {r["policy"] for r in mine} == {default, baseline}
    for r in records:
        assert all(r[k] is not None for k in RECORD_FIELDS), r
        assert 0 <= r["slo_attainment"] <= 1 and 0 <= r["prefetch_hit_rate"] <= 1
    flood = [(r["role"], r["tenant"], r["flood"]) for r in records if r["scenario"] == "flood"]
    for role in ("default", "baseline"):
        assert sorted(t for t in flood if t[0] == role) == [
            (role, "flooder", True),
            (role, "victim", False),
            (role, "victim", True),
        ]
    # both policies saw the same requests
    by_role = {role: [r["n_requests"] for r in records if r["role"] == role] for role in ("default", "baseline")}
    assert by_role["default"] == by_role["baseline"]
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["costs"]["measured_on"] == {"source": "fixed"} and run["targets"]
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {
        "scheduling-ttft.png",
        "scheduling-slo.png",
        "scheduling-prefetch.png",
    }
