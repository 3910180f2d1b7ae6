"""`loraserve bench --suite overhead` through its CLI, at a tiny size: the records and their arithmetic."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.overhead import suite as overhead
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.flags import EnvArgumentParser

OVERHEAD_FIELDS = (
    "model",
    "device",
    "backend",
    "cuda_graphs",
    "n_adapters",
    "ranks",
    "batch",
    "tokens_per_s_base",
    "tokens_per_s_lora",
    "overhead",
    "step_ms_base",
    "step_ms_lora",
    "host_ms_per_step",
    "steps_base",
    "steps_lora",
    "adapter_mb_per_step",
    "adapter_loads",
    "pool_pages",
)


def test_tiny_suite_through_the_cli(tmp_path, monkeypatch):
    measured = []
    run = overhead._run
    monkeypatch.setattr(overhead, "_run", lambda e, r, a: measured.append((len(a), out := run(e, r, a))) or out)
    parser = EnvArgumentParser()
    bench_main.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--suite", "overhead", "--quick", "--overhead-models", "demo", "--overhead-batch", "8"),
            *("--overhead-adapters", "4", "--overhead-output-len", "3", "6", "--overhead-repeats", "1"),
            *("--overhead-scaling-n", "6", "--out", str(tmp_path / "out")),
        ]
    )
    assert bench_main.main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(results["machine"])
    (record,) = [r for r in results["records"] if r["kind"] == "overhead"]
    assert all(record[k] is not None for k in OVERHEAD_FIELDS), record
    assert record["model"] == "demo" and record["n_adapters"] == 4 and record["batch"] == 8
    with safe_open(DEMO_MODEL_DIR / "model.safetensors", "pt") as f:  # the checkpoint's own count
        names = f.keys()  # safe_open is not iterable
        assert record["parameters"] == sum(math.prod(f.get_slice(k).get_shape()) for k in names)
    assert record["ranks"] == [8, 16, 32] and record["backend"] == "torch"
    assert record["device"] == "cpu" and record["cuda_graphs"] is False  # a CPU: one record per model, eager
    assert record["tokens_per_s_base"] > 0 and record["tokens_per_s_lora"] > 0
    assert record["step_ms_base"] > 0 and record["step_ms_lora"] > 0 and record["host_ms_per_step"] > 0
    # overhead is lora time / base time - 1 over the same tokens: the tokens/s ratio
    ratio = record["tokens_per_s_base"] / record["tokens_per_s_lora"] - 1
    assert record["overhead"] == pytest.approx(ratio, abs=2e-3)
    base_runs = [m for n, m in measured[:2] if n == 1]  # one repeat of each side, then the scaling runs
    lora_runs = [m for n, m in measured[:2] if n == 4]
    assert base_runs and lora_runs and {m["tokens"] for m in base_runs + lora_runs} == {record["tokens"]}
    assert lora_runs[0]["adapter_bytes"] > 0 and base_runs[0]["adapter_bytes"] == 0  # the LoRA run used adapters
    assert record["steps_base"] == base_runs[0]["steps"] and record["steps_lora"] == lora_runs[0]["steps"]
    assert record["adapter_loads"] == 0  # every adapter was resident before the clock started
    (scaling,) = [r for r in results["records"] if r["kind"] == "scaling"]
    assert scaling["n_adapters"] == 6 and scaling["tokens_per_s_n1"] > 0 and scaling["tokens_per_s_n"] > 0
    assert scaling["ratio"] == pytest.approx(scaling["tokens_per_s_n"] / scaling["tokens_per_s_n1"], abs=2e-3)


def test_breakdown_records_gathers_and_a_profile_of_each_side(tmp_path, monkeypatch):
    from loraserve.bench.suites.overhead import breakdown

    monkeypatch.setattr(breakdown, "SOURCE_MB", 4)
    monkeypatch.setattr(breakdown, "GATHER_MB", 1)
    monkeypatch.setattr(breakdown, "REPEATS", 2)
    monkeypatch.setattr(overhead, "PROFILE_STEPS", 2)
    argv = ["--suite", "overhead", "--quick", "--overhead-models", "demo", "--overhead-batch", "4"]
    argv += ["--overhead-adapters", "3", "--overhead-output-len", "2", "3", "--overhead-repeats", "1"]
    argv += ["--overhead-scaling-n", "4", "--overhead-breakdown", "--out", str(tmp_path / "out")]
    assert bench_main.run(argv) == 0
    records = json.loads((tmp_path / "out" / "results.json").read_text())["records"]
    assert [r["kind"] for r in records] == ["overhead", "scaling", "gather", "profile", "profile"]
    gather = records[2]
    assert gather["row_bytes"] == 256 and gather["page_bytes"] == 256 * 32  # the demo's pool: 64 floats a row
    assert all(gather[k] > 0 for k in ("rows_gbps", "pages_gbps", "contiguous_gbps"))
    base, lora = records[3:]
    assert (base["side"], base["n_adapters"], lora["side"], lora["n_adapters"]) == ("base", 0, "lora", 3)
    for side in (base, lora):
        assert side["steps"] == 2 and side["batch"] == 4 and side["wall_ms_per_step"] > 0
        assert side["top"] and side["profiled_self_ms_per_step"] >= side["top"][0]["ms_per_step"] > 0


def test_gemm_comparison_writes_one_record_per_row_count_and_thread_count(tmp_path):
    from loraserve.bench.suites.overhead import gemm

    shape = ["--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "96"]
    gemm.main(["--out", str(tmp_path), "--rows", "1", "8", "--threads", "1", *shape])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["suite"] == "overhead-gemm" and results["model"]["hidden"] == 64
    assert [r["rows"] for r in results["records"]] == [1, 8]
    for r in results["records"]:
        assert r["f_linear_ms"] > 0 and r["dense_ms"] > 0 and r["max_abs_diff"] < 1e-4
        # the ratio of the unrounded times: the milliseconds are rounded to 3 decimals, coarse at this size
        assert r["speedup"] == pytest.approx(r["f_linear_ms"] / r["dense_ms"], rel=0.2)
    assert gemm.fused_shapes(64, 1, 2, 1, 96) == [(128, 64), (64, 64), (192, 64), (64, 96)]
