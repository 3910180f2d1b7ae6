"""Batched LoRA over the unified pool, in plain torch: the reference and the CPU path.

    for each segment s (adapter a = seg_adapter[s], tokens t in the segment):
        if module m is targeted by a and a has weights in this layer:
            A = rows of a's A block for m, reassembled to [r, d_in]
            B = rows of a's B block for m, reassembled to [r, d_out]      (B here is lora_B^T)
            y[t] += ((x[t] @ A^T) @ B) * scale[a]

Shapes: x [T, d_in], y [T, d_out] (updated in place), pool_layer [rows, W].

Two ways to compute the same thing, chosen per call from the host mirrors:
  loop     one gather of A and B and two matmuls per segment; no padding. Used for long segments
           (prefill chunks) and when a step has few segments.
  grouped  short segments (decode tokens), when there are many: one gather of every segment's A
           rows and one of its B rows, padded to the largest rank, then two batched matmuls over
           [segments, longest short segment]. Padding repeats the last rank vector / token and is
           multiplied by zero. On CPU every torch call costs a few µs, so the loop spends ~50 µs
           per segment and module, which dominated decode steps with many adapters; the grouped
           path costs ~300 µs whatever the number of segments (plus the data it moves).
"""

from __future__ import annotations

import torch

from loraserve.kernels.metadata import LoraBatch

GROUP_MIN_SEGMENTS = 8  # below this, the loop's per-segment calls cost less than building the grouped gather
GROUP_MAX_LEN = 8  # segments longer than this run in the loop: padding them to the group would waste work


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


def lora_apply_torch(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, batch: LoraBatch, layer: int, module: int
) -> None:
    segments = [s for s in batch.segments if batch.a_offsets[s[2]][module] >= 0 and batch.layers_active[s[2]][layer]]
    short = [s for s in segments if s[1] <= GROUP_MAX_LEN]
    if len(short) >= GROUP_MIN_SEGMENTS:
        _apply_grouped(y, x, pool_layer, batch, module, short)
        segments = [s for s in segments if s[1] > GROUP_MAX_LEN]
    for start, length, adapter in segments:
        a, b = gather_lora_weights(pool_layer, batch, adapter, module)
        end = start + length
        y[start:end] += ((x[start:end] @ a.t()) @ b) * batch.scales[adapter]


def _apply_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    batch: LoraBatch,
    module: int,
    segments: list[tuple[int, int, int]],
) -> None:
    """The loop's arithmetic for S short segments at once, padded to the largest rank and segment."""
    device, n = x.device, len(segments)
    w, rpp = batch.row_width, batch.rows_per_page
    c_in, c_out, d_in, d_out = batch.c_in[module], batch.c_out[module], batch.d_in[module], batch.d_out[module]
    host = [
        (batch.ranks[a], batch.a_offsets[a][module], batch.b_offsets[a][module], a, start, length)
        for start, length, a in segments
    ]
    rank, a_off, b_off, adapter, start, length = torch.tensor(host, device=device).unbind(1)  # each [S]
    r_max, longest = max(h[0] for h in host), max(h[5] for h in host)
    ranks = torch.arange(r_max, device=device)
    j = torch.minimum(ranks, rank[:, None] - 1)  # [S, r_max]: rank j >= r repeats rank r - 1, zeroed by `keep`
    pages = batch.page_table.index_select(0, adapter).long()  # [S, max_pages]

    def gather(offset: torch.Tensor, chunks: int) -> torch.Tensor:
        """[S, r_max, chunks * W]: each segment's block of rank vectors, from the pool's rows."""
        logical = ((offset[:, None] + j * chunks)[:, :, None] + torch.arange(chunks, device=device)).view(n, -1)
        physical = pages.gather(1, logical // rpp) * rpp + logical % rpp
        return pool_layer.index_select(0, physical.view(-1)).view(n, r_max, chunks * w)

    a = gather(a_off, c_in)[:, :, :d_in]  # [S, r_max, d_in]
    b = gather(b_off, c_out)[:, :, :d_out]  # [S, r_max, d_out]
    keep = (ranks < rank[:, None]).to(x.dtype)[:, None, :]  # [S, 1, r_max]
    scale = batch.scale.index_select(0, adapter).to(x.dtype)[:, None, None]  # [S, 1, 1]
    if longest == 1:
        tokens = start  # [S]
    else:  # token i of segment s, i clamped to the segment: padding repeats its last token, times zero
        steps = torch.arange(longest, device=device)
        tokens = start[:, None] + torch.minimum(steps, length[:, None] - 1)  # [S, L]
        scale = scale * (steps < length[:, None]).to(x.dtype)[:, :, None]  # [S, L, 1]
    xs = x.index_select(0, tokens.view(-1)).view(n, -1, d_in)  # [S, L, d_in]
    out = torch.bmm(torch.bmm(xs, a.transpose(1, 2)) * keep, b) * scale  # [S, L, d_out]
    y.index_add_(0, tokens.view(-1), out.view(-1, d_out))
