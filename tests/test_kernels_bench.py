"""The kernel benchmark's CPU-side parts: argument parsing, case building, the table, the CUDA guard."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.bench import kernels as bench


def test_defaults_cover_the_issue_sweep():
    args = bench.parse_args([])
    assert args.ranks == [8, 16, 32, 64] and args.batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert args.popularity == ["distinct", "uniform", "zipf", "identical"] and args.hidden == 4096
    assert len(bench.cases(args)) == 2 * 4 * 7 * 4
    assert bench.default_bandwidth("NVIDIA H100 80GB HBM3") == 3.35
    assert bench.default_bandwidth("NVIDIA H200") == 4.8
    assert bench.default_bandwidth("Tesla T4") is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--ranks", "0"])


def test_table_from_a_fake_timer():
    """Every case is built for real (pool, batch), only the timing is fake (the kernels are not run)."""
    args = bench.parse_args(
        ["--ranks", "4", "8", "--batch-sizes", "1", "3", "--hidden", "64", "--row-width", "32",
         "--prefill-len", "5", "--bandwidth", "1.0", "--dtype", "bfloat16"]
    )  # fmt: skip
    timings = iter(range(1, 1000))
    results = bench.benchmark(args, torch.device("cpu"), lambda fn: float(next(timings)) / 1e3)
    assert len(results) == 2 * 2 * 2 * 4
    first = results[0]
    assert (first.phase, first.rank, first.batch_size, first.tokens, first.adapters) == ("decode", 4, 1, 1, 1)
    assert (first.triton_us, first.loop_us, first.bmm_us) == (1.0, 2.0, 3.0)
    # x: 1*64, y: read + write 2*64, adapter: 4 * (64 + 64); bf16 at 1 TB/s
    assert first.roofline_us == pytest.approx((3 * 64 + 4 * 128) * 2 / 1e12 * 1e6)
    identical = next(r for r in results if r.popularity == "identical" and r.batch_size == 3)
    distinct = next(r for r in results if r.popularity == "distinct" and r.batch_size == 3)
    assert identical.adapters == 1 and distinct.adapters == 3
    table = bench.format_table(results).splitlines()
    assert len(table) == 2 + len(results) and "triton us" in table[0] and "% roof" in table[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the guard on machines without CUDA")
def test_refuses_without_cuda(capsys, tmp_path):
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_run_on_gpu(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--ranks", "16", "--batch-sizes", "1", "8", "--rep", "5", "--json", str(out)]
    assert bench.main(argv) == 0
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 2 * 2 * 4 and all(r["triton_us"] > 0 for r in saved["results"])
