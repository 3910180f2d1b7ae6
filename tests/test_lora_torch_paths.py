"""The pairs path of `lora_apply_torch` (per token and rank vector, indices built once per step)
computes what the per-segment loop computes.

The pairs path serves steps with many short segments (decode tokens of many adapters): a few
gathers and one index_add per layer instead of two matmuls per segment, with no rank padding. Checked against a
float32 dense recomputation from the adapters' own matrices, over popularity patterns, mixed
ranks, untargeted modules, inactive layers, base-only tokens and long (prefill) segments mixed in;
then the engine's greedy tokens with the pairs path on and off.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import lora_torch
from loraserve.kernels.lora_torch import lora_apply_torch
from loraserve.kernels.synthetic import LoraGeometry, adapters_used, assign_adapters, make_lora_batch, make_lora_pool

# d_in 48 / d_out 80 with 32-wide rows: chunks that are partly padding.
GEOMETRY = LoraGeometry.uniform(48, 80, row_width=32, rows_per_page=4, num_layers=2)
RANKS = [1, 4, 8, 16, 64, 4, 16, 8, 2, 32, 8, 4]
MODULES = [(0, 1, 2, 3, 4, 5, 6)] * 10 + [(1, 2), (0, 6)]  # the last two skip most modules


def _dense(y, x, adapters, requests, batch, layer, module):
    out, used = y.clone(), adapters_used(requests)
    for t, a in enumerate(batch.token_adapter.tolist()):
        if a >= 0 and (layer, module) in adapters[used[a]].weights:
            a_w, b_w = adapters[used[a]].weights[(layer, module)]
            out[t] += (x[t] @ a_w.t()) @ b_w * adapters[used[a]].scale
    return out


@pytest.fixture(scope="module")
def pool():
    return make_lora_pool(GEOMETRY, RANKS, MODULES, torch.float32, seed=5, inactive_layers=[()] * 11 + [(1,)])


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical"])
@pytest.mark.parametrize("lengths", [[1], [1, 2, 3], [1, 1, 12, 1, 30]], ids=["decode", "short", "mixed"])
def test_pairs_match_dense(pool, popularity, lengths):
    weights, adapters = pool
    n = 24
    assigned = assign_adapters(popularity, n, seed=2)
    requests = [(None if i % 5 == 4 else assigned[i] % len(RANKS), lengths[i % len(lengths)]) for i in range(n)]
    requests.sort(key=lambda r: (r[0] is None, r[0] or 0))  # the runner orders requests by adapter
    batch = make_lora_batch(GEOMETRY, adapters, requests)
    g = torch.Generator().manual_seed(1)
    tokens = sum(k for _, k in requests)
    for layer in (0, 1):
        for module in (0, 2, 6):
            x = torch.randn(tokens, 48, generator=g)
            y = torch.randn(tokens, 80, generator=g)
            expected = _dense(y, x, adapters, requests, batch, layer, module)
            lora_apply_torch(y, x, weights[layer], batch, layer, module)
            torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_many_segments_take_the_pairs_path(pool, monkeypatch):
    weights, adapters = pool
    requests = [(i, 1) for i in range(len(RANKS))]
    batch = make_lora_batch(GEOMETRY, adapters, requests)
    calls = []
    original = lora_torch._apply_pairs
    monkeypatch.setattr(lora_torch, "_apply_pairs", lambda *a: calls.append(len(a[-1].token)) or original(*a))
    lora_apply_torch(torch.zeros(len(RANKS), 80), torch.ones(len(RANKS), 48), weights[0], batch, 0, 0)
    lora_apply_torch(torch.zeros(len(RANKS), 80), torch.ones(len(RANKS), 48), weights[1], batch, 1, 0)
    # one pair per token and rank vector; adapter 10 does not target q_proj: left out
    expected = sum(r for i, r in enumerate(RANKS) if i != 10)
    assert calls == [expected, expected]
    assert ("lora_torch", 0) in batch.cache  # built once, reused by the second layer


def test_too_many_pairs_fall_back_to_the_segment_loop(pool, monkeypatch):
    weights, adapters = pool
    requests = [(i, 1) for i in range(len(RANKS))]
    batch = make_lora_batch(GEOMETRY, adapters, requests)
    pairs = sum(r for i, r in enumerate(RANKS) if i != 10)
    monkeypatch.setattr(lora_torch, "PAIRS_MAX_ELEMENTS", pairs * 96 - 1)  # q_proj: 3 chunks of 32 out
    monkeypatch.setattr(lora_torch, "_apply_pairs", lambda *a: pytest.fail("took the pairs path"))
    x, y = torch.randn(len(RANKS), 48), torch.randn(len(RANKS), 80)
    expected = _dense(y, x, adapters, requests, batch, 0, 0)
    lora_apply_torch(y, x, weights[0], batch, 0, 0)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_engine_tokens_identical_with_and_without_pairs(monkeypatch):
    from loraserve.bench.synthetic_adapters import SyntheticAdapters
    from loraserve.demo.assets import DEMO_MODEL_DIR
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine, GenerateRequest
    from loraserve.worker.sampling import SamplingParams

    synthetic = SyntheticAdapters(DEMO_MODEL_DIR, seed=9, std=0.2)
    files = {f"a{i}": synthetic.files(f"a{i}", (4, 8, 16, 32)[i % 4]) for i in range(12)}
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    requests = [
        GenerateRequest(prompt_ids=[1, 20 + i, 7, 300 - i, 9][: 3 + i % 3], adapter=f"a{i % 12}", sampling=greedy)
        for i in range(14)
    ]

    def run() -> list[list[int]]:
        engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=512))
        for name, (config, tensors) in files.items():
            engine.register_adapter(name, config_json=config, weights=tensors)
        return [r.token_ids for r in engine.generate(requests)]

    paired = run()
    monkeypatch.setattr(lora_torch, "PAIRS_MIN_SEGMENTS", 10**6)
    assert run() == paired
