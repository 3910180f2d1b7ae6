"""Synthetic pools and per-step metadata for kernel tests and benchmarks (no model, no engine).

Adapters are packed exactly as `loraserve.pool_rows` lays them out, into pages drawn in
random order from the pool, and the metadata is built the way `loraserve.worker.runner` builds it:

    LoRA:  for adapter a, module m (LORA_MODULES order, targeted ones only), in a's logical rows:
               A block: r × c_in rows,  row j*c_in + c  = A[j, c*W : (c+1)*W]    (last chunk zero-padded)
               B block: r × c_out rows, row j*c_out + c = B[j, c*W : (c+1)*W]    (B = lora_B^T: [r, d_out])
           logical row l of a lives at physical row pages[a][l // R] * R + l % R.
    KV:    token p of sequence b: K row = page_table[b, p // tp] * 2tp + p % tp, V row = K row + tp.

The weights handed back are float32 copies of what the pool holds (already rounded to its dtype),
so a float32 dense recomputation from them is exact up to the kernels' arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.kernels import batch as step_batch
from loraserve.kernels.batch import ONE_MODULE_GROUPS, LoraGeometry, build_attention_batch, build_lora_plan, page_rows
from loraserve.kernels.batch import ceil_div as _ceil_div
from loraserve.kernels.metadata import AttentionBatch, LoraPlan
from loraserve.model_config import LORA_GROUPS, LORA_MODULES
from loraserve.pool_rows import block_offsets

POPULARITIES = ("distinct", "uniform", "zipf", "identical")


@dataclass
class SyntheticAdapter:
    """One packed adapter: its float32 weights per (layer, module) and its place in the pool."""

    rank: int
    scale: float
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (layer, m) -> (A [r, d_in], B [r, d_out])
    layers: list[bool]  # [L]: the adapter has weights in that layer
    a_offsets: list[int]  # [7]: first logical row of each module's A block, -1 if not targeted
    b_offsets: list[int]
    pages: list[int]
    row_index: torch.Tensor  # int64 [num_rows]: physical row of every logical row (of `rows_view(pool, row_dtype)`)
    row_dtype: torch.dtype | None = None  # its rows' dtype when not the pool's (half rows in a float32 pool)


def _chunk(matrix: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """[r, d] -> [r * chunks, width], each rank vector cut into rows, the last zero-padded."""
    r, d = matrix.shape
    padded = torch.zeros(r, chunks * width, dtype=matrix.dtype)
    padded[:, :d] = matrix
    return padded.reshape(r * chunks, width)


def _offsets(
    targeted: set[int], r: int, c_in: tuple[int, ...], c_out: tuple[int, ...], groups: tuple[tuple[int, ...], ...]
) -> tuple[list[int], list[int], int]:
    """(a_offsets, b_offsets, rows) of a rank-r adapter targeting these modules, laid out by the
    pool's rule (`pool_rows.block_offsets`) over `groups`; -1 for modules not targeted."""
    blocks, rows = block_offsets(targeted, r, c_in, c_out, groups)
    missing = (-1, -1)
    return (
        [blocks.get(m, missing)[0] for m in range(len(LORA_MODULES))],
        [blocks.get(m, missing)[1] for m in range(len(LORA_MODULES))],
        rows,
    )


def make_lora_pool(
    geometry: LoraGeometry,
    ranks: list[int],
    modules: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    inactive_layers: list[tuple[int, ...]] | None = None,
    spare_pages: int = 3,
    stacked: bool = False,
    consecutive: tuple[int, ...] = (),
    row_dtypes: dict[int, torch.dtype] | None = None,
) -> tuple[torch.Tensor, list[SyntheticAdapter]]:
    """A pool [L, pages * R, W] holding one adapter per rank, in scattered pages (those in `consecutive`:
    on consecutive pages, at the top of the pool); the rest is noise.

    modules[i]: module indices adapter i targets; inactive_layers[i]: layers where it has no weights;
    row_dtypes[i]: its weights rounded to this half type and held so (two rows to a pool row: `rows_view`).
    `stacked`: lay each adapter out as the engine's pool does, the A blocks of each group of
    `LORA_GROUPS` stacked; else module by module, A then B (any layout the offsets describe works).
    Weights are N(0, 1/d) so that x @ A^T @ B stays O(|x|) whatever the widths and ranks.
    """
    g = torch.Generator().manual_seed(seed)
    w, rpp, num_layers = geometry.row_width, geometry.rows_per_page, geometry.num_layers
    c_in, c_out = geometry.c_in, geometry.c_out
    packed: list[tuple[torch.Tensor, SyntheticAdapter]] = []
    for i, r in enumerate(ranks):
        targeted, row_dtype = set(modules[i]), (row_dtypes or {}).get(i)
        a_offsets, b_offsets, off = _offsets(targeted, r, c_in, c_out, LORA_GROUPS if stacked else ONE_MODULE_GROUPS)
        inactive = set(inactive_layers[i]) if inactive_layers else set()
        layers = [layer not in inactive for layer in range(num_layers)]
        rows = torch.zeros(num_layers, max(off, 1), w)
        weights = {}
        for layer in range(num_layers):
            if not layers[layer]:
                continue
            for m in sorted(targeted):
                a = (torch.randn(r, geometry.d_in[m], generator=g) / math.sqrt(geometry.d_in[m])).to(row_dtype or dtype)
                b = (torch.randn(r, geometry.d_out[m], generator=g) / math.sqrt(r)).to(row_dtype or dtype)
                weights[(layer, m)] = (a.float(), b.float())
                rows[layer, a_offsets[m] : a_offsets[m] + r * c_in[m]] = _chunk(a.float(), c_in[m], w)
                rows[layer, b_offsets[m] : b_offsets[m] + r * c_out[m]] = _chunk(b.float(), c_out[m], w)
        scale = 0.5 * (1 + i % 4)  # distinct per adapter, so a mixed-up scale shows
        adapter = SyntheticAdapter(r, scale, weights, layers, a_offsets, b_offsets, [], torch.empty(0), row_dtype)
        packed.append((rows, adapter))

    per_page = [rpp * step_batch.row_packing(dtype, adapter.row_dtype) for _, adapter in packed]
    need = [_ceil_div(rows.shape[1], k) for (rows, _), k in zip(packed, per_page, strict=True)]
    num_pages = sum(need) + spare_pages
    top = num_pages - sum(need[i] for i in consecutive)
    runs = {}
    for i in consecutive:
        runs[i], top = list(range(top, top + need[i])), top + need[i]
    order = torch.randperm(num_pages - sum(len(r) for r in runs.values()), generator=g).tolist()  # scattered
    pool = torch.randn(num_layers, num_pages * rpp, w, generator=g).to(dtype)  # noise where nothing lives
    for i, ((rows, adapter), n) in enumerate(zip(packed, need, strict=True)):
        if i in runs:
            adapter.pages = runs[i]
        else:
            adapter.pages, order = order[:n], order[n:]
        adapter.row_index = page_rows(adapter.pages, per_page[i])[: rows.shape[1]]
        view = step_batch.rows_view(pool, adapter.row_dtype)  # half-precision rows: two to a pool row
        view.index_copy_(1, adapter.row_index, rows.to(adapter.row_dtype or dtype))
    for _, adapter in packed:
        adapter.row_index = adapter.row_index.to(device)
    return pool.to(device), [adapter for _, adapter in packed]


def assign_adapters(popularity: str, num_requests: int, seed: int = 0) -> list[int]:
    """Adapter index of each request under punica's four popularity patterns.

    distinct: every request its own adapter; uniform: ceil(sqrt(n)) adapters, drawn uniformly;
    zipf: Zipf(1.5) over n adapters; identical: one adapter for all.
    """
    g = torch.Generator().manual_seed(seed)
    n = num_requests
    if popularity == "distinct":
        return list(range(n))
    if popularity == "identical":
        return [0] * n
    if popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        return torch.randint(0, k, (n,), generator=g).tolist()
    if popularity == "zipf":
        weights = torch.tensor([1.0 / (i + 1) ** 1.5 for i in range(n)])
        return torch.multinomial(weights, n, replacement=True, generator=g).tolist()
    raise ValueError(f"unknown popularity {popularity!r}; choose one of {', '.join(POPULARITIES)}")


def adapters_used(requests: list[tuple[int | None, int]]) -> list[int]:
    """Adapters the requests use, in order of first use: the LoRA plan's adapter a is adapters_used[a]."""
    return list(dict.fromkeys(a for a, n in requests if a is not None and n > 0))


def make_lora_plan(
    geometry: LoraGeometry,
    adapters: list[SyntheticAdapter],
    requests: list[tuple[int | None, int]],
    device: torch.device | str = "cpu",
    prepare: Callable[[LoraPlan], object] | None = None,
    groups: tuple[tuple[int, ...], ...] = ONE_MODULE_GROUPS,
) -> LoraPlan | None:
    """The LoRA plan of a step whose requests are (adapter index or None, tokens): the runner's own
    builder. `groups` default to one module per group (kernel tests apply one module at a time).

    Consecutive requests of one adapter merge into one segment; only adapters some request uses are
    in the per-adapter tables (renumbered in order of first use). None when no token uses an adapter.
    """
    seqs = [(None if a is None else adapters[a], n) for a, n in requests]
    return build_lora_plan(geometry, seqs, device, prepare, groups)


@dataclass
class AttentionCase:
    """A pool layer with every sequence's earlier context cached, and the step's new tokens."""

    pool_layer: torch.Tensor  # [pages * 2tp, H_kv * D]; earlier context written, new tokens not yet
    batch: AttentionBatch
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, H_kv * D]: new tokens' keys, for write_kv
    v: torch.Tensor  # [T, H_kv * D]
    keys: list[torch.Tensor]  # per sequence, float32 [context_len, H_kv, D]: every key, new ones included
    values: list[torch.Tensor]


def make_attention_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tokens_per_page: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    seed: int = 0,
    spare_pages: int = 2,
) -> AttentionCase:
    """seqs[b] = (context_len, query_len): the step adds query_len tokens after context_len - query_len."""
    g = torch.Generator().manual_seed(seed)
    tp, width = tokens_per_page, num_kv_heads * head_dim
    need = [_ceil_div(ctx, tp) for ctx, _ in seqs]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=g).tolist()
    pool = torch.randn(num_pages * 2 * tp, width, generator=g).to(dtype)  # noise in unused rows
    tables, keys, values, new_k, new_v, query_start = [], [], [], [], [], [0]
    for (ctx, q_len), n in zip(seqs, need, strict=True):
        if not 0 <= q_len <= ctx:
            raise ValueError(f"query_len {q_len} must lie in [0, context_len {ctx}]")
        table, order = order[:n], order[n:]
        k = torch.randn(ctx, width, generator=g).to(dtype)
        v = torch.randn(ctx, width, generator=g).to(dtype)
        rows = torch.tensor([table[p // tp] * 2 * tp + p % tp for p in range(ctx)], dtype=torch.int64)
        old = ctx - q_len
        pool[rows[:old]], pool[rows[:old] + tp] = k[:old], v[:old]
        tables.append(table)
        keys.append(k.float().view(ctx, num_kv_heads, head_dim))
        values.append(v.float().view(ctx, num_kv_heads, head_dim))
        new_k.append(k[old:])
        new_v.append(v[old:])
        query_start.append(query_start[-1] + q_len)
    q = torch.randn(query_start[-1], num_heads, head_dim, generator=g).to(dtype)
    starts = [(table, ctx - q_len, q_len) for table, (ctx, q_len) in zip(tables, seqs, strict=True)]
    batch = build_attention_batch(starts, tp, sliding_window, device)
    return AttentionCase(
        pool.to(device), batch, q.to(device), torch.cat(new_k).to(device), torch.cat(new_v).to(device), keys, values
    )


def make_bench_lora_pool(
    geometry: LoraGeometry,
    ranks: list[int],
    modules: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
    keep_weights: bool = False,
) -> tuple[torch.Tensor, list[SyntheticAdapter]]:
    """`make_lora_pool`'s layout, generated on `device`: fast at benchmark sizes (hundreds of adapters).

    Every adapter targets `modules` in every layer. Weights are N(0, 1/d_in) for A and N(0, 1/r) for B,
    drawn on the device in `dtype`; the pool's unused rows are noise. The adapters' float32 weights are
    kept only with keep_weights (tests); otherwise SyntheticAdapter.weights is empty.
    """
    dev = torch.device(device)
    g_host = torch.Generator().manual_seed(seed)
    g_dev = torch.Generator(device=dev).manual_seed(seed)
    w, rpp, num_layers = geometry.row_width, geometry.rows_per_page, geometry.num_layers
    c_in, c_out = geometry.c_in, geometry.c_out
    layouts = []
    for r in ranks:
        a_offsets, b_offsets, off = _offsets(set(modules), r, c_in, c_out, ONE_MODULE_GROUPS)
        layouts.append((a_offsets, b_offsets, max(off, 1)))
    need = [_ceil_div(rows, rpp) for _, _, rows in layouts]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=g_host).tolist()
    pool = torch.randn(num_layers, num_pages * rpp, w, generator=g_dev, device=dev, dtype=dtype)

    def chunked(matrix: torch.Tensor, chunks: int) -> torch.Tensor:
        padded = matrix.new_zeros(matrix.shape[0], chunks * w)
        padded[:, : matrix.shape[1]] = matrix
        return padded.view(matrix.shape[0] * chunks, w)

    adapters = []
    for i, (r, (a_offsets, b_offsets, rows), n) in enumerate(zip(ranks, layouts, need, strict=True)):
        pages, order = order[:n], order[n:]
        row_index = page_rows(pages, rpp)[:rows].to(dev)
        weights = {}
        for layer in range(num_layers):
            for m in sorted(modules):
                d_in, d_out = geometry.d_in[m], geometry.d_out[m]
                a = (torch.randn(r, d_in, generator=g_dev, device=dev) / math.sqrt(d_in)).to(dtype)
                b = (torch.randn(r, d_out, generator=g_dev, device=dev) / math.sqrt(r)).to(dtype)
                a_rows = row_index[a_offsets[m] : a_offsets[m] + r * c_in[m]]
                b_rows = row_index[b_offsets[m] : b_offsets[m] + r * c_out[m]]
                pool[layer].index_copy_(0, a_rows, chunked(a, c_in[m]))
                pool[layer].index_copy_(0, b_rows, chunked(b, c_out[m]))
                if keep_weights:
                    weights[(layer, m)] = (a.float(), b.float())
        scale = 0.5 * (1 + i % 4)
        adapters.append(
            SyntheticAdapter(r, scale, weights, [True] * num_layers, a_offsets, b_offsets, pages, row_index)
        )
    return pool, adapters


@dataclass
class UniformAttentionCase:
    """Sequences of one length, every token's K and V already in the pool, and the same K/V dense."""

    pool_layer: torch.Tensor  # [pages * 2tp, H_kv * D]
    batch: AttentionBatch
    q: torch.Tensor  # [B * query_len, H, D]: sequence b's queries are rows b*query_len ...
    keys: torch.Tensor  # [B, context_len, H_kv, D] (pool dtype): what the pool holds, contiguous
    values: torch.Tensor


def make_uniform_attention_case(
    num_seqs: int,
    context_len: int,
    query_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tokens_per_page: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_pages: int = 2,
) -> UniformAttentionCase:
    """`make_attention_case`'s layout for num_seqs sequences of (context_len, query_len), built on `device`.

    Unlike make_attention_case, the new tokens' K/V are written too (the step after write_kv), the
    keys and values come back dense in the pool's dtype (for a dense reference such as
    scaled_dot_product_attention), and the K/V are drawn on the device: GiBs take milliseconds. The
    metadata comes from the runner's builder, as in every other case.
        K row of token p of sequence b = page_table[b, p // tp] * 2tp + p % tp,  V row = K row + tp
    """
    if not 1 <= query_len <= context_len:
        raise ValueError(f"query_len {query_len} must lie in [1, context_len {context_len}]")
    dev = torch.device(device)
    g_host = torch.Generator().manual_seed(seed)
    g_dev = torch.Generator(device=dev).manual_seed(seed)
    tp, width = tokens_per_page, num_kv_heads * head_dim
    per_seq = _ceil_div(context_len, tp)
    num_pages = num_seqs * per_seq + spare_pages
    table = torch.randperm(num_pages, generator=g_host)[: num_seqs * per_seq].view(num_seqs, per_seq)
    pos = torch.arange(context_len, device=dev)
    k_rows = table.to(dev)[:, pos // tp].long() * (2 * tp) + pos % tp  # [B, context_len]
    pool = torch.randn(num_pages * 2 * tp, width, generator=g_dev, device=dev, dtype=dtype)
    shape = (num_seqs, context_len, num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=g_dev, device=dev, dtype=dtype)
    values = torch.randn(shape, generator=g_dev, device=dev, dtype=dtype)
    pool.index_copy_(0, k_rows.view(-1), keys.view(-1, width))
    pool.index_copy_(0, k_rows.view(-1) + tp, values.view(-1, width))
    q = torch.randn(num_seqs * query_len, num_heads, head_dim, generator=g_dev, device=dev, dtype=dtype)
    seqs = [(pages, context_len - query_len, query_len) for pages in table.tolist()]
    batch = build_attention_batch(seqs, tp, None, dev)
    return UniformAttentionCase(pool, batch, q, keys, values)
