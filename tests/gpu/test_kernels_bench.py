"""The kernel benchmarks' CPU-side parts: arguments, cases, the synthetic builders, the tables, the CUDA
guard, and the whole suite as a dry run (tiny shapes, Triton's interpreter, wall-clock times)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraserve.bench.common.kernel_cases import (
    LoraGeometry,
    make_bench_lora_pool,
    make_lora_plan,
    make_uniform_attention_case,
)
from loraserve.bench.suites.kernels import attention as attention_bench
from loraserve.bench.suites.kernels import device, report, suite, timing
from loraserve.bench.suites.kernels import lora as bench
from loraserve.kernels.attention_torch import attention_torch
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch


def test_defaults_are_the_suite_sweep():
    args = suite.parse_args([])
    assert args.ranks == [16, 64, 128, "mixed"] and args.batch_sizes == [1, 8, 64, 256]
    assert args.popularity == ["distinct", "uniform", "zipf", "identical"] and args.hidden == 4096
    assert len(bench.cases(bench.LoraConfig.from_args(args))) == 2 * 4 * 4 * 4
    assert bench.cases(bench.LoraConfig()) == bench.cases(bench.LoraConfig.from_args(args))
    assert timing.default_bandwidth("NVIDIA H100 80GB HBM3") == 3.35
    assert timing.default_bandwidth("NVIDIA H100 PCIe") == 2.0
    assert timing.default_bandwidth("NVIDIA H200") == 4.8
    assert timing.default_bandwidth("Tesla T4") is None
    assert bench.case_ranks("mixed", 7, bench.MIXED_RANKS) == [8, 16, 32, 64, 128, 8, 16]
    for bad in (["--ranks", "0"], ["--ranks", "big"], ["--batch-sizes", "0"]):
        with pytest.raises(SystemExit):
            suite.parse_args(bad)


def _fake_timers() -> timing.Timers:
    timings = iter(range(1, 10_000))
    return timing.Timers(eager=lambda fn: float(next(timings)) / 1e3, graph=lambda fn: None)


def test_table_from_a_fake_timer():
    """Every case is built for real (pool, batch), only the timing is fake (the kernels are not run)."""
    args = suite.parse_args(
        [
            "--ranks",
            "4",
            "mixed",
            "--batch-sizes",
            "1",
            "3",
            "--hidden",
            "64",
            "--row-width",
            "32",
            "--prefill-len",
            "5",
            "--max-prefill-tokens",
            "8",
            "--bandwidth",
            "1.0",
            "--dtype",
            "bfloat16",
        ]
    )
    config = bench.LoraConfig.from_args(args)
    config.check = False
    results = bench.benchmark(config, torch.device("cpu"), _fake_timers(), progress=False)
    assert len(results) == 2 * 2 * 2 * 4 and all(r.error is None for r in results)
    first = results[0]
    assert (first.phase, first.rank, first.batch_size, first.tokens, first.adapters) == ("decode", 4, 1, 1, 1)
    assert (first.triton_us, first.loop_us, first.bmm_us) == (1.0, 2.0, 3.0)
    assert first.triton_graph_us is None and first.loop_graph_us is None and first.path == "token"
    assert (first.bmm_x, first.loop_x) == (3.0, 2.0)
    # x: 1*64, y: read + write 2*64, adapter: 4 * (64 + 64); bf16 at 1 TB/s
    assert first.roofline_us == pytest.approx((3 * 64 + 4 * 128) * 2 / 1e12 * 1e6)
    identical = next(r for r in results if r.popularity == "identical" and r.batch_size == 3)
    distinct = next(r for r in results if r.popularity == "distinct" and r.batch_size == 3)
    assert identical.adapters == 1 and distinct.adapters == 3
    assert identical.path == "segment" and distinct.path == "token"
    mixed = next(r for r in results if r.rank == "mixed" and r.batch_size == 3 and r.popularity == "distinct")
    assert mixed.max_rank == 32  # 8, 16, 32, 64, 128 cycled over the pool's max(batch_sizes) = 3 adapters
    prefill = next(r for r in results if r.rank == "mixed" and r.phase == "prefill" and r.batch_size == 3)
    assert (prefill.tokens_per_request, prefill.tokens) == (2, 6) and "cut to 2 tokens/request" in prefill.note
    assert prefill.roofline_us == pytest.approx((6 * 3 * 64 + (8 + 16 + 32) * 128) * 2 / 1e12 * 1e6)
    table = bench.format_table(results).splitlines()
    assert len(table) == 2 + len(results) and "triton us" in table[0] and "% roof" in table[0]
    markdown = report.lora_markdown(results).splitlines()
    assert len(markdown) == 2 + len(results) and markdown[0].startswith("| phase | rank |")


def test_budget_skips_the_rest():
    config = bench.LoraConfig(ranks=[4], batch_sizes=[1], popularity=["distinct"], hidden=64, row_width=32)
    config.check = False
    results = bench.benchmark(config, torch.device("cpu"), _fake_timers(), deadline=0.0, progress=False)
    assert [r.error for r in results] == ["skipped", "skipped"]
    summary = report.lora_summary(results)
    assert summary["lora_skipped"] == ["decode r4 b1 distinct", "prefill r4 b1 distinct"]
    assert summary["lora_decode_b64_distinct_r16"] is None and summary["within_2x_roofline"] is False


def test_out_of_memory_is_a_note_not_a_failure():
    def graph(fn):
        raise torch.cuda.OutOfMemoryError("no room")

    timers = timing.Timers(eager=lambda fn: 1e-3, graph=graph)
    config = bench.LoraConfig(ranks=[4], batch_sizes=[1], popularity=["distinct"], hidden=64, row_width=32)
    config.check = False
    results = bench.benchmark(config, torch.device("cpu"), timers, progress=False)
    assert all(r.error is None and r.triton_us == 1.0 and r.triton_graph_us is None for r in results)
    assert results[0].note == "triton graph: out of memory; loop graph: out of memory"


def test_bench_lora_pool_has_make_lora_pools_layout():
    """The device-side builder's pool, read by the torch reference, gives x @ A^T @ B * scale."""
    geometry = LoraGeometry.uniform(40, 72, 32, 8)  # widths not multiples of the row: padded chunks
    pool, adapters = make_bench_lora_pool(geometry, [3, 8, 5], (0, 4), torch.float32, keep_weights=True)
    requests = [(2, 3), (None, 1), (0, 1), (1, 2)]
    plan = make_lora_plan(geometry, adapters, requests, prepare=lambda p: prepare_lora_torch(p, torch.float32))
    x = torch.randn(7, 40)
    for module in (0, 4):
        y = torch.zeros(7, 72)
        lora_apply_torch((y,), x, pool[0], plan, 0, module)
        expected = torch.zeros(7, 72)
        for (adapter, _), rows in zip(requests, ([0, 1, 2], [3], [4], [5, 6]), strict=True):
            if adapter is not None:
                a, b = adapters[adapter].weights[(0, module)]
                expected[rows] = x[rows] @ a.t() @ b * adapters[adapter].scale
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_uniform_attention_case_matches_dense_attention():
    """The paged pool, read by the torch reference, gives what SDPA gives on the dense K/V."""
    for ctx, q_len in ((13, 1), (9, 9)):
        case = make_uniform_attention_case(3, ctx, q_len, 4, 2, 8, 4, torch.float32, seed=1)
        out = attention_torch(case.q, case.pool_layer, case.batch, 2, 0.3)
        q = case.q.view(3, q_len, 4, 8).transpose(1, 2)
        k, v = case.keys.transpose(1, 2), case.values.transpose(1, 2)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, ref.transpose(1, 2).reshape(out.shape), atol=1e-5, rtol=1e-5)
        assert case.batch.new_rows.numel() == 3 * q_len


def test_attention_roofline_and_flops():
    config = attention_bench.AttentionConfig(bandwidth_tbs=2.0, peak_tflops=1000.0)
    decode = attention_bench.AttentionCase("decode", 64, 4096, 1)
    prefill = attention_bench.AttentionCase("prefill", 1, 2048, 2048)
    kv = 64 * 4096 * 8 * 128 * 2
    assert attention_bench.roofline_us(decode, config, 2) == pytest.approx((kv + 2 * 64 * 32 * 128) * 2 / 2e12 * 1e6)
    assert attention_bench.flops(decode, config) == 4 * 32 * 128 * 4096 * 64
    assert attention_bench.flops(prefill, config) == 4 * 32 * 128 * 2048 * 2049 // 2
    assert len(attention_bench.cases(config)) == 2 * 4 + 2


def test_dry_run_needs_the_interpreter_before_triton(monkeypatch):
    import triton  # noqa: F401

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        device.ensure_interpreter()
    monkeypatch.delitem(sys.modules, "triton")
    device.ensure_interpreter()
    assert os.environ["TRITON_INTERPRET"] == "1"


def _dry_run_report(tmp_path: Path) -> dict:
    """The CLI's dry run: in this process when the interpreter is on, else in a child that turns it on."""
    out = tmp_path / "suite"
    argv = ["--dry-run", "--out", str(out)]
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert suite.main(suite.parse_args(argv)) == 0
    else:  # CUDA machine: triton is already imported here, compiled
        cmd = [sys.executable, "-m", "loraserve.cli", "bench", "--suite", "kernels", *argv]
        subprocess.run(cmd, check=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    return json.loads((out / "results.json").read_text())


def test_suite_dry_run(tmp_path):
    saved = _dry_run_report(tmp_path)
    common = {"suite", "machine", "commit", "records", "targets"}
    assert set(saved) == common | {"meta", "attention", "summary", "markdown"}
    assert saved["suite"] == "kernels" and saved["machine"]["cores"] >= 1 and "gpu" not in saved["machine"]
    report = {**saved, "lora": saved["records"]}
    meta = report["meta"]
    assert meta["dry_run"] and meta["roofline_bandwidth_is_placeholder"] and meta["roofline_bandwidth_tbs"] == 1.0
    assert meta["measured_bandwidth_tbs"] is None and meta["torch"] and meta["triton"]
    lora, attention = report["lora"], report["attention"]
    for rows in (lora, attention):
        assert {r["phase"] for r in rows} == {"decode", "prefill"}
        assert all(r["error"] is None and r["ok"] for r in rows)
        assert all(r["triton_us"] > 0 and r["triton_graph_us"] is None and r["roofline_us"] > 0 for r in rows)
    assert {r["rank"] for r in lora} == {4, "mixed"} and {r["path"] for r in lora} == {"token", "segment"}
    assert all(r["max_abs_err"] < 1e-2 and r["rel_err"] < 1e-2 for r in lora)
    assert all(r["max_abs_err"] < 4e-3 and r["sdpa_us"] > 0 for r in attention)
    summary = report["summary"]
    head = summary["lora_decode_b64_distinct_r16"]
    assert head["case"] == "decode r4 b3 distinct" and head["timing"] == "eager"
    assert math.isclose(head["x_roofline"], head["triton_us"] / head["roofline_us"])
    assert isinstance(summary["within_2x_roofline"], bool) and isinstance(summary["faster_than_bmm_everywhere"], bool)
    assert isinstance(summary["not_faster_than_bmm"], list)
    assert summary["lora_all_correct"] and summary["attention_all_correct"]
    assert summary["attention_decode_b64_ctx4096"]["case"] == "decode 3x1 ctx 20"
    assert not summary["lora_errors"] and not summary["attention_errors"] and not summary["lora_skipped"]
    md = report["markdown"]
    assert "### Batched LoRA" in md and "### Paged attention" in md and "| phase | rank |" in md
    assert "| phase | seqs × new |" in md and "within 2× roofline" in md and "faster than gather-then-bmm" in md
    assert "- Paged attention decode 3x1 ctx 20:" in md
    # a dry run judges correctness only: its times are the interpreter's
    assert [t["met"] for t in saved["targets"]] == [None, None, True]
    assert all(set(t) == {"name", "goal", "value", "met"} for t in saved["targets"])


def test_targets_from_a_gpu_summary():
    from loraserve.bench.suites.kernels.results import targets

    summary = {
        "lora_decode_b64_distinct_r16": {"case": "decode r16 b64 distinct", "x_roofline": 1.5},
        "within_2x_roofline": True,
        "faster_than_bmm_everywhere": False,
        "not_faster_than_bmm": ["decode r16 b1 identical"],
        "lora_all_correct": True,
    }
    got = targets(summary, dry_run=False)
    assert [(t["value"], t["met"]) for t in got] == [(1.5, True), (["decode r16 b1 identical"], False), (True, True)]
    assert got[0]["name"] == "LoRA decode r16 b64 distinct, Triton time / roofline" and got[0]["goal"] == "<= 2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the guard on machines without CUDA")
def test_refuses_without_cuda(capsys, tmp_path):
    assert suite.main(suite.parse_args(["--out", str(tmp_path / "out")])) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert attention_bench.main(argparse.Namespace(dry_run=False, out=None)) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_run_on_gpu(tmp_path):
    out = tmp_path / "bench"
    argv = ["--ranks", "16", "mixed", "--batch-sizes", "1", "8", "--rep", "5", "--out", str(out)]
    assert suite.main(suite.parse_args(argv)) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["suite"] == "kernels" and saved["machine"]["gpu"] and saved["commit"]
    assert len(saved["records"]) == 2 * 2 * 2 * 4
    assert all(r["error"] is None and r["ok"] and r["triton_us"] > 0 for r in saved["records"])
    assert all(r["triton_graph_us"] > 0 for r in saved["records"])
    assert saved["meta"]["measured_bandwidth_tbs"] > 0 and saved["targets"]
