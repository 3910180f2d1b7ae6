"""The engine against transformers + peft: many adapters of mixed ranks in one batch, token-exact.

Tolerance: first-step logits in float32 agree with PEFT within atol=rtol=1e-4 (different but
equivalent summation orders: batched GEMMs, SDPA over the pool); greedy tokens are identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import TinySpec, hf_greedy, hf_logits, make_adapter, make_model

from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.request import FinishReason
from loraserve.worker.sampling import SamplingParams

LOGITS_TOL = {"float32": 1e-4}
NEW_TOKENS = 12
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, 44, 3, 99],
    [1, 8, 8, 8, 8, 8, 8, 200, 17, 301, 5],
    [1, 17],
    [1, 600, 2, 902, 14],
]


def _engine(model, adapters, **overrides) -> Engine:
    config = EngineConfig(device="cpu", pool_pages=overrides.pop("pool_pages", 96), **overrides)
    engine = Engine(model, config)
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    return engine


@pytest.fixture(scope="module")
def oracle(tiny_model, tiny_adapters):
    """Greedy continuation of (prompt, adapter) by transformers/peft, memoized."""
    cache: dict = {}

    def run(prompt: list[int], adapter: str | None) -> list[int]:
        key = (tuple(prompt), adapter)
        if key not in cache:
            cache[key] = hf_greedy(tiny_model, tiny_adapters.get(adapter), prompt, NEW_TOKENS)
        return cache[key]

    return run


def _mixed_requests(tiny_adapters) -> list[GenerateRequest]:
    names = [None, *tiny_adapters]  # a base-only request among them
    return [GenerateRequest(prompt_ids=p, adapter=a, sampling=GREEDY) for p, a in zip(PROMPTS, names, strict=True)]


def test_mixed_batch_is_token_exact_with_peft(tiny_model, tiny_adapters, oracle):
    engine = _engine(tiny_model, tiny_adapters)
    requests = _mixed_requests(tiny_adapters)
    results = engine.generate(requests)
    assert engine.steps == NEW_TOKENS  # everything ran in one continuous batch
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == oracle(request.prompt_ids, request.adapter), request.adapter
        assert result.finish_reason is FinishReason.LENGTH
    stats = engine.stats()["pool"]
    assert stats["kv_pages"] == 0 and stats["pinned_adapters"] == 0  # everything released


@pytest.mark.parametrize(
    "variant",
    [{"backend": "torch-bmm"}, {"adapter_pool_fraction": 0.7, "pool_pages": 400}, {"pad_decode_steps": True}],
    ids=["bmm", "split-pool", "padded-decode"],
)
def test_benchmark_variants_are_token_exact(tiny_model, tiny_adapters, oracle, variant):
    """The ablations `loraserve bench` measures compute the same thing, only differently."""
    engine = _engine(tiny_model, tiny_adapters, **variant)
    requests = _mixed_requests(tiny_adapters)
    for request, result in zip(requests, engine.generate(requests), strict=True):
        assert result.token_ids == oracle(request.prompt_ids, request.adapter), request.adapter


def test_first_step_logits_match_peft(tiny_model, tiny_adapters):
    check_first_step_logits(_engine(tiny_model, tiny_adapters), tiny_model, tiny_adapters)


def check_first_step_logits(engine: Engine, model, adapters) -> None:
    """The mixed requests' first-step logits in `engine` (left with nothing to run) against PEFT's."""
    seen: list[torch.Tensor] = []
    original = engine.model.logits
    engine.model.logits = lambda hidden: seen.append(original(hidden)) or seen[-1]  # observe, don't alter
    requests = _mixed_requests(adapters)
    try:
        for r in requests:
            engine.add_request(r.prompt_ids, r.sampling, r.adapter)
        engine.step()
    finally:
        engine.model.logits = original
        while engine.has_unfinished():
            engine.step()
    first = seen[0]  # one row per request, in the runner's order (grouped by adapter, base-only last)
    assert first.shape[0] == len(requests)
    unmatched = list(range(len(requests)))
    for r in requests:
        expected = hf_logits(model, adapters.get(r.adapter), r.prompt_ids)
        # the request's row: the closest one; it must then match within the tolerance
        row = min(unmatched, key=lambda row: float((first[row] - expected).abs().max()))
        torch.testing.assert_close(first[row], expected, atol=LOGITS_TOL["float32"], rtol=LOGITS_TOL["float32"])
        unmatched.remove(row)


def test_preemption_keeps_greedy_outputs(tiny_model, tiny_adapters, oracle):
    # 4 tokens per page: ten requests need ~60 KV pages, the adapters 16; the pool has 40.
    small = {name: tiny_adapters[name] for name in ("r4-qv", "r8-kod-layer1")}
    engine = _engine(tiny_model, small, pool_pages=40, rows_per_page=8)
    names = [None, "r4-qv", "r8-kod-layer1", "r4-qv", None]
    requests = [GenerateRequest(prompt_ids=p, adapter=a, sampling=GREEDY) for p, a in zip(PROMPTS, names, strict=True)]
    results = engine.generate(requests * 2)
    assert sum(r.num_preemptions for r in results) > 0, "the pool was meant to force preemption"
    for request, result in zip(requests * 2, results, strict=True):
        assert result.finish_reason is FinishReason.LENGTH, result.error
        assert result.token_ids == oracle(request.prompt_ids, request.adapter)
    engine.pool.check_invariants()
    assert engine.stats()["pool"]["kv_pages"] == 0


def test_requests_arriving_mid_generation(tiny_model, tiny_adapters, oracle):
    engine = _engine(tiny_model, tiny_adapters, max_batched_tokens=8)  # also forces chunked prefill
    requests = _mixed_requests(tiny_adapters)
    added = {}
    for i, r in enumerate(requests):
        added[i] = engine.add_request(r.prompt_ids, r.sampling, r.adapter)
        for _ in range(3):  # a few steps between arrivals
            engine.step()
    while engine.has_unfinished():
        engine.step()
    for i, r in enumerate(requests):
        assert added[i].output_ids == oracle(r.prompt_ids, r.adapter)


def test_cancel_frees_pages_at_next_step(tiny_model, tiny_adapters):
    engine = _engine(tiny_model, tiny_adapters)
    keep = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True), "r4-qv")
    gone = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=30, ignore_eos=True), "r64-mlp")
    engine.step()
    engine.step()
    before = engine.stats()["pool"]
    assert engine.pool.pages.kv_page_table(gone.request_id)
    engine.abort(gone.request_id)
    outputs = engine.step()
    cancelled = [o for o in outputs if o.request_id == gone.request_id]
    assert cancelled and cancelled[0].finish_reason is FinishReason.CANCELLED
    assert engine.pool.pages.kv_page_table(gone.request_id) == []
    after = engine.stats()["pool"]
    assert after["kv_pages"] < before["kv_pages"]
    assert after["pinned_adapters"] == 1  # r64-mlp unpinned (still cached), r4-qv in use
    assert not keep.finished


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(arch="llama", tie=True, heads=4, kv_heads=4),  # multi-head attention, tied embeddings
        TinySpec(
            arch="llama",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            },
        ),
        TinySpec(arch="mistral", seed=5),
        TinySpec(arch="qwen2", seed=6, heads=4, kv_heads=1),  # biases on q/k/v, one KV head
    ],
    ids=["llama-mha-tied", "llama3-rope", "mistral", "qwen2-bias"],
)
def test_architectures_match_transformers(spec, tmp_path):
    model = make_model(tmp_path / "m", spec)
    adapter = make_adapter(model, tmp_path / "a", 8, ["q_proj", "k_proj", "v_proj", "up_proj"], seed=7)
    engine = _engine(model, {"a": adapter})
    prompt = [1, 70, 80, 90, 3, 4, 5, 6, 7, 8, 9, 10]
    base, tuned = engine.generate(
        [
            GenerateRequest(prompt_ids=prompt, sampling=GREEDY),
            GenerateRequest(prompt_ids=prompt, adapter="a", sampling=GREEDY),
        ]
    )
    assert base.token_ids == hf_greedy(model, None, prompt, NEW_TOKENS)
    assert tuned.token_ids == hf_greedy(model, adapter, prompt, NEW_TOKENS)
    assert base.token_ids != tuned.token_ids


def test_sharded_checkpoint_loads(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model / name).read_bytes())
    sharded = _engine(tmp_path, {}).generate([GenerateRequest(prompt_ids=PROMPTS[0], sampling=GREEDY)])
    single = _engine(tiny_model, {}).generate([GenerateRequest(prompt_ids=PROMPTS[0], sampling=GREEDY)])
    assert sharded[0].token_ids == single[0].token_ids


@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 0.1), ("float16", 0.02)])
def test_half_precision_logits_close_to_float32(tiny_model, tiny_adapters, dtype, tol):
    engine = _engine(tiny_model, tiny_adapters, dtype=dtype)
    seen: list[torch.Tensor] = []
    original = engine.model.logits
    engine.model.logits = lambda hidden: seen.append(original(hidden)) or seen[-1]
    engine.add_request(PROMPTS[0], GREEDY, "r16-all-rslora")
    engine.step()
    expected = hf_logits(tiny_model, tiny_adapters["r16-all-rslora"], PROMPTS[0])
    torch.testing.assert_close(seen[0][0], expected, atol=tol * expected.abs().max().item(), rtol=0)


def test_padded_decode_steps_match_unpadded(tiny_model, tiny_adapters):
    """Decode steps padded to the CUDA-graph batch sizes give the same tokens and logits as unpadded
    ones, whatever the batch size (requests finish at different lengths, so the padding varies)."""
    requests = [
        GenerateRequest(prompt_ids=p, adapter=a, sampling=SamplingParams(max_new_tokens=3 + 2 * i, ignore_eos=True))
        for i, (p, a) in enumerate(zip(PROMPTS * 2, [None, *tiny_adapters] * 2, strict=True))
    ]
    runs = {}
    for padded in (False, True):
        engine = _engine(tiny_model, tiny_adapters, pad_decode_steps=padded, max_batch_size=12)
        logits: list[torch.Tensor] = []
        original = engine.model.logits
        engine.model.logits = lambda hidden, original=original, logits=logits: (
            logits.append(original(hidden)) or logits[-1]
        )
        sizes: list[tuple[int, int]] = []  # (sequences, after padding) of each padded step
        if padded:
            pad = engine.runner.decode_padding.pad
            engine.runner.decode_padding = SimpleNamespace(
                pad=lambda b, pad=pad, sizes=sizes: sizes.append((len(b), len(p := pad(b)))) or p
            )
        runs[padded] = ([r.token_ids for r in engine.generate(requests)], logits)
        engine.pool.check_invariants()
        assert engine.stats()["pool"]["kv_pages"] == (1 if padded else 0)  # the pads' page stays reserved
    assert runs[True][0] == runs[False][0]
    for padded_logits, plain in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(padded_logits, plain, atol=1e-5, rtol=1e-5)
        if padded:
            decode = [(n, m) for n, m in sizes if n != m or n in engine.config.decode_buckets()]
            assert any(n < m for n, m in decode), "some decode step was padded"
            assert all(m in engine.config.decode_buckets() for _, m in decode)
    assert engine.config.decode_buckets() == [1, 2, 4, 8, 12]
