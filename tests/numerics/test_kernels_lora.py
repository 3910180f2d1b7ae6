"""Triton batched LoRA against the torch reference and a float32 dense recomputation.

Sweeps (punica style): ranks {1, 4, 8, 16, 64, 128} mixed in one launch; adapter popularity
distinct / uniform / zipf / identical; tokens without adapter; pages in random order; widths that
are not multiples of the row width nor of the block; decode steps, prefill steps and mixed steps;
both kernel paths (token = MBGMV/BGMV, segment = MBGMM/SGMV) and split reductions.

Every test that runs a kernel takes `kernel_device` (conftest): on a machine without CUDA the
kernels run in Triton's interpreter on CPU tensors (milliseconds per program), so shapes are small;
with CUDA the same tests run compiled on the GPU (marked `gpu`), and `test_gpu_sweep_h4096` repeats
the sweep at h = 4096 in float16 and bfloat16.

Tolerance (absolute and relative, on y after the update; the dense reference computes in float32
from the weights as the pool stores them): see TOL below. float16 / bfloat16 carry the rounding of
y itself (|y| ~ 1-10) and of the rank vector the reference rounds to the input dtype.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import needs_cuda

from loraserve.bench.common.kernel_cases import (
    POPULARITIES,
    LoraGeometry,
    SyntheticAdapter,
    adapters_used,
    assign_adapters,
    make_lora_plan,
    make_lora_pool,
)
from loraserve.kernels.batch import ONE_MODULE_GROUPS, build_lora_plan
from loraserve.kernels.graph_tables import graph_lora_plan
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch
from loraserve.kernels.lora_triton import lora_apply_triton, prepare_lora_triton, prepare_lora_triton_graph
from loraserve.kernels.metadata import LoraPlan
from loraserve.kernels.step_buffers import StepBuffers, StepCapacity
from loraserve.model_config import LORA_MODULES

TOL = {  # dtype -> (atol, rtol)
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 1e-2),
    torch.bfloat16: (1e-1, 2e-2),
}
RANKS = [1, 4, 8, 16, 64, 128, 4, 16]  # adapter i has rank RANKS[i]: every rank mixed in one launch
ALL = tuple(range(len(LORA_MODULES)))
# d_in = 48 and d_out = 80 with 32-wide rows: 2 and 3 chunks, the last half / partly padded.
SMALL = LoraGeometry.uniform(48, 80, row_width=32, rows_per_page=4, num_layers=2)
# 48-wide rows (not a power of two: blocks are masked inside a row), d_in 80, d_out 40.
ODD_ROW = LoraGeometry.uniform(80, 40, row_width=48, rows_per_page=6, num_layers=2)

gpu = pytest.mark.gpu


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def dense_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    adapters: list[SyntheticAdapter],
    requests: list[tuple[int | None, int]],
    plan: LoraPlan,
    layer: int,
    module: int,
) -> torch.Tensor:
    """float32: y[t] + x[t] @ A^T @ B * scale, straight from the adapters' original matrices."""
    out, x32 = y.float().clone(), x.float()
    used = adapters_used(requests)
    for t, a in enumerate(plan.tables.token_adapter.tolist()):
        adapter = adapters[used[a]] if a >= 0 else None
        if adapter is None or (layer, module) not in adapter.weights:
            continue
        a_w, b_w = (w.to(x.device) for w in adapter.weights[(layer, module)])
        out[t] += (x32[t] @ a_w.t()) @ b_w * adapter.scale
    return out


def _requests(popularity: str, num_requests: int, tokens: list[int], seed: int) -> list[tuple[int | None, int]]:
    """Requests of `tokens[i % len]` tokens each, adapters by popularity, every third one base-only."""
    assigned = assign_adapters(popularity, num_requests, seed=seed)
    return [(None if i % 3 == 2 else assigned[i], tokens[i % len(tokens)]) for i in range(num_requests)]


def _run_both(
    geometry: LoraGeometry,
    pool: torch.Tensor,
    adapters: list[SyntheticAdapter],
    requests: list[tuple[int | None, int]],
    dtype: torch.dtype,
    layer: int,
    module: int,
    paths: tuple[str, ...] = ("token", "segment"),
    splits: int | None = None,
    seed: int = 0,
) -> None:
    device = pool.device
    plan = make_lora_plan(geometry, adapters, requests, device=device)
    assert plan is not None
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(n for _, n in requests)
    x = torch.randn(num_tokens, geometry.d_in[module], generator=g).to(device=device, dtype=dtype)
    y0 = torch.randn(num_tokens, geometry.d_out[module], generator=g).to(device=device, dtype=dtype)
    reference = y0.clone()
    lora_apply_torch(
        (reference,), x, pool[layer], replace(plan, prepared=prepare_lora_torch(plan, dtype)), layer, module
    )
    dense = dense_reference(y0, x, adapters, requests, plan, layer, module)
    untouched = plan.tables.token_adapter < 0
    for path in paths:
        y = y0.clone()
        prepared = prepare_lora_triton(plan, dtype, path=path, splits=splits)
        lora_apply_triton(y, x, pool[layer], replace(plan, prepared=prepared), layer, module)
        _close(y, reference, dtype)
        _close(y, dense, dtype)
        assert torch.equal(y[untouched], y0[untouched]), f"{path}: a token without adapter changed"


@pytest.fixture(scope="module", params=[torch.float32, torch.float16], ids=["fp32", "fp16"])
def small_pool(request, kernel_device: str):
    pool, adapters = make_lora_pool(SMALL, RANKS, [ALL] * len(RANKS), request.param, device=kernel_device, seed=1)
    return request.param, pool, adapters


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_popularity_sweep(small_pool, popularity: str, phase: str):
    dtype, pool, adapters = small_pool
    tokens = [1] if phase == "decode" else [5, 1, 19, 2]  # prefill: mixed with decodes, one over 16
    requests = _requests(popularity, 8, tokens, seed=len(popularity))
    _run_both(SMALL, pool, adapters, requests, dtype, layer=1, module=LORA_MODULES.index("q_proj"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_row_width_not_a_power_of_two(dtype: torch.dtype, kernel_device: str):
    pool, adapters = make_lora_pool(ODD_ROW, RANKS[:6], [ALL] * 6, dtype, device=kernel_device, seed=2)
    requests = [(5, 3), (None, 2), (0, 1), (1, 1), (4, 17), (2, 1), (3, 2), (5, 1)]
    _run_both(ODD_ROW, pool, adapters, requests, dtype, layer=0, module=LORA_MODULES.index("down_proj"))


def test_modules_not_targeted_and_inactive_layers(kernel_device: str):
    """Each module: only adapters that target it, in layers where they have weights, change y."""
    geometry = LoraGeometry(
        d_in=(48, 48, 48, 64, 48, 48, 88),
        d_out=(64, 32, 32, 48, 88, 88, 48),  # q, k, v, o, gate, up, down of a small GQA model
        row_width=32,
        rows_per_page=8,
        num_layers=2,
    )
    targets = [(0, 2), ALL, (1, 3, 6), (4, 5, 6)]
    inactive = [(), (0,), (), (1,)]
    pool, adapters = make_lora_pool(
        geometry, [4, 16, 8, 64], targets, torch.float32, device=kernel_device, inactive_layers=inactive
    )
    requests = [(0, 2), (1, 1), (None, 1), (2, 3), (3, 1), (1, 2)]
    for module in range(len(LORA_MODULES)):
        for layer in (0, 1):
            _run_both(geometry, pool, adapters, requests, torch.float32, layer, module, seed=module)


@pytest.mark.parametrize("path", ["token", "segment"])
def test_split_reduction(path: str, kernel_device: str):
    pool, adapters = make_lora_pool(ODD_ROW, [8, 128, 1], [ALL] * 3, torch.float32, device=kernel_device, seed=3)
    requests = [(1, 2), (0, 1), (2, 4), (None, 1), (1, 1)]
    _run_both(ODD_ROW, pool, adapters, requests, torch.float32, 0, 2, paths=(path,), splits=2)


def test_nothing_to_do_leaves_y_untouched(kernel_device: str):
    device = kernel_device
    pool, adapters = make_lora_pool(
        SMALL, [4, 8], [(0,), (0,)], torch.float32, device=device, inactive_layers=[(1,), ()]
    )
    plan = make_lora_plan(SMALL, adapters, [(0, 2), (None, 1)], device, lambda p: prepare_lora_triton(p, torch.float32))
    assert plan is not None
    x, y0 = torch.randn(3, 48, device=device), torch.randn(3, 80, device=device)
    y = y0.clone()
    lora_apply_triton(y, x, pool[1], plan, 1, 0)  # adapter 0 has no weights in layer 1
    lora_apply_triton(y, x, pool[0], plan, 0, 3)  # no adapter targets o_proj
    assert torch.equal(y, y0)
    empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
    tables = replace(
        plan.tables, seg_start=empty_i32, seg_len=empty_i32, seg_adapter=empty_i32, token_adapter=empty_i32
    )
    empty = replace(plan, tables=tables, segments=[], max_seg_len=0, num_tokens=0)
    empty.prepared = prepare_lora_triton(empty, torch.float32)
    y = torch.zeros(0, 80, device=device)
    lora_apply_triton(y, torch.zeros(0, 48, device=device), pool[0], empty, 0, 0)  # an empty step
    assert make_lora_plan(SMALL, adapters, [(None, 3)], device=device) is None  # the runner passes none then


def test_rejects_bad_arguments(kernel_device: str):
    device = kernel_device
    pool, adapters = make_lora_pool(SMALL, [4], [ALL], torch.float32, device=device)
    batch = make_lora_plan(SMALL, adapters, [(0, 2)], device, lambda p: prepare_lora_triton(p, torch.float32))
    assert batch is not None
    x, y = torch.randn(2, 48, device=device), torch.randn(2, 80, device=device)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_apply_triton(y.half(), x, pool[0], batch, 0, 0)
    with pytest.raises(ValueError, match=r"expected x \[T, 48\]"):
        lora_apply_triton(y, torch.randn(2, 40, device=device), pool[0], batch, 0, 0)
    with pytest.raises(ValueError, match="tokens"):
        lora_apply_triton(torch.randn(3, 80, device=device), torch.randn(3, 48, device=device), pool[0], batch, 0, 0)
    with pytest.raises(ValueError, match="contiguous"):
        lora_apply_triton(y, x, pool[0].t().contiguous().t(), batch, 0, 0)
    with pytest.raises(ValueError, match="unit stride"):
        lora_apply_triton(y, torch.randn(48, 2, device=device).t(), pool[0], batch, 0, 0)
    with pytest.raises(ValueError, match="module index"):
        lora_apply_triton(y, x, pool[0], batch, 0, 7)
    with pytest.raises(ValueError, match="unknown path"):
        prepare_lora_triton(batch, torch.float32, path="bgmv")
    with pytest.raises(ValueError, match="not prepared for the triton backend"):
        lora_apply_triton(y, x, pool[0], replace(batch, prepared=None), 0, 0)
    if device == "cuda":  # CPU tensors are refused before they reach a kernel compiled for the GPU
        with pytest.raises(ValueError, match="one device"):
            lora_apply_triton(y.cpu(), x.cpu(), pool[0], batch, 0, 0)


@pytest.mark.parametrize("popularity", ["distinct", "zipf"])
def test_graph_launches_match_the_reference(small_pool, popularity: str):
    """The launches a captured decode step replays (`prepare_lora_triton_graph`: token path, rank
    block of the largest rank the engine accepts, every module and layer) over the capacity-wide
    graph views, with the step staged at fixed widths and padded with tokens of no adapter."""
    dtype, pool, adapters = small_pool
    device = pool.device
    requests = _requests(popularity, 6, [1], seed=4)
    bucket = 8
    pages = max(len(a.pages) for a in adapters)
    capacity = StepCapacity(
        max_tokens=16, max_seqs=16, max_seq_pages=1, max_adapters=16, max_adapter_pages=pages + 3, num_layers=2
    )
    buffers = StepBuffers(capacity, device)
    seqs = [(None if a is None else adapters[a], n) for a, n in requests] + [(None, 1)] * (bucket - len(requests))
    build_lora_plan(SMALL, seqs, buffers, groups=ONE_MODULE_GROUPS, fixed_width=True, fuse_shrinks=False)
    buffers.upload()
    graph = graph_lora_plan(SMALL, buffers, bucket, ONE_MODULE_GROUPS)
    graph.prepared = prepare_lora_triton_graph(graph, dtype, max_rank=128)
    shrinks = [p for group in graph.prepared for p in group]
    assert len(shrinks) == len(LORA_MODULES)
    assert {p.path for p in shrinks} == {"token"} and {p.block_r for p in shrinks} == {128}
    plan = make_lora_plan(SMALL, adapters, requests, device=device)
    g = torch.Generator().manual_seed(5)
    for module in (LORA_MODULES.index("q_proj"), LORA_MODULES.index("down_proj")):
        x = torch.randn(bucket, 48, generator=g).to(device=device, dtype=dtype)
        y0 = torch.randn(bucket, 80, generator=g).to(device=device, dtype=dtype)
        y = y0.clone()
        lora_apply_triton(y, x, pool[1], graph, 1, module)
        real = len(requests)
        dense = dense_reference(y0[:real], x[:real], adapters, requests, plan, 1, module)
        _close(y[:real], dense, dtype)
        assert torch.equal(y[real:], y0[real:]), "a pad changed"


# ---- on a GPU: the same sweep at real sizes ------------------------------------------------------
REAL = LoraGeometry.uniform(4096, 4096, row_width=1024, rows_per_page=32, num_layers=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_gpu_sweep_h4096(dtype: torch.dtype, popularity: str, phase: str):
    ranks = [8, 16, 32, 64, 128, 1, 4] * 5
    pool, adapters = make_lora_pool(REAL, ranks, [(0,)] * len(ranks), dtype, device="cuda", seed=4)
    tokens = [1] if phase == "decode" else [300, 1, 17, 64]
    requests = _requests(popularity, 32, tokens, seed=5)
    _run_both(REAL, pool, adapters, requests, dtype, layer=0, module=0, paths=("auto", "token", "segment"))
