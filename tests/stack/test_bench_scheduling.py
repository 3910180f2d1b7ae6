"""The scheduling benchmark (`loraserve bench --suite scheduling --stack`): seeded traces (conversations
included), the records' arithmetic, and a tiny run of the suite through the CLI on a real stack of two
emulated workers; and the control-plane suite (`--suite control-plane`) at a tiny size."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from emulated import fixed_profile

from loraserve.bench import cli as bench_main
from loraserve.bench.common.calibration import fit_step_model
from loraserve.bench.suites.control_plane import suite as control_plane
from loraserve.bench.suites.scheduling import suite as scheduling
from loraserve.bench.suites.scheduling.stack import Outcome, StackRun, workload_ids
from loraserve.bench.suites.scheduling.targets import add_ratios, targets
from loraserve.bench.workloads import scheduling as traces
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.flags import EnvArgumentParser
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile
from loraserve.worker.step_costs import StepFeatures, step_features

RECORD_FIELDS = (
    *("scenario", "policy", "prefetch", "ttft_p50_s", "ttft_p99_s", "slo_attainment", "req_per_s"),
    *("prefetch_hit_rate", "load_wait_s", "n_workers"),
)
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


def test_a_conversation_reuses_its_adapter_and_extends_its_prompt_after_a_think_time():
    trace = traces.conversations(20.0, 60.0, seed=5, n_adapters=100)
    assert trace == traces.conversations(20.0, 60.0, seed=5, n_adapters=100)
    by_id = {r.request_id: r for r in trace.requests}
    follow_ups = [r for r in trace.requests if r.follows is not None]
    assert len(follow_ups) / len(trace.requests) == pytest.approx(1 - 1 / traces.MEAN_TURNS, abs=0.12)
    for r in follow_ups:
        previous = by_id[r.follows]
        assert (r.adapter, r.stream) == (previous.adapter, previous.stream)
        assert r.prompt_len >= previous.prompt_len + previous.output_len + 16  # its history, then a new message
        assert r.think_s >= traces.MIN_THINK_S and r.arrival_s > previous.arrival_s
    assert all(r.prompt_len + r.output_len <= traces.MAX_CONTEXT for r in trace.requests)
    assert len(trace.requests) / 60.0 == pytest.approx(20.0, rel=0.3)  # about `rate` requests a second
    # a follow-up's prompt ids begin with its predecessor's (the prefix cache can find the history)
    later = follow_ups[0]
    first = workload_ids(by_id[later.follows], MODEL.vocab_size, 0)
    assert workload_ids(later, MODEL.vocab_size, 0)[: len(first)] == first
    alone = traces.burst(trace, 30)
    assert all(r.arrival_s == 0.0 and r.follows is None for r in alone.requests)


# ---- the step-cost model the emulated workers wait by ----------------------------------------------
def test_step_shape_pads_each_attention_group_to_its_longest_member():
    shape = step_features([(1, 100, 8, "a"), (1, 20, 16, "b"), (50, 60, 0, None), (10, 10, 8, "a")])
    assert shape == StepFeatures(
        seqs=4, tokens=62, adapters=2, token_rank=104, key_slots=320, score_slots=6200,
        context=190, attended=100 + 20 + (50 * 10 + 50 * 51 // 2) + 10 * 11 // 2, adapter_rank=8 + 16,
    )  # fmt: skip


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 1e-4, 3e-5, 2e-4, 5e-7, 2e-6, 1e-8])
    columns = [rng.integers(lo, hi, 200) for lo, hi in ((1, 33), (1, 2048), (0, 9), (0, 50_000), (0, 500_000))]
    shapes = [StepFeatures(*(int(c[i]) for c in columns), int(rng.integers(0, 10_000))) for i in range(200)]
    seconds = [float(np.dot(truth, s.vector())) for s in shapes]
    coef, quality = fit_step_model(shapes, seconds)
    assert np.allclose(coef, truth, rtol=1e-3)
    assert quality["fit_median_rel_error"] < 1e-3


# ---- the records' arithmetic ---------------------------------------------------------------------
def _outcome(i: int, sent: float, ttft: float | None, done: float | None, status: str, wait: float = 0.0) -> Outcome:
    request = traces.SchedRequest(f"r{i}", sent, "a", 16, 8)
    first = None if ttft is None else sent + ttft
    return Outcome(request, 0.5, sent, first, done, status, adapter_load_s=wait)


def test_a_record_counts_what_the_client_saw_and_what_the_workers_counted():
    outcomes = [_outcome(i, float(i), 0.1 * (i + 1), float(i) + 2.0, "ok", wait=0.01) for i in range(9)]
    outcomes.append(_outcome(9, 9.0, None, None, "refused"))
    workers = {
        "w0": {"prefetch_hits": 3, "prefetch_misses": 1, "found_ready": 2, "found_cold": 2, "found_resident": 5},
        "w1": {"prefetch_hits": 0, "prefetch_misses": 0, "found_loading": 1},
    }
    record = scheduling.summarize(outcomes, StackRun(outcomes, workers, 10.0, 1.0))
    assert record["n_requests"] == 10 and (record["completed"], record["refused"]) == (9, 1)
    assert record["ttft_p50_s"] == pytest.approx(0.5) and record["ttft_max_s"] == pytest.approx(0.9)
    assert record["slo_attainment"] == pytest.approx(0.5)  # 5 of 10 within 0.5 s; the refused one misses
    assert record["req_per_s"] == pytest.approx(9 / 10.0)  # the first sent at 0, the last done at 10
    assert record["load_wait_s"] == pytest.approx(0.09) and record["load_wait_mean_s"] == pytest.approx(0.01)
    assert record["load_wait_first_s"] == pytest.approx(0.01)  # one adapter: its first request's wait
    assert record["prefetch_hit_rate"] == pytest.approx(0.75)
    assert record["loads_ready_before_scheduled"] == pytest.approx(2 / 5)  # ready / (ready + loading + cold)
    assert record["adapter_requests"] == {"resident": 5, "ready": 2, "loading": 1, "cold": 2}


def test_ratios_and_targets_compare_like_with_like():
    def rec(scenario, policy, role, prefetch=True, p50=0.1, p99=0.2, rps=10.0, wait=1.0, hit=0.6, **tags):
        return {
            "scenario": scenario,
            "policy": policy,
            "role": role,
            "prefetch": prefetch,
            **tags,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "req_per_s": rps,
            "load_wait_s": wait,
            "prefetch_hit_rate": hit,
            **{"n_requests": 100, "completed": 100, "refused": 0},
        }

    records = [
        rec("heavy-tail", "adaptive", "default", p99=0.1),
        rec("heavy-tail", "fcfs", "baseline", p99=0.4, rps=10.4),
        rec("conversations", "adaptive", "default", wait=0.1),
        rec("conversations", "fcfs", "baseline"),
        rec("conversations", "adaptive", "default", prefetch=False, wait=0.6),
        rec("flood", "adaptive", "default", p99=0.3, tenant="victim", flood=True),
        rec("flood", "adaptive", "default", p99=0.1, tenant="victim", flood=False),
        rec("flood", "fcfs", "baseline", tenant="victim", flood=True, p99=9.0),
        rec("flood", "fcfs", "baseline", tenant="victim", flood=False),
    ]
    add_ratios(records)
    assert records[0]["ttft_p99_improvement_vs_fcfs"] == pytest.approx(4.0)
    assert records[0]["req_per_s_vs_fcfs"] == pytest.approx(10 / 10.4, abs=1e-4)
    assert records[4]["load_wait_vs_prefetch"] == pytest.approx(6.0) and "ttft_p50_vs_fcfs" not in records[4]
    met = {t["name"]: (t["value"], t["met"]) for t in targets(records)}
    assert met["heavy-tail p99 TTFT, fcfs / default"] == (4.0, True)
    assert met["heavy-tail req/s, default / fcfs"][1] is True  # 3.8 % lower: within 5 %
    assert met["victim p99 TTFT, flood / calm (default policy)"] == (3.0, False)
    assert met["conversations load wait, prefetch off / on"] == (6.0, True)
    assert met["conversations prefetch hit rate (default policy)"] == (0.6, True)


def test_the_no_worse_checks_count_every_tenant_the_flooder_included():
    """A policy that refuses most of a flooder's requests serves the victim well but completes far fewer
    in all: the comparison with fcfs over every tenant says so."""

    def rec(role, tenant, flood, n, done, refused, p99, rps):
        policy = "adaptive" if role == "default" else "fcfs"
        fields = {"scenario": "flood", "policy": policy, "role": role, "prefetch": True, "tenant": tenant}
        fields |= {"flood": flood, "whole_run": tenant == "all" or not flood, "n_requests": n, "completed": done}
        return fields | {"refused": refused, "ttft_p50_s": p99 / 2, "ttft_p99_s": p99, "req_per_s": rps}

    records = [
        rec("default", "victim", True, 231, 231, 0, 0.09, 14.8),
        rec("default", "flooder", True, 1254, 269, 985, 14.5, 14.2),
        rec("default", "all", True, 1485, 500, 985, 12.0, 29.0),
        rec("default", "victim", False, 231, 231, 0, 0.07, 15.1),
        rec("baseline", "victim", True, 231, 231, 0, 21.8, 5.3),
        rec("baseline", "flooder", True, 1254, 1254, 0, 21.8, 28.2),
        rec("baseline", "all", True, 1485, 1485, 0, 21.8, 33.5),
        rec("baseline", "victim", False, 231, 231, 0, 0.23, 13.6),
    ]
    add_ratios(records)
    met = {t["name"]: (t["value"], t["met"]) for t in targets(records)}
    assert met["flood (every tenant, flooded) completed, default / fcfs"] == (round(500 / 1485, 4), False)
    assert met["flood (every tenant, flooded) refused, (default − fcfs) / sent"] == (round(985 / 1485, 4), False)
    assert met["flood (victim, alone) completed, default / fcfs"] == (1.0, True)  # the whole calm run
    assert "flood (victim, flooded) completed, default / fcfs" not in met  # one tenant is not the whole run
    assert not any(name.startswith("flood (flooder") for name in met)  # counted in every tenant's
    assert records[2]["fcfs_completed"] == 1485 and records[2]["fcfs_refused"] == 0
    records[0]["slo_attainment"], records[4]["slo_attainment"] = 0.0, 0.0  # both miss every target
    met = {t["name"]: (t["value"], t["met"]) for t in targets(records)}
    assert met["flood (victim, flooded) SLO attainment, default − fcfs"] == (0.0, True)


def test_a_comparison_the_default_policy_has_no_value_for_is_missed_not_dropped():
    """The default policy completed nothing (no TTFT, no req/s) and fcfs's flooded victim sent nothing
    (no SLO attainment): every comparison with fcfs is still a target, and missed."""

    def rec(role, n, done, refused, p99, rps, slo, **tags):
        fields = {"scenario": "heavy-tail", "policy": "adaptive" if role == "default" else "fcfs", "role": role}
        fields |= {"prefetch": True, "whole_run": True, "n_requests": n, "completed": done, "refused": refused}
        p50 = None if p99 is None else p99 / 2
        return fields | {"ttft_p50_s": p50, "ttft_p99_s": p99, "req_per_s": rps, "slo_attainment": slo} | tags

    records = [
        rec("default", 100, 0, 100, None, None, 0.0),
        rec("baseline", 100, 100, 0, 0.4, 10.0, 0.9),
        rec("default", 50, 50, 0, 0.1, 5.0, 1.0, scenario="flood", tenant="victim", flood=True),
        rec("baseline", 0, 0, 0, None, None, None, scenario="flood", tenant="victim", flood=True),
    ]
    add_ratios(records)
    met = {t["name"]: (t["value"], t["met"]) for t in targets(records)}
    for what in ("TTFT p50, default / fcfs", "TTFT p99, default / fcfs", "req/s, default / fcfs"):
        assert met[f"heavy-tail {what}"] == (None, False)
        assert met[f"flood (victim, flooded) {what}"] == (None, False)
    assert met["heavy-tail p99 TTFT, fcfs / default"] == (None, False)
    assert met["heavy-tail completed, default / fcfs"] == (0.0, False)
    assert met["flood (victim, flooded) SLO attainment, default − fcfs"] == (None, False)


def test_a_flooded_run_gives_a_record_per_tenant_and_one_of_every_tenant():
    outcomes = [_outcome(i, float(i), 0.1, 1.0 + i, "ok") for i in range(5)]
    for i, o in enumerate(outcomes):
        o.request = dataclasses.replace(o.request, tenant="victim" if i < 2 else "flooder")
    groups = scheduling.record_groups("flood", True, outcomes)
    assert [(t, len(o)) for t, o in groups] == [("victim", 2), ("flooder", 3), ("all", 5)]
    assert [(t, len(o)) for t, o in scheduling.record_groups("flood", False, outcomes[:2])] == [("victim", 2)]
    assert scheduling.record_groups("heavy-tail", None, outcomes) == [(None, outcomes)]


def test_results_name_the_runner_profile_used(tmp_path):
    """A roofline profile's name is its `roofline.about.name`; any other profile's its file name."""
    named = Path(__file__).resolve().parents[2] / "docs" / "runner_profile" / "gpu-roofline-7b-h100.json"
    assert RunnerProfile.from_dict(json.loads(named.read_text())).roofline is not None  # a real profile
    about = scheduling.profile_about(named, calibrated=False, time_scale=1.0)
    assert about == {"path": str(named), "name": "gpu-roofline-7b-h100", "calibrated_here": False, "time_scale": 1.0}
    renamed = tmp_path / "h100.json"
    renamed.write_text(named.read_text())
    assert scheduling.profile_about(renamed, calibrated=False, time_scale=1.0)["name"] == "gpu-roofline-7b-h100"
    plain = fixed_profile(tmp_path / "cpu-calibrated.json")  # no roofline
    assert scheduling.profile_about(plain, calibrated=False, time_scale=6.0)["name"] == "cpu-calibrated"
    assert scheduling.profile_about(plain, calibrated=True, time_scale=6.0)["calibrated_here"] is True


def test_a_scaled_profile_waits_that_many_times_longer():
    profile = RunnerProfile.from_dict(json.loads(fixed_profile_text()))
    scaled = profile.scaled(6.0)
    assert scaled.runner_coef == tuple(6.0 * c for c in profile.runner_coef)
    assert scaled.costs.step_coef == tuple(6.0 * c for c in profile.costs.step_coef)
    assert scaled.costs.copy_coef == profile.costs.copy_coef and scaled.fidelity["time_scale"] == 6.0


def fixed_profile_text() -> str:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return fixed_profile(Path(d) / "p.json").read_text()


# ---- the suites through the CLI ------------------------------------------------------------------
def _args(*argv: str):
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_tiny_stack_suite_through_the_cli(tmp_path, monkeypatch):
    """Conversations on real stacks of two emulated workers: calibration, both policies, prefetch off."""
    tiny = scheduling.SchedulingPreset(dict.fromkeys(scheduling.SCENARIOS, 3.0), burst=24, probe=2, drain_s=8.0)
    monkeypatch.setattr(scheduling, "QUICK", tiny)
    monkeypatch.setitem(scheduling.ADAPTERS, "conversations", 12)
    monkeypatch.setattr(traces, "THINK_S", 0.5)  # short pauses: short runs
    monkeypatch.setattr(traces, "MIN_THINK_S", 0.2)
    monkeypatch.setitem(scheduling.POOL_PAGES, "conversations", 256)
    profile = fixed_profile(tmp_path / "runner_profile.json", step_s=0.004)
    out = tmp_path / "out"
    args = _args(
        *("--suite", "scheduling", "--stack", "--quick", "--sched-scenarios", "conversations"),
        *("--sched-workers", "2", "--runner-profile", str(profile), "--out", str(out)),
    )
    assert bench_main.main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "scheduling" and results["machine"]["cpus"] >= 1
    records = results["records"]
    default, baseline = scheduling.policies()
    assert [(r["policy"], r["prefetch"]) for r in records] == [(default, True), (baseline, True), (default, False)]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for r in records:
        assert all(r[k] is not None for k in RECORD_FIELDS), r
        assert r["stack"] is True and r["n_workers"] == 2 and r["scenario"] == "conversations"
        assert 0 <= r["slo_attainment"] <= 1 and 0 <= r["prefetch_hit_rate"] <= 1
        statuses = r["completed"] + r["refused"] + r["failed"] + r["unfinished"] + r["unsent"]
        assert statuses == r["n_requests"] and r["completed"] > 0
        mine = [x for x in rows if (x["policy"], x["prefetch"]) == (r["policy"], r["prefetch"])]
        assert len(mine) == r["n_requests"]
        waited = sum(x["adapter_load_s"] for x in mine if x["status"] == "ok" and x["adapter"])
        assert r["load_wait_s"] == pytest.approx(waited, abs=1e-3)
        assert sum(r["adapter_requests"].values()) >= r["completed"]  # each reached a worker with its adapter
    assert {r["n_requests"] for r in records} == {len(traces_of(rows, default, True))}  # the same requests
    off, on = records[2], records[0]
    assert on["load_wait_s"] > 0  # the first request for each adapter waits for its fetch from the store
    assert off["load_wait_vs_prefetch"] == pytest.approx(off["load_wait_s"] / on["load_wait_s"], rel=1e-2)
    run = json.loads((out / "run.json").read_text())
    assert run["scenarios"]["conversations"]["capacity_req_per_s"] > 0 and run["profile"]["time_scale"] == 6.0
    assert results["runner_profile"] == {
        "path": str(profile),
        "name": "runner_profile",
        "calibrated_here": False,
        "time_scale": 6.0,
    }
    assert results["targets"] == run["targets"] and {t["name"] for t in results["targets"]} >= {
        "conversations load wait, prefetch off / on",
        "conversations prefetch hit rate (default policy)",
        "conversations TTFT p99, default / fcfs",
        "conversations completed, default / fcfs",
        "conversations refused, (default − fcfs) / sent",
    }
    assert all(set(t) == {"name", "goal", "value", "met"} for t in results["targets"])
    assert all(r["whole_run"] and r["step_mean_s"] > 0 for r in records)
    plots = {"scheduling-ttft.png", "scheduling-slo.png", "scheduling-prefetch.png"}
    assert {p.name for p in out.glob("*.png")} == plots


def traces_of(rows: list[dict], policy: str, prefetch: bool) -> list[dict]:
    return [x for x in rows if (x["policy"], x["prefetch"]) == (policy, prefetch)]


@pytest.mark.slow
def test_tiny_control_plane_suite_through_the_cli(tmp_path, monkeypatch):
    """A real scheduler, 4 emulated workers in one process, Submits over gRPC: every request placed, and
    the decision latencies measured inside the scheduler and end to end."""
    tiny = control_plane.ControlPlanePreset((200.0,), 1.5, ("adaptive",), ("stream", "unary"))
    monkeypatch.setattr(control_plane, "QUICK", tiny)
    out = tmp_path / "cp"
    args = _args("--suite", "control-plane", "--quick", "--cp-workers", "4", "--cp-adapters", "100", "--out", str(out))
    assert bench_main.main(args) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["suite"] == "control-plane" and result["records"] == result["runs"]
    assert (result["workers"], result["adapters"]) == (4, 100)
    assert [(run["policy"], run["submit"]) for run in result["runs"]] == [("adaptive", "stream"), ("adaptive", "unary")]
    for run in result["runs"]:
        ((phase,),) = [run["phases"]]
        assert phase["sent"] == 300 and phase["codes"] == {"OK": 300} and phase["assigned"] == 300
        assert 0 <= phase["decision_p50_s"] <= phase["decision_p99_s"] <= phase["end_to_end_p99_s"]
        assert phase["admitted_req_per_s"] == pytest.approx(200.0, rel=0.1) and 0 < phase["scheduler_cpu"] < 2
        assert phase["kept_up"] is True
    assert [t["name"] for t in result["targets"]] == ["admitted req/s", "decision p99 at 5000 req/s offered (s)"]
