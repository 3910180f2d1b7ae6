"""The GPU-roofline runner profile (`bench --suite runner-profile --roofline h100-7b`): two steps' times
against a hand computation from Llama-2-7B's shapes and the H100 SXM's spec-sheet peaks, and the
profile's round trip through the file the emulated runner reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraserve.bench.cli import parse_args
from loraserve.bench.suites.runner_profile.roofline import PRESETS, roofline_profile
from loraserve.bench.suites.runner_profile.suite import main
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import load_profile
from loraserve.worker.step_costs import step_features

COMMITTED = Path(__file__).resolve().parents[3] / "docs" / "runner_profile" / "gpu-roofline-7b-h100.json"
BANDWIDTH = 3.35e12  # bytes/s
PEAK = 989e12  # flop/s, dense fp16
# Llama-2-7B by hand: per layer q, k, v, o are 4096 × 4096, gate and up 4096 × 11008, down 11008 × 4096.
LAYER_WEIGHTS = 4 * 4096 * 4096 + 3 * 4096 * 11008  # 202,375,168
WEIGHT_BYTES = 2 * (32 * (LAYER_WEIGHTS + 2 * 4096) + 4096 + 32000 * 4096)  # + norms, final norm, LM head
KV_BYTES_PER_TOKEN = 2 * 32 * 4096 * 2  # K and V, 32 layers, 32 heads × 128, fp16: 0.5 MiB
LORA_PER_RANK = 4 * (4096 + 4096) * 32  # q, k, v, o: A (rank × 4096) and B (4096 × rank), 32 layers


def test_hand_figures_are_llama_2_7b():
    assert WEIGHT_BYTES == 13_214_687_232  # 6.74 B parameters less the 131 M-entry embedding table, fp16
    assert KV_BYTES_PER_TOKEN == 524_288


def test_a_decode_step_is_memory_bound_as_computed_by_hand():
    """32 sequences decoding at context 1024 (so 1024 keys each), 8 adapters of rank 16."""
    chunks = [(1, 1024, 16, i % 8) for i in range(32)]
    bytes_ = WEIGHT_BYTES + 32 * 1024 * KV_BYTES_PER_TOKEN + 8 * 16 * LORA_PER_RANK * 2
    flops = (
        2 * 32 * LAYER_WEIGHTS * 32 + 2 * 4096 * 32000 * 32 + 4 * 4096 * 32 * (32 * 1024) + 2 * LORA_PER_RANK * 32 * 16
    )
    expected = max(bytes_ / BANDWIDTH, flops / PEAK)
    assert expected == pytest.approx(9.153e-3, rel=1e-3) and bytes_ / BANDWIDTH > flops / PEAK
    assert roofline_profile(PRESETS["h100-7b"]).runner_s(step_features(chunks)) == pytest.approx(expected, rel=1e-12)


def test_a_prefill_step_is_compute_bound_as_computed_by_hand():
    """One 512-token prompt from the start with a rank-64 adapter: token j attends to j keys."""
    chunks = [(512, 512, 64, "a")]
    attended = sum(range(1, 513))
    bytes_ = WEIGHT_BYTES + 512 * KV_BYTES_PER_TOKEN + 64 * LORA_PER_RANK * 2
    flops = 2 * 32 * LAYER_WEIGHTS * 512 + 2 * 4096 * 32000 + 4 * 4096 * 32 * attended + 2 * LORA_PER_RANK * 512 * 64
    expected = max(bytes_ / BANDWIDTH, flops / PEAK)
    assert flops / PEAK > bytes_ / BANDWIDTH
    assert roofline_profile(PRESETS["h100-7b"]).runner_s(step_features(chunks)) == pytest.approx(expected, rel=1e-12)


def test_the_command_writes_a_profile_any_model_loads_and_scaling_scales_it(tmp_path):
    assert main(parse_args(["--suite", "runner-profile", "--roofline", "h100-7b", "--out", str(tmp_path)])) == 0
    written = json.loads((tmp_path / "runner_profile.json").read_text())
    assert written["version"] == 2 and written["model"]["hidden_size"] == 4096
    assert written["roofline"]["bandwidth_bytes_s"] == BANDWIDTH and written["roofline"]["peak_flops_s"] == PEAK
    profile = load_profile(tmp_path / "runner_profile.json", ModelConfig.from_dir(DEMO_MODEL_DIR))  # any model
    decode = step_features([(1, 100, 0, None)])
    assert profile.runner_s(decode) == pytest.approx((WEIGHT_BYTES + 100 * KV_BYTES_PER_TOKEN) / BANDWIDTH)
    assert profile.scaled(3.0).runner_s(decode) == pytest.approx(3 * profile.runner_s(decode))
    results = json.loads((tmp_path / "results.json").read_text())  # every suite writes one
    assert results["suite"] == "runner-profile" and results["roofline"] == "h100-7b"
    assert [r["step"] for r in results["records"]] == list(written["roofline"]["about"]["examples"])
    assert (
        "H100" in written["roofline"]["about"]["peaks_source"]
        and "bandwidth_source" not in written["roofline"]["about"]
    )


def test_the_committed_roofline_profile_loads_its_old_source_key_as_peaks_source():
    committed = json.loads(COMMITTED.read_text())
    profile = load_profile(COMMITTED, ModelConfig.from_dir(DEMO_MODEL_DIR))
    old = committed["roofline"]["about"].get("bandwidth_source")
    assert profile.roofline.about["peaks_source"] == (old or committed["roofline"]["about"]["peaks_source"])
    assert "bandwidth_source" not in profile.roofline.about
