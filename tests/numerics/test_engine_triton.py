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


def _compile_keys(kernel, calls: list[tuple[tuple, dict]]) -> tuple[set, set]:
    """(Triton's compile-cache keys for a CUDA target, the configurations allowed to select one).

    The keys come from Triton's own argument binder (what `JITFunction.run` looks up compiled
    kernels by), built for an sm_90 target, so this runs without a GPU too. Allowed: the
    constexpr block sizes, and the row strides of activations, fixed by the model's widths (here
    64 and 88: a multiple of 16 or not). The page table's row stride changes every step.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    allowed = [p.is_constexpr or (p.name.startswith("stride_") and p.name != "stride_pt") for p in jit.params]
    keys, configs = set(), set()
    for args, kwargs in calls:
        specialization = binder(*args, **kwargs)[1]
        keys.add(repr(specialization))
        configs.add(repr([s for s, ok in zip(specialization, allowed, strict=True) if ok]))
    return keys, configs


def test_kernels_compile_once_per_block_configuration(tiny_model, tiny_adapters, kernel_device: str):
    """Steps of changing batch size, page-table width, layer and module reuse the compiled kernels.

    Only a kernel's constexpr block sizes may select a compiled variant: an integer argument that
    changes per step (token count, layer, module, ...) must not, or serving stalls for a compile of
    about a second each time a new pattern of them turns up (first seen on an H100: 1.6 s steps).
    """
    from loraserve.kernels import attention_triton, lora_triton

    kernels = [attention_triton._attention_kernel] + [
        getattr(lora_triton, f"_{op}_{path}_kernel") for op in ("shrink", "expand") for path in ("token", "segment")
    ]
    calls: dict[str, list] = {k.__name__: [] for k in kernels}
    hooks = []
    for kernel in kernels:
        hooks.append(lambda *args, _calls=calls[kernel.__name__], **kwargs: _calls.append((args, kwargs)))
        kernel.add_pre_run_hook(hooks[-1])
    try:
        _generate(tiny_model, tiny_adapters, "triton", kernel_device)
    finally:
        for kernel, hook in zip(kernels, hooks, strict=True):
            kernel.pre_run_hooks.remove(hook)
    for kernel in kernels:
        recorded = calls[kernel.__name__]
        assert recorded, f"{kernel.__name__} never ran"
        keys, configs = _compile_keys(kernel, recorded)
        assert len(keys) == len(configs), (
            f"{kernel.__name__}: {len(recorded)} launches in {len(configs)} block configurations need "
            f"{len(keys)} compiled variants"
        )
