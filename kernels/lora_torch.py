"""Batched LoRA over the unified pool, in plain torch: the reference and the CPU path.

    for each segment s (adapter a = seg_adapter[s], tokens t in the segment):
        if module m is targeted by a and a has weights in this layer:
            A = rows of a's A block for m, reassembled to [r, d_in]
            B = rows of a's B block for m, reassembled to [r, d_out]      (B here is lora_B^T)
            y[t] += ((x[t] @ A^T) @ B) * scale[a]

Shapes: x [T, d_in], y [T, d_out] (updated in place), pool_layer [rows, W].

Two ways to compute the same thing, neither padding ranks:
  segments  one gather of A and B and two matmuls per segment. Used for long segments (prefill
            chunks, many requests of one adapter) and when a step has few segments.
  pairs     short segments (decode tokens of many adapters), when there are many: one *pair* per
            token and rank vector, P = sum over tokens of their adapter's rank. Per layer:
                v[p] = x[token p] · A row(p)        (gathered rows, multiply and sum)
                y[token p] += v[p] * scale[p] * B row(p)      (one index_add over all pairs)
            The pairs' row indices depend only on the step and the module, so they are built once
            per step (cached in the batch) and every layer reuses them: on CPU each torch call
            costs microseconds, and a loop over segments × layers × modules dominated decode steps
            with many adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.kernels.metadata import LoraBatch

PAIRS_MIN_SEGMENTS = 4  # below this, a few per-segment matmuls cost less than building the pairs
# Segments up to this many tokens go through the pairs. A pair gathers its adapter's rows for its
# own token, so a segment of n tokens reads its weights n times: worth it for decode (n = 1) and
# short chunks, where the per-segment loop's call overhead dominates.
SHORT_SEGMENT = 8
# The pairs path gathers [P, d] temporaries; above this many elements it falls back to the loop
# (e.g. 512 short tokens of rank 128 adapters at d = 4096 would need 1 GiB in float32).
PAIRS_MAX_ELEMENTS = 1 << 24


def gather_lora_weights(
    pool_layer: torch.Tensor, batch: LoraBatch, adapter: int, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, d_in], B [r, d_out]) of one adapter's module, gathered from its pool rows."""
    r, w = batch.ranks[adapter], batch.row_width
    rows = batch.row_index[adapter]
    c_in, c_out = batch.c_in[module], batch.c_out[module]
    a_off, b_off = batch.a_offsets[adapter][module], batch.b_offsets[adapter][module]
    a = pool_layer.index_select(0, rows[a_off : a_off + r * c_in]).view(r, c_in * w)[:, : batch.d_in[module]]
    b = pool_layer.index_select(0, rows[b_off : b_off + r * c_out]).view(r, c_out * w)[:, : batch.d_out[module]]
    return a, b


@dataclass
class _Pairs:
    """Row indices of every (token, rank vector) pair of the short segments, for one module."""

    token: torch.Tensor  # int64 [P]
    a_rows: torch.Tensor  # int64 [P * c_in]: physical rows of each pair's A chunks
    b_rows: torch.Tensor  # int64 [P * c_out]
    weight: torch.Tensor  # [L, P]: scale of the pair's adapter, 0 in layers the adapter skips


@dataclass
class _Plan:
    pairs: _Pairs | None
    segments: list[tuple[int, int, int]]  # the ones the loop handles


def lora_apply_torch(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, batch: LoraBatch, layer: int, module: int
) -> None:
    plan = batch.cache.get(("lora_torch", module))
    if plan is None:
        plan = batch.cache[("lora_torch", module)] = _plan(batch, module, x.dtype)
    if plan.pairs is not None:
        _apply_pairs(y, x, pool_layer, batch, module, layer, plan.pairs)
    for start, length, adapter in plan.segments:
        if not batch.layers_active[adapter][layer]:
            continue
        a, b = gather_lora_weights(pool_layer, batch, adapter, module)
        end = start + length
        y[start:end] += ((x[start:end] @ a.t()) @ b) * batch.scales[adapter]


def _plan(batch: LoraBatch, module: int, dtype: torch.dtype) -> _Plan:
    targeted = [s for s in batch.segments if batch.a_offsets[s[2]][module] >= 0]
    short = [s for s in targeted if s[1] <= SHORT_SEGMENT]
    n_pairs = sum(length * batch.ranks[a] for _, length, a in short)
    width = max(batch.c_in[module], batch.c_out[module]) * batch.row_width
    if len(short) < PAIRS_MIN_SEGMENTS or n_pairs * width > PAIRS_MAX_ELEMENTS:
        return _Plan(None, targeted)
    return _Plan(_pairs(batch, module, short, dtype), [s for s in targeted if s[1] > SHORT_SEGMENT])


@dataclass
class _PairBase:
    """What every module's pairs share for one set of short segments: tokens, ranks, pages."""

    token: torch.Tensor  # int64 [P]
    j: torch.Tensor  # int64 [P]: the pair's rank vector
    adapter: torch.Tensor  # int64 [P]
    pages: torch.Tensor  # int64 [P, max_pages]
    weight: torch.Tensor  # [L, P]: scale of the pair's adapter, 0 in layers the adapter skips


def _pair_base(batch: LoraBatch, segments: list[tuple[int, int, int]], dtype: torch.dtype) -> _PairBase:
    key = ("lora_torch_pairs", tuple(segments))
    if key in batch.cache:
        return batch.cache[key]
    # Built from the host-side lists, then moved once: no device synchronisation.
    token = torch.cat([torch.arange(start, start + length) for start, length, _ in segments])
    adapter = torch.tensor([a for _, length, a in segments for _ in range(length)])
    rank = torch.tensor([batch.ranks[a] for _, length, a in segments for _ in range(length)])
    owner = torch.repeat_interleave(torch.arange(len(token)), rank)  # [P]: the pair's token
    j = torch.arange(len(owner)) - (torch.cumsum(rank, 0) - rank)[owner]
    device = batch.page_table.device
    pair_adapter = adapter[owner].to(device)
    pages = batch.page_table.index_select(0, pair_adapter).long()
    token, j = token[owner].to(device), j.to(device)
    scale = batch.scale.index_select(0, pair_adapter).to(dtype)
    weight = batch.layer_active.index_select(0, pair_adapter).t().to(dtype) * scale
    batch.cache[key] = base = _PairBase(token, j, pair_adapter, pages, weight)
    return base


def _pairs(batch: LoraBatch, module: int, segments: list[tuple[int, int, int]], dtype: torch.dtype) -> _Pairs:
    base = _pair_base(batch, segments, dtype)
    rpp = batch.rows_per_page

    def rows(offsets: torch.Tensor, chunks: int) -> torch.Tensor:
        first = offsets.index_select(0, base.adapter)[:, module] + base.j * chunks  # [P]
        logical = first[:, None] + torch.arange(chunks, device=first.device)  # [P, chunks]
        return (base.pages.gather(1, logical // rpp) * rpp + logical % rpp).view(-1)

    a_rows = rows(batch.a_offset.long(), batch.c_in[module])
    return _Pairs(base.token, a_rows, rows(batch.b_offset.long(), batch.c_out[module]), base.weight)


def _apply_pairs(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, batch: LoraBatch, module: int, layer: int, p: _Pairs
) -> None:
    n = len(p.token)
    a = pool_layer.index_select(0, p.a_rows).view(n, -1)[:, : batch.d_in[module]]  # [P, d_in]
    b = pool_layer.index_select(0, p.b_rows).view(n, -1)[:, : batch.d_out[module]]  # [P, d_out]
    v = (x.index_select(0, p.token) * a).sum(-1) * p.weight[layer]  # [P]
    y.index_add_(0, p.token, b * v[:, None])
