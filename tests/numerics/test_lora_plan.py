"""The step's LoRA plan and the torch path it prepares: one plan per step, applied per projection group.

Checked against a float32 dense recomputation from the adapters' own matrices: popularity
patterns, mixed ranks, adapters targeting different modules of one group, inactive layers,
base-only tokens, decode and prefill lengths; the step in any order (index tables) and in the
runner's order (`lora_order`: contiguous spans, updated in place); the engine's pool layout (A
blocks of a group stacked) and a module-by-module one. Then the engine's greedy tokens in both
orders, and an adapter with non-finite weights sharing a bucket with healthy ones. The test pool holds
some adapters' rows at half precision (bfloat16 and float16, two to a float32 row), as `--adapter-dtype` does;
the dense reference uses their rounded weights.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from loraserve.bench.common.kernel_cases import (
    LoraGeometry,
    adapters_used,
    assign_adapters,
    make_lora_plan,
    make_lora_pool,
)
from loraserve.kernels import lora_cpu, lora_torch
from loraserve.kernels.batch import FUSED_SHRINK_MAX_RANK, ReusePrepared, lora_order
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch
from loraserve.kernels.lora_triton import lora_apply_triton_group, prepare_lora_triton
from loraserve.model_config import LORA_GROUPS

# q/k/v, o, gate/up, down of a small GQA model, 32-wide rows: chunks that are partly padding.
GEOMETRY = LoraGeometry(
    d_in=(48, 48, 48, 64, 48, 48, 88),
    d_out=(64, 32, 32, 48, 88, 88, 48),
    row_width=32,
    rows_per_page=4,
    num_layers=2,
)
RANKS = [1, 4, 8, 16, 64, 4, 16, 8, 2, 32, 8, 4]
ALL = (0, 1, 2, 3, 4, 5, 6)
CONSECUTIVE = tuple(range(0, len(RANKS), 3))  # adapters on consecutive pages in the test pool
MODULES = [ALL] * 9 + [(1, 2), (0, 2, 6), (0, 4, 3)]  # the last three target parts of groups
HALF_ROWS = {1: torch.bfloat16, 3: torch.bfloat16, 7: torch.bfloat16, 2: torch.float16, 6: torch.float16}


def _dense(ys, x, adapters, requests, plan, layer, group):
    used, outs = adapters_used(requests), [y.clone() for y in ys]
    for t, a in enumerate(plan.tables.token_adapter.tolist()):
        for out, module in zip(outs, LORA_GROUPS[group], strict=True):
            if a >= 0 and (layer, module) in adapters[used[a]].weights:
                a_w, b_w = adapters[used[a]].weights[(layer, module)]
                out[t] += (x[t] @ a_w.t()) @ b_w * adapters[used[a]].scale
    return outs


def _every_group_matches_dense(apply, weights, adapters, requests, plan, device, seed: int) -> None:
    """`apply` (a backend's group apply) on random x and y, every layer and group, against `_dense`."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(k for _, k in requests)
    for layer in range(GEOMETRY.num_layers):
        pool_layer = weights[layer].to(device)
        for group, modules in enumerate(LORA_GROUPS):
            x = torch.randn(tokens, GEOMETRY.d_in[modules[0]], generator=g)
            ys = [torch.randn(tokens, GEOMETRY.d_out[m], generator=g) for m in modules]
            expected = _dense(ys, x, adapters, requests, plan, layer, group)
            on_device = [y.to(device) for y in ys]
            apply(on_device, x.to(device), pool_layer, plan, layer, group)
            for y, e in zip(on_device, expected, strict=True):
                torch.testing.assert_close(y.cpu(), e, atol=1e-4, rtol=1e-4)


@functools.cache
def _pool(stacked: bool, half_rows: bool):
    inactive = [()] * 11 + [(1,)]
    return make_lora_pool(  # every third adapter on consecutive pages: read in place when large enough
        GEOMETRY,
        RANKS,
        MODULES,
        torch.float32,
        seed=5,
        inactive_layers=inactive,
        stacked=stacked,
        consecutive=CONSECUTIVE,
        row_dtypes=HALF_ROWS if half_rows else None,
    )


@pytest.fixture(scope="module", params=[True, False], ids=["stacked", "by-module"])
def pool(request):
    """The torch path's pool: some adapters at half precision."""
    return _pool(request.param, True)


@pytest.fixture(scope="module", params=[True, False], ids=["stacked", "by-module"])
def float32_pool(request):
    """The Triton path's pool: every adapter at the pool's dtype (the Triton kernels read no half rows)."""
    return _pool(request.param, False)


def _ordered(requests):
    order = lora_order(
        [a for a, _ in requests], [0 if a is None else RANKS[a] for a, _ in requests], [n for _, n in requests]
    )
    return [requests[i] for i in order]


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical"])
@pytest.mark.parametrize("lengths", [[1], [1, 2, 3], [1, 1, 12, 1, 30]], ids=["decode", "short", "mixed"])
@pytest.mark.parametrize("order", ["as-given", "runner"])
@pytest.mark.parametrize("reads", ["gathered", "in-place"])
@pytest.mark.parametrize("path", ["torch", "c"])
def test_groups_match_dense(pool, popularity, lengths, order, reads, path, monkeypatch):
    """Gathered: every bucket's rows copied out of the pool; in place: every adapter whose rows for a group lie in
    runs of the pool gets a bucket of its own that reads them there (`lora_torch._Tile.direct`). Path c: torch on
    one thread, so buckets of a few tokens per tile run `lora_cpu`'s C kernel, which reads the rows where they lie
    in both cases (the plan's tables name them)."""
    monkeypatch.setattr(lora_torch, "DIRECT_MIN_BYTES", 0 if reads == "in-place" else 2**62)
    in_c, apply_bucket = [], lora_cpu.apply_bucket
    monkeypatch.setattr(lora_cpu, "apply_bucket", lambda b, *args: in_c.append(b.t) or apply_bucket(b, *args))
    weights, adapters = pool
    n = 24
    assigned = assign_adapters(popularity, n, seed=2)
    requests = [(None if i % 5 == 4 else assigned[i] % len(RANKS), lengths[i % len(lengths)]) for i in range(n)]
    if order == "runner":
        requests = _ordered(requests)
    plan = make_lora_plan(
        GEOMETRY, adapters, requests, prepare=lambda p: prepare_lora_torch(p, torch.float32), groups=LORA_GROUPS
    )
    assert plan is not None
    spans = [b.span is not None for buckets in plan.prepared for b in buckets]
    if order == "runner":
        assert all(spans), "in the runner's order every bucket is a span of the step"
    in_place = [isinstance(b.a_rows, slice) for buckets in plan.prepared for b in buckets]
    uses_consecutive = any(a is not None and a in CONSECUTIVE for a, _ in requests)
    assert any(in_place) == (reads == "in-place" and uses_consecutive)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if path == "c" else max(threads, 2))
    try:
        _every_group_matches_dense(lora_apply_torch, weights, adapters, requests, plan, "cpu", seed=1)
    finally:
        torch.set_num_threads(threads)
    short_tiles = any(b.t <= lora_cpu.MAX_TILE_TOKENS for buckets in plan.prepared for b in buckets)
    assert bool(in_c) == (path == "c" and short_tiles) and max(in_c, default=1) <= lora_cpu.MAX_TILE_TOKENS


@pytest.mark.parametrize("lengths", [[1], [1, 1, 12, 1, 3]], ids=["decode", "mixed"])
@pytest.mark.parametrize("ranks", ["small", "all"])
def test_triton_groups_match_dense(float32_pool, lengths, ranks, kernel_device):
    """The Triton path per group: one shrink for a group whose A blocks every adapter stacks (at
    most FUSED_SHRINK_MAX_RANK rows each), else one per module; either way the dense result."""
    weights, adapters = float32_pool
    stacked = adapters[0].a_offsets[1] == adapters[0].a_offsets[0] + RANKS[0] * GEOMETRY.c_in[0]
    usable = [a for a, r in enumerate(RANKS) if ranks == "all" or r <= 32]
    assigned = assign_adapters("uniform", 16, seed=3)
    requests = [
        (None if i % 5 == 4 else usable[assigned[i] % len(usable)], lengths[i % len(lengths)]) for i in range(16)
    ]
    if ranks == "all":
        requests[0] = (RANKS.index(64), 1)  # q/k/v of rank 64 stacked: 192 rows, more than one shrink takes
    requests = _ordered(requests)
    plan = make_lora_plan(
        GEOMETRY,
        adapters,
        requests,
        kernel_device,
        lambda p: prepare_lora_triton(p, torch.float32),
        groups=LORA_GROUPS,
    )
    assert plan is not None
    singles = tuple((m,) for group in LORA_GROUPS for m in group)
    if not stacked:
        assert plan.shrinks == singles
    elif ranks == "small":
        assert plan.shrinks == LORA_GROUPS  # q/k/v and gate/up: one shrink each
    else:
        assert plan.shrinks == ((0,), (1,), (2,), (3,), (4, 5), (6,)) and FUSED_SHRINK_MAX_RANK >= 64 * 2
    _every_group_matches_dense(lora_apply_triton_group, weights, adapters, requests, plan, kernel_device, seed=4)


def test_lora_order_groups_adapters_and_puts_base_last():
    adapters = ["b", None, "a", "b", "c", None, "a", "c"]
    ranks = [8, 0, 16, 8, 8, 0, 16, 8]
    tokens = [1, 1, 1, 1, 5, 1, 1, 1]
    order = lora_order(adapters, ranks, tokens)
    assert sorted(order) == list(range(len(adapters)))
    seq = [adapters[i] for i in order]
    assert seq[-2:] == [None, None]
    for a in ("a", "b", "c"):  # each adapter's sequences side by side
        where = [i for i, s in enumerate(seq) if s == a]
        assert where == list(range(where[0], where[0] + len(where)))
    assert seq[:4] == ["b", "b", "c", "c"] and seq[4:6] == ["a", "a"]  # rank 8 first; b and c of equal tokens...
    assert order[:2] == [0, 3]  # ...in order of first appearance


def test_a_non_finite_adapter_poisons_only_its_own_tokens():
    weights, adapters = make_lora_pool(GEOMETRY, [8, 8, 8], [ALL] * 3, torch.float32, seed=3, stacked=True)
    rows = adapters[1].row_index
    weights[:, rows] = float("nan")  # adapter 1: every weight NaN, in a bucket with adapters 0 and 2
    requests = [(0, 1), (1, 1), (2, 1), (None, 1)]
    plan = make_lora_plan(
        GEOMETRY, adapters, requests, prepare=lambda p: prepare_lora_torch(p, torch.float32), groups=LORA_GROUPS
    )
    assert plan is not None and len(plan.prepared[0]) == 1  # one bucket: all three adapters in one bmm
    x = torch.randn(4, 48)
    ys = [torch.zeros(4, d) for d in (64, 32, 32)]
    lora_apply_torch(ys, x, weights[0], plan, 0, 0)
    for y in ys:
        assert torch.isnan(y[1]).all()
        assert torch.isfinite(y[[0, 2, 3]]).all()
        assert torch.equal(y[3], torch.zeros_like(y[3]))


def test_engine_tokens_identical_in_any_step_order(monkeypatch):
    """The runner's order (spans, in place) and the scheduler's own (index tables) give the same tokens."""
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.demo.assets import DEMO_MODEL_DIR
    from loraserve.worker import runner
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine, GenerateRequest
    from loraserve.worker.sampling import SamplingParams

    synthetic = SyntheticAdapters(DEMO_MODEL_DIR, seed=9, std=0.2, target_modules=("q_proj", "v_proj", "up_proj"))
    files = {f"a{i}": synthetic.files(f"a{i}", (4, 8, 16, 32)[i % 4]) for i in range(12)}
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    requests = [
        GenerateRequest(prompt_ids=[1, 20 + i, 7, 300 - i, 9][: 3 + i % 3], adapter=f"a{i % 12}", sampling=greedy)
        for i in range(14)
    ] + [GenerateRequest(prompt_ids=[3, 4, 5], sampling=greedy)]

    def run() -> list[list[int]]:
        engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=512))
        for name, (config, tensors) in files.items():
            engine.register_adapter(name, config_json=config, weights=tensors)
        return [r.token_ids for r in engine.generate(requests)]

    ordered = run()
    monkeypatch.setattr(runner, "lora_order", lambda adapters, ranks, tokens: list(range(len(adapters))))
    assert run() == ordered
    assert math.prod(len(t) for t in ordered) > 0


def test_prepared_work_is_reused_only_for_an_unchanged_plan():
    _, adapters = make_lora_pool(GEOMETRY, [8, 16, 8], [ALL] * 3, torch.float32, seed=4, stacked=True)
    calls = []
    prepare = ReusePrepared(lambda p: calls.append(p) or prepare_lora_torch(p, torch.float32))
    requests = [(0, 1), (1, 1), (2, 1), (None, 1)]
    first = make_lora_plan(GEOMETRY, adapters, requests, prepare=prepare, groups=LORA_GROUPS)
    again = make_lora_plan(GEOMETRY, adapters, requests, prepare=prepare, groups=LORA_GROUPS)
    assert again.prepared is first.prepared and len(calls) == 1  # a steady decode step: nothing re-planned
    changed = [
        [(0, 1), (1, 1), (2, 1), (None, 2)],  # more tokens without adapter
        [(0, 2), (1, 1), (2, 1), (None, 1)],  # more tokens of one adapter
        [(1, 1), (0, 1), (2, 1), (None, 1)],  # another order
    ]
    for other in changed:
        plan = make_lora_plan(GEOMETRY, adapters, other, prepare=prepare, groups=LORA_GROUPS)
        assert plan.prepared is not first.prepared
    moved = [dict(vars(a)) for a in adapters]
    moved[2]["pages"] = list(reversed(moved[2]["pages"]))  # the same adapter copied into other pages
    moved_adapters = [type(a)(**m) for a, m in zip(adapters, moved, strict=True)]
    plan = make_lora_plan(GEOMETRY, moved_adapters, requests, prepare=prepare, groups=LORA_GROUPS)
    assert plan.prepared is not first.prepared
    scaled = [type(a)(**{**vars(a), "scale": a.scale * 2}) for a in adapters]
    assert make_lora_plan(GEOMETRY, scaled, requests, prepare=prepare, groups=LORA_GROUPS).prepared is not plan.prepared
