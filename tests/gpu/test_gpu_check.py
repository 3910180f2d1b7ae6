"""The GPU suite's driver, run for real on CPU at tiny shapes (`--dry-run`), so it cannot rot between
the rare runs on a GPU; its report's pieces against hand-made inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraserve.bench.common.random_model import LlamaShape, write_llama_checkpoint
from loraserve.bench.suites.gpu_check import report as gpu_report
from loraserve.bench.suites.gpu_check import suite as gpu_check
from loraserve.bench.suites.gpu_check.preset import DRY_RUN

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    command = [
        sys.executable,
        "-m",
        "loraserve.cli",
        "bench",
        "--suite",
        "gpu-check",
        "--dry-run",
        "--out",
        str(out),
        "--tests-dir",
        str(ROOT / "tests" / "gpu"),  # the part's driver on a small folder (collecting all of tests/ takes ~30 s)
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    return done, out


def test_dry_run_runs_every_part(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "gpu-check" and [r["part"] for r in results["records"]] == list(gpu_check.PARTS)
    assert results["preset"] == "dry-run" and results["environment"]["torch"] == torch.__version__
    parts = results["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    assert all(p["status"] == "ok" for p in parts.values()), {k: p.get("error") for k, p in parts.items()}
    for name in gpu_check.PARTS:
        assert (out / "parts" / f"{name}.json").is_file() and (out / "logs" / f"{name}.log").is_file()

    tests = parts["tests"]["data"]  # on CPU every gpu-marked test is collected and skipped
    assert tests["failed"] == 0 and tests["passed"] == 0 and tests["skipped"] >= 3

    engine = parts["engine"]["data"]
    systems = {(r["system"], r["n_adapters"]) for r in engine["rows"]}
    expected = {("base", 0), ("peft", DRY_RUN.baseline_adapters), ("merge-and-swap", DRY_RUN.baseline_adapters)}
    expected |= {("loraserve", n) for n in (*DRY_RUN.adapter_counts, DRY_RUN.baseline_adapters)}
    assert systems == expected
    for row in engine["rows"]:
        assert "error" not in row and row["finished"] == row["requests"] > 0 and row["tokens_per_s"] > 0, row
    assert all(engine["ratios"][k] is not None for k in ("high_over_low", "lora_overhead", "over_peft"))
    profiles = [(p["n_adapters"], p["cuda_graphs"]) for p in engine["decode_profile"]]
    assert profiles == [(0, False), (max(DRY_RUN.adapter_counts), False)]  # no graphs on a CPU
    assert engine["graph_speedup"] is None

    overhead = parts["overhead"]["data"]
    assert [r["kind"] for r in overhead["records"]] == ["overhead", "scaling"]
    assert overhead["records"][0]["model"] == "demo" and overhead["records"][0]["tokens_per_s_lora"] > 0

    stack = parts["stack"]["data"]
    assert stack["stack_vs_engine"]["added_tpot_p50_ms"] is not None
    assert {r["phase"] for r in stack["adapter_fetch"]["results"]} == {"transfer", "transfer+parse"}
    assert stack["host_to_device"]["worker_load_ms"] > 0

    kernels = parts["kernels"]["data"]
    assert kernels["lora"] and kernels["attention"] and "summary" in kernels

    split = parts["tensor-parallel"]["data"]  # the demo model on 1 and 2 ranks (gloo on the CPU)
    assert {(r["size"], r["side"]) for r in split["records"] if r["kind"] == "speed"} >= {(2, "lora"), (1, "base")}
    assert all(t["met"] for t in split["targets"] if t["name"].startswith("bytes sent"))

    assert len(results["targets"]) == len(gpu_report.TARGETS)
    report = (out / "results.md").read_text()
    assert "## Targets" in report and all(f"## {name} (ok" in report for name in gpu_check.PARTS)


def test_a_part_over_its_limit_is_cut_and_reported(tmp_path):
    args = gpu_check.parse_args(["--dry-run", "--out", str(tmp_path), "--parts", "engine", "--scale-limits", "0.001"])
    results = gpu_check.drive(args, say=lambda _: None)
    assert results["parts"]["engine"]["status"] == "timeout"
    assert "cut after" in results["parts"]["engine"]["error"]
    assert "Error: cut after" in (tmp_path / "results.md").read_text()


def test_a_part_keeps_its_figures_so_far(tmp_path, monkeypatch):
    """part_main saves each partial result as it comes; a part cut at its limit reports what it saved."""
    seen = []

    def fake_part(name, args, preset, out, work, partial):
        partial({"rows": [{"system": "base"}]})
        seen.append(json.loads((out / "parts" / "engine.json").read_text()))
        return {"rows": [{"system": "base"}, {"system": "loraserve"}]}

    monkeypatch.setattr(gpu_check, "run_part", fake_part)
    (tmp_path / "parts").mkdir()
    args = gpu_check.parse_args(["--dry-run", "--out", str(tmp_path), "--part", "engine"])
    assert gpu_check.part_main(args) == 0
    assert seen[0]["status"] == "partial" and seen[0]["data"] == {"rows": [{"system": "base"}]}
    final = json.loads((tmp_path / "parts" / "engine.json").read_text())
    assert final["status"] == "ok" and len(final["data"]["rows"]) == 2

    # A part that saved figures and then hangs (a stand-in interpreter that writes a partial record).
    hang = tmp_path / "hanging-part"
    record = json.dumps({"status": "partial", "data": {"rows": [{"system": "base"}]}})
    hang.write_text(f"#!/bin/sh\necho '{record}' > {tmp_path}/parts/engine.json\nexec sleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setattr(gpu_check.sys, "executable", str(hang))
    (tmp_path / "logs").mkdir()
    cut = gpu_check.spawn_part("engine", args, limit_s=2)
    assert cut["status"] == "timeout" and cut["data"] == {"rows": [{"system": "base"}]}


def test_junit_counts(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="ok"/>'
        '<testcase classname="tests.a" name="bad"><failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="tests.b" name="broken"><error message="fixture failed"/></testcase>'
        '<testcase classname="tests.b" name="nogpu"><skipped message="needs a CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gpu_report.junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 2, 1)
    assert counts["failures"][0] == {"test": "tests.a::bad", "message": "assert 1 == 2"}


def test_targets_read_only_parts_that_succeeded():
    ratios = {"high_over_low": 0.95, "lora_overhead": 0.2, "over_peft": None}
    engine = {"ratios": ratios, "graph_speedup": 3.5}
    results = {"parts": {"engine": {"status": "ok", "data": engine}, "stack": {"status": "failed"}}}
    by_name = {t["name"]: t for t in gpu_report.targets(results)}
    assert by_name["engine throughput n=1000 / n=1"]["met"] is True
    assert by_name["LoRA overhead vs the base model"]["met"] is False
    assert by_name["loraserve / PEFT throughput (same trace)"]["met"] is None
    assert by_name["decode step with CUDA graphs, batch 64, most adapters: eager ms / graph ms"]["met"] is True
    assert all(t["met"] is None for t in by_name.values() if t["name"].startswith(("stack", "LoRA decode")))


def test_random_checkpoint_loads_in_transformers(tmp_path):
    """The checkpoint writer's output is a valid Llama for an independent reader, with the counted size."""
    from transformers import AutoModelForCausalLM

    shape = LlamaShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, vocab=1100)
    written = write_llama_checkpoint(tmp_path / "m", shape, dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float16)
    assert sum(p.numel() for p in model.parameters()) == shape.parameters
    assert written == 2 * shape.parameters
    assert model.config.vocab_size == 1100 and model.config.num_key_value_heads == 2


def test_graph_speedup_pairs_the_profiles_at_the_most_adapters():
    from loraserve.bench.suites.gpu_check.engine import graph_speedup

    profiles = [
        {"n_adapters": 0, "cuda_graphs": True, "wall_ms_per_step": 1.0},
        {"n_adapters": 0, "cuda_graphs": False, "wall_ms_per_step": 9.0},
        {"n_adapters": 8, "cuda_graphs": True, "wall_ms_per_step": 2.0},
    ]
    assert graph_speedup(profiles, 8) is None  # the eager one is missing
    profiles.append({"n_adapters": 8, "cuda_graphs": False, "wall_ms_per_step": 7.0})
    assert graph_speedup(profiles, 8) == 3.5
