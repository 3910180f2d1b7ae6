"""Building a step's kernel metadata from plain data: the one builder the runner and the kernel tests share.

    lora = build_lora_batch(geometry, [(adapter_or_None, num_tokens), ...], device)
    attention = build_attention_batch([(kv_page_table, start, num_tokens), ...], tokens_per_page, window, device)

Sequences are given in step order. For LoRA, consecutive sequences of one adapter merge into one
segment (Punica's SGMV segments) and the per-adapter tables list each adapter once, in order of
first use; adapters are told apart by identity, so pass the same object for the same adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraserve.kernels.metadata import MODULES, AttentionBatch, LoraBatch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LoraGeometry:
    """Widths of the 7 projections (MODULES order) and the pool's row/page shape."""

    d_in: tuple[int, ...]
    d_out: tuple[int, ...]
    row_width: int
    rows_per_page: int
    num_layers: int = 1

    @classmethod
    def uniform(cls, d_in: int, d_out: int, row_width: int, rows_per_page: int, num_layers: int = 1):
        """Every module maps d_in -> d_out (enough for kernel tests, which run one module at a time)."""
        n = len(MODULES)
        return cls((d_in,) * n, (d_out,) * n, row_width, rows_per_page, num_layers)

    @property
    def c_in(self) -> tuple[int, ...]:
        return tuple(ceil_div(d, self.row_width) for d in self.d_in)

    @property
    def c_out(self) -> tuple[int, ...]:
        return tuple(ceil_div(d, self.row_width) for d in self.d_out)


class PooledAdapter(Protocol):
    """An adapter's place in the pool, as the LoRA kernels index it."""

    rank: int
    scale: float
    pages: Sequence[int] | torch.Tensor  # its pages, in logical order
    a_offsets: Sequence[int]  # [7]: first logical row of each module's A block, -1 if not targeted
    b_offsets: Sequence[int]
    layers: Sequence[bool]  # [L]: it has weights in that layer
    row_index: torch.Tensor  # int64 [num_rows]: physical row of each logical row


def build_lora_batch(
    geometry: LoraGeometry, seqs: Sequence[tuple[PooledAdapter | None, int]], device: torch.device | str
) -> LoraBatch | None:
    """LoraBatch for sequences of (adapter or None, tokens this step); None when no token uses an adapter."""
    adapters: list[PooledAdapter] = []
    index: dict[int, int] = {}  # id(adapter) -> its row in the per-adapter tables
    segments: list[tuple[int, int, int]] = []
    token_adapter: list[int] = []
    start = 0
    for adapter, n in seqs:
        if n == 0:
            continue
        if adapter is None:
            token_adapter += [-1] * n
        else:
            a = index.setdefault(id(adapter), len(adapters))
            if a == len(adapters):
                adapters.append(adapter)
            if segments and segments[-1][2] == a and segments[-1][0] + segments[-1][1] == start:
                segments[-1] = (segments[-1][0], segments[-1][1] + n, a)
            else:
                segments.append((start, n, a))
            token_adapter += [a] * n
        start += n
    if not segments:
        return None

    def i32(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    page_table = torch.zeros(len(adapters), max(len(a.pages) for a in adapters), dtype=torch.int32, device=device)
    for a, adapter in enumerate(adapters):
        page_table[a, : len(adapter.pages)] = torch.as_tensor(adapter.pages, dtype=torch.int32, device=device)
    a_offsets = [list(a.a_offsets) for a in adapters]
    b_offsets = [list(a.b_offsets) for a in adapters]
    layers = [[bool(x) for x in a.layers] for a in adapters]
    return LoraBatch(
        seg_start=i32([s for s, _, _ in segments]),
        seg_len=i32([n for _, n, _ in segments]),
        seg_adapter=i32([a for _, _, a in segments]),
        token_adapter=i32(token_adapter),
        rank=i32([a.rank for a in adapters]),
        scale=torch.tensor([a.scale for a in adapters], dtype=torch.float32, device=device),
        page_table=page_table,
        a_offset=i32(a_offsets),
        b_offset=i32(b_offsets),
        layer_active=i32(layers),
        c_in=geometry.c_in,
        c_out=geometry.c_out,
        d_in=geometry.d_in,
        d_out=geometry.d_out,
        rows_per_page=geometry.rows_per_page,
        row_width=geometry.row_width,
        max_seg_len=max(n for _, n, _ in segments),
        segments=segments,
        ranks=[a.rank for a in adapters],
        scales=[a.scale for a in adapters],
        a_offsets=a_offsets,
        b_offsets=b_offsets,
        layers_active=layers,
        row_index=[a.row_index for a in adapters],
    )


def build_attention_batch(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    tokens_per_page: int,
    sliding_window: int | None,
    device: torch.device | str,
) -> AttentionBatch:
    """AttentionBatch for sequences of (KV page table, tokens already cached, new tokens this step)."""
    tp, rpp = tokens_per_page, 2 * tokens_per_page
    query_start, context, tables, new_rows = [0], [], [], []
    for table, start, n in seqs:
        query_start.append(query_start[-1] + n)
        context.append(start + n)
        tables.append(list(table))
        new_rows += [table[p // tp] * rpp + p % tp for p in range(start, start + n)]
    width = max(len(t) for t in tables)
    return AttentionBatch(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_len=torch.tensor(context, dtype=torch.int32, device=device),
        page_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        new_rows=torch.tensor(new_rows, dtype=torch.int64, device=device),
        tokens_per_page=tp,
        max_query_len=max(n for _, _, n in seqs),
        max_context_len=max(context),
        sliding_window=sliding_window,
        query_starts=query_start,
        query_lens=[n for _, _, n in seqs],
        context_lens=context,
    )
