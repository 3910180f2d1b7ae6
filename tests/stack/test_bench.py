"""The serving benchmark: workload statistics, trace files, metrics, every system end to end, plots.

Statistics are checked on long traces (tens of thousands of arrivals) with tolerances a few
standard errors wide; the systems run a handful of short requests on the demo model.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from loraserve.bench import cli as bench_cli
from loraserve.bench.common.metrics import summarize
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.serving import report as bench_report
from loraserve.bench.suites.serving import suite as bench_main
from loraserve.bench.suites.serving.plots import plot_results
from loraserve.bench.systems.base import ReplayLimits, RequestRecord
from loraserve.bench.systems.engine import LORASERVE_VARIANTS, AdapterBank, engine_variant, warm_up_adapters
from loraserve.bench.systems.merge import MergedModel, MergeSwapSystem
from loraserve.bench.systems.peft import PeftSystem
from loraserve.bench.workloads.slora import (
    Trace,
    TraceRequest,
    WorkloadSpec,
    gamma_arrivals,
    load_trace,
    popularity_trace,
    power_law_shares,
    save_trace,
    synthetic_trace,
)
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.flags import EnvArgumentParser
from loraserve.worker.config import EngineConfig


# ---- workload ------------------------------------------------------------------------------------
def test_total_rate_and_power_law_shares():
    spec = WorkloadSpec(n_adapters=8, alpha=1.0, rate=50.0, cv=1.0, duration_s=400.0, seed=1)
    trace = synthetic_trace(spec)
    n = len(trace.requests)
    assert n / spec.duration_s == pytest.approx(spec.rate, rel=0.03)  # 20000 arrivals: ~0.7% std error
    counts = Counter(r.adapter for r in trace.requests)
    expected = power_law_shares(8, 1.0)
    for i, name in enumerate(trace.adapters):
        share = counts[name] / n
        assert share == pytest.approx(expected[i], abs=4 * math.sqrt(expected[i] / n) + 0.005), name
    assert list(trace.adapters.values()) == [64, 32, 16, 8, 64, 32, 16, 8]  # round-robin ranks


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_inter_arrival_cv(cv):
    times = gamma_arrivals(np.random.default_rng(3), rate=100.0, cv=cv, duration_s=300.0)
    gaps = np.diff(times)
    assert len(times) / 300.0 == pytest.approx(100.0, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_lengths_prompts_and_order():
    spec = WorkloadSpec(n_adapters=5, rate=40.0, duration_s=50.0, input_len=(3, 9), output_len=(2, 5), seed=2)
    trace = synthetic_trace(spec)
    prompts = [r.prompt_len for r in trace.requests]
    outputs = [r.max_new_tokens for r in trace.requests]
    assert (min(prompts), max(prompts)) == (3, 9) and (min(outputs), max(outputs)) == (2, 5)
    assert all(3 <= t < 1024 for r in trace.requests for t in r.prompt_ids)  # no special ids
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 50.0
    assert len({r.request_id for r in trace.requests}) == len(trace.requests)


def test_deterministic_under_a_seed():
    spec = WorkloadSpec(n_adapters=20, rate=10.0, duration_s=20.0, seed=7)
    assert synthetic_trace(spec) == synthetic_trace(spec)
    assert synthetic_trace(spec).requests != synthetic_trace(WorkloadSpec(20, rate=10.0, duration_s=20.0)).requests


def test_jsonl_round_trip(tmp_path):
    trace = synthetic_trace(WorkloadSpec(n_adapters=30, rate=20.0, duration_s=5.0, seed=4))
    path = save_trace(trace, tmp_path / "trace.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(trace.requests) + 1
    first = json.loads(lines[1])
    assert {"arrival_s", "adapter", "prompt_len", "prompt_ids", "max_new_tokens"} <= set(first)
    again = load_trace(path)
    assert again.requests == trace.requests
    assert again.adapters == trace.adapters  # unused adapters survive too
    assert again.params["rate"] == 20.0


def test_minimal_jsonl_draws_prompts(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"arrival_s": 0.5, "adapter": "b", "prompt_len": 4, "max_new_tokens": 3, "rank": 8}\n'
        '{"arrival_s": 0.1, "adapter": "a", "prompt_len": 6, "max_new_tokens": 2}\n'
    )
    trace = load_trace(path)
    assert [r.adapter for r in trace.requests] == ["a", "b"]  # sorted by arrival
    assert [r.prompt_len for r in trace.requests] == [6, 4]
    assert trace.adapters == {"b": 8, "a": 16}
    assert load_trace(path) == trace


def test_popularity_cases():
    n = 400
    distinct = popularity_trace("distinct", n, seed=1)
    assert len({r.adapter for r in distinct.requests}) == n
    identical = popularity_trace("identical", n, seed=1)
    assert {r.adapter for r in identical.requests} == {"adapter-0000"} and len(identical.adapters) == 1
    uniform = popularity_trace("uniform", n, seed=1)
    counts = Counter(r.adapter for r in uniform.requests)
    assert len(uniform.adapters) == math.ceil(math.sqrt(n)) and len(counts) <= 20
    assert max(counts.values()) < 3 * n / 20  # roughly even
    zipf = popularity_trace("zipf", n, seed=1)
    top = Counter(r.adapter for r in zipf.requests).most_common(1)[0]
    assert top[0] == "adapter-0000" and top[1] / n == pytest.approx(1 / 2.612, abs=0.08)  # 1 / zeta(1.5)
    assert len(zipf.requests) == n and zipf.duration_s > 0
    with pytest.raises(ValueError, match="popularity"):
        popularity_trace("bursty", 10)


# ---- metrics -------------------------------------------------------------------------------------
def test_summarize():
    records = [
        RequestRecord("a", "x", 0.0, 4, 3, first_token_s=0.5, finish_s=1.5, output_tokens=3),
        RequestRecord("b", "x", 1.0, 4, 3, first_token_s=3.0, finish_s=4.0, output_tokens=3),
        RequestRecord("c", "y", 2.0, 4, 3, first_token_s=2.2, output_tokens=1),  # cut off at the deadline
        RequestRecord("d", "y", 3.0, 4, 3),  # never started
    ]
    m = summarize(records, slo_s=1.0)
    assert m["finished"] == 2 and m["makespan_s"] == 4.0
    assert m["req_per_s"] == 0.5 and m["tokens_per_s"] == 6 / 4  # c's token is not counted
    assert m["output_tokens"] == 7
    assert m["ttft_p50_s"] == pytest.approx(0.5) and m["ttft_mean_s"] == pytest.approx(0.9)
    assert m["tpot_mean_s"] == pytest.approx(0.5) and m["latency_mean_s"] == pytest.approx(2.25)
    assert m["slo_attainment"] == 0.5  # a and c within 1 s; b late; d never


# ---- systems -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters() -> SyntheticAdapters:
    return SyntheticAdapters(DEMO_MODEL_DIR, seed=3)


@pytest.fixture(scope="module")
def tiny_trace() -> Trace:
    """Six short requests for three adapters (ranks 4, 8, 16), two arriving together."""
    arrivals = [(0.0, 0), (0.0, 1), (0.05, 2), (0.1, 0), (0.15, 1), (0.2, 0)]
    requests = tuple(
        TraceRequest(t, f"adapter-000{a}", tuple(range(5, 9 + i)), 3 + i % 2, f"req-{i}")
        for i, (t, a) in enumerate(arrivals)
    )
    adapters = {"adapter-0000": 4, "adapter-0001": 8, "adapter-0002": 16, "adapter-0003": 8}  # one unused
    return Trace(requests, adapters, {"duration_s": 0.25})


def _check_records(records: list[RequestRecord], trace: Trace) -> None:
    assert [r.request_id for r in records] == [r.request_id for r in trace.requests]
    for record, request in zip(records, trace.requests, strict=True):
        assert record.finished, record
        assert record.adapter == request.adapter and record.arrival_s == request.arrival_s
        assert record.output_tokens == request.max_new_tokens
        assert request.arrival_s <= record.first_token_s <= record.finish_s
        assert record.ttft_s >= 0 and record.tpot_s >= 0 and record.latency_s >= record.ttft_s


LIMITS = ReplayLimits(drain_s=30.0, progress=False)


@pytest.mark.parametrize("variant", LORASERVE_VARIANTS)
def test_engine_systems_replay_a_trace(variant, adapters, tiny_trace):
    config = EngineConfig(device="cpu", max_batch_size=8, pool_pages=256)
    system = engine_variant(variant, DEMO_MODEL_DIR, config, AdapterBank(adapters), LIMITS, split_fraction=0.5)
    assert system.name == variant
    _check_records(system.run(tiny_trace), tiny_trace)
    stats = system.stats()
    # every adapter the trace uses is loaded, but the warm-up's (loaded before the clock starts)
    warmed = set(warm_up_adapters(tiny_trace.adapters))
    assert stats["adapter_loads"] >= len(set(tiny_trace.used_adapters()) - warmed) >= 1
    assert 0.0 <= stats["pool_waste_fraction"] < 1.0
    assert stats["mean_batch_size"] >= 1


def test_peft_system_replays_a_trace(adapters, tiny_trace, tmp_path):
    system = PeftSystem(adapters, tmp_path / "cache", max_batch_size=4, limits=LIMITS)
    _check_records(system.run(tiny_trace), tiny_trace)
    assert system.stats()["adapter_switches"] >= 2 and system.stats()["batches"] >= 3
    assert len(list((tmp_path / "cache").glob("*/adapter-000*"))) == 4  # written once, reused next time
    _check_records(system.run(tiny_trace), tiny_trace)  # same adapters: the loaded model is reused
    assert system.stats()["setup_s"] == 0.0


def test_merge_and_swap_replays_a_trace(adapters, tiny_trace):
    system = MergeSwapSystem(adapters, max_batch_size=4, limits=LIMITS)
    _check_records(system.run(tiny_trace), tiny_trace)
    assert system.stats()["adapter_switches"] >= 2


def test_merged_weights_match_peft_and_unmerge_restores_the_base(adapters, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 17, 300, 45, 9, 12]])
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
    merged = MergedModel(base)
    for name, rank in (("adapter-0001", 8), ("adapter-0002", 16)):
        merged.switch(name, adapters.tensors(name, rank), adapters.config(rank)["lora_alpha"] / rank)
    with torch.no_grad():
        merged_logits = base(ids).logits
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32),
        adapters.write("adapter-0002", 16, tmp_path),
    ).eval()
    with torch.no_grad():
        peft_logits = peft_model(ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, atol=2e-4, rtol=2e-4)
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the adapter changes something
    merged.switch("adapter-0000", {}, 1.0)  # an empty adapter: only the unmerge happens
    with torch.no_grad():
        assert torch.equal(base(ids).logits, base_logits)


def test_replay_cuts_unfinished_requests_at_the_deadline(adapters):
    requests = tuple(TraceRequest(0.0, "adapter-0000", (5, 6, 7), 400, f"r{i}") for i in range(2))
    trace = Trace(requests, {"adapter-0000": 8}, {"duration_s": 0.0})
    config = EngineConfig(device="cpu", max_batch_size=1, pool_pages=128)
    limits = ReplayLimits(drain_s=0.3, progress=False)
    system = engine_variant("loraserve", DEMO_MODEL_DIR, config, AdapterBank(adapters), limits, 0.5)
    records = system.run(trace)
    assert not records[1].finished and records[1].first_token_s is None  # never admitted (batch of 1)
    assert not records[0].finished and 0 < records[0].output_tokens < 400
    assert summarize(records, 1.0)["slo_attainment"] <= 0.5


# ---- plots and the command -----------------------------------------------------------------------
def test_plots_are_pngs(tmp_path):
    rows = [
        {
            "system": s,
            "n_adapters": n,
            "rate": r,
            "req_per_s": r * f,
            "latency_mean_s": n / 100,
            "ttft_mean_s": 0.1,
            "slo_attainment": f,
        }
        for s, f in (("loraserve", 1.0), ("peft", 0.4))
        for n, r in ((1, 10.0), (10, 10.0), (100, 10.0), (100, 5.0), (100, 20.0))
    ]
    paths = plot_results(rows, tmp_path)
    assert sorted(p.name for p in paths) == ["vs_adapters.png", "vs_rate.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_results(rows[:1], tmp_path / "one") == []  # a single point: nothing to draw


def test_bench_command_writes_results(tmp_path, capsys):
    parser = EnvArgumentParser()
    bench_cli.add_arguments(parser)
    out, saved = tmp_path / "out", tmp_path / "trace.jsonl"
    argv = [
        "--n-adapters",
        "1",
        "3",
        "--rates",
        "12",
        "--duration",
        "0.4",
        "--drain",
        "20",
        "--input-len",
        "4",
        "6",
        "--output-len",
        "2",
        "3",
        "--systems",
        "loraserve",
        "merge-and-swap",
        "--no-progress",
        "--pool-pages",
        "256",
        "--out",
        str(out),
        "--save-trace",
        str(saved),
    ]
    assert bench_cli.main(parser.parse_args(argv)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "serving" and results["machine"]["cores"] >= 1 and "commit" in results
    rows = results["records"]
    assert {(r["system"], r["n_adapters"]) for r in rows} == {
        (s, n) for s in ("loraserve", "merge-and-swap") for n in (1, 3)
    }
    required = {
        "system",
        "n_adapters",
        "alpha",
        "cv",
        "rate",
        "req_per_s",
        "tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "slo_attainment",
    }
    assert all(required <= set(r) for r in rows)
    assert (out / "vs_adapters.png").is_file() and (out / "records.jsonl").is_file()
    assert results["settings"]["n_adapters"] == [1, 3] and results["run_s"] > 0
    assert "loraserve / merge-and-swap throughput, n=1" in results["ratios"]
    assert [t["met"] for t in results["targets"]] == [None, None]  # no n = 100 row: nothing to judge
    assert "loraserve bench" in capsys.readouterr().out
    replay_args = [
        "--trace",
        str(tmp_path / "trace-n3-r12.jsonl"),
        "--systems",
        "loraserve",
        "--no-progress",
        "--pool-pages",
        "256",
        "--drain",
        "20",
    ]
    rows = bench_main.run_benchmark(bench_main._resolved(parser.parse_args(replay_args)))
    assert [r["n_adapters"] for r in rows] == [3] and rows[0]["finished"] == rows[0]["requests"]


def test_serving_targets_at_100_adapters():
    def row(system: str, req_per_s: float) -> dict:
        return {"system": system, "n_adapters": 100, "rate": 60.0, "req_per_s": req_per_s}

    rows = [row("loraserve", 60.0), row("peft", 20.0), row("merge-and-swap", 30.0)]
    got = bench_report.targets(rows, 60.0)
    assert [(t["value"], t["met"]) for t in got] == [(3.0, False), (2.0, True)]
    assert all(set(t) == {"name", "goal", "value", "met"} for t in got)
    rows[1]["req_per_s"] = 10.0
    assert bench_report.targets(rows, 60.0)[0]["met"] is True


def test_quick_preset_covers_the_required_settings():
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = bench_main._resolved(parser.parse_args(["--quick"]))
    settings = bench_main.settings(args)
    assert {s.n_adapters for s in settings if s.rate == args.rates[0]} == {1, 100, 1000}
    assert args.baseline_max_adapters == 100 and len({s.rate for s in settings}) >= 2
    assert Path(args.model) == DEMO_MODEL_DIR
