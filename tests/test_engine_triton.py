"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

On CPU the kernels run in Triton's interpreter, so the run is short: a mixed batch of a base-only
request and adapters of ranks 4, 16 (all modules, rsLoRA) and 64 (MLP, whose width 88 is not a
multiple of the KV row width), with small pages and a small token budget so that prompts are
prefilled in chunks over several pages while other requests decode. With CUDA the same comparison
runs on the GPU (`kernel_device`, marked `gpu`), both backends in float32: the Triton kernels use
IEEE float32 products (no TF32) and torch keeps TF32 off for matmuls by default, so the greedy
tokens must match exactly there too.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels.backend import select_backend
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 33, 7, 12], [1, 44, 3, 99], [1, 8, 8, 8, 8, 8, 8, 200, 17], [1, 17]]
ADAPTERS = [None, "r4-qv", "r16-all-rslora", "r64-mlp"]
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _generate(model, adapters, backend: str, device: str) -> list[list[int]]:
    # 8-row pages (4 tokens): the rank-64 MLP adapter takes 120, all four requests together ~200.
    config = EngineConfig(
        device=device, dtype="float32", backend=backend, pool_pages=208, rows_per_page=8, max_batched_tokens=8
    )
    engine = Engine(model, config)
    assert engine.runner.backend.name == backend
    for name in ADAPTERS[1:]:
        engine.register_adapter(name, adapters[name])
    requests = [
        GenerateRequest(prompt_ids=p, adapter=a, sampling=GREEDY) for p, a in zip(PROMPTS, ADAPTERS, strict=True)
    ]
    results = engine.generate(requests)
    assert all(r.error is None and len(r.token_ids) == GREEDY.max_new_tokens for r in results), results
    return [r.token_ids for r in results]


def test_triton_backend_matches_torch(tiny_model, tiny_adapters, kernel_device: str):
    expected = _generate(tiny_model, tiny_adapters, "torch", kernel_device)
    assert _generate(tiny_model, tiny_adapters, "triton", kernel_device) == expected


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    assert select_backend("triton", torch.device("cpu")).name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"))
