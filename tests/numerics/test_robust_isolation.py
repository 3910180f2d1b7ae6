"""One request's bad numbers stay with it: a poisoned adapter in a batch with others.

An adapter whose weights are finite but absurd (a real adapter's scaled by 1e19, registered past
validation as a corrupt host copy would be) drives its request's activations to inf/NaN. That
request must end alone with FinishReason.ERROR and a clear message, and every other request of
the same batch must produce exactly the tokens it produces without the poisoned one, greedy and
sampled (seeded), on the torch backends (and greedy on the Triton backend where it runs).
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TRITON_INTERPRETED

from loraserve.worker.adapters import load_adapter_dir
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, FinishReason, GenerateRequest
from loraserve.worker.sampling import SamplingParams

PROMPTS = {"r4-qv": [1, 5, 9, 33, 7], "r16-all-rslora": [1, 44, 3], "r64-mlp": [1, 8, 8, 8, 200], None: [1, 17, 2]}


def _poisoned(adapter, factor: float = 1e19):
    weights = {key: (a * factor, b * factor) for key, (a, b) in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


def _run(model, adapters, sampling: SamplingParams, poison: bool, backend: str) -> dict:
    config = EngineConfig(device="cpu", dtype="float32", backend=backend, pool_pages=256, rows_per_page=8)
    engine = Engine(model, config)
    for name in ("r4-qv", "r16-all-rslora", "r64-mlp"):
        engine.register_adapter(name, adapters[name])
    requests = [GenerateRequest(prompt_ids=p, adapter=a, sampling=sampling) for a, p in PROMPTS.items()]
    if poison:
        engine.adapters.add("poison", _poisoned(load_adapter_dir(adapters["r16-all-rslora"], engine.model_config, 64)))
        requests.insert(1, GenerateRequest(prompt_ids=[1, 44, 3], adapter="poison", sampling=sampling))
    results = engine.generate(requests)
    return {(req.adapter or "base"): res for req, res in zip(requests, results, strict=True)}


# Sampling is the same code whatever the backend, so the Triton interpreter (slow) runs the greedy case only.
CASES = [(0.0, "torch"), (0.7, "torch"), (0.0, "torch-bmm"), (0.7, "torch-bmm"), (0.0, "triton")]


@pytest.mark.parametrize(("temperature", "backend"), CASES, ids=lambda v: {0.0: "greedy", 0.7: "sampled"}.get(v, v))
def test_poisoned_adapter_fails_alone(tiny_model, tiny_adapters, temperature: float, backend: str):
    if backend == "triton" and not TRITON_INTERPRETED:
        pytest.skip("Triton on CPU runs only interpreted (the GPU run is test_engine_triton's business)")
    sampling = SamplingParams(max_new_tokens=5, temperature=temperature, seed=11, ignore_eos=True)
    clean = _run(tiny_model, tiny_adapters, sampling, poison=False, backend=backend)
    mixed = _run(tiny_model, tiny_adapters, sampling, poison=True, backend=backend)
    bad = mixed.pop("poison")
    assert bad.finish_reason == FinishReason.ERROR and "non-finite" in (bad.error or ""), bad
    for name, result in clean.items():
        assert result.error is None and mixed[name].error is None, mixed[name]
        assert mixed[name].token_ids == result.token_ids, name
