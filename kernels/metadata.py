"""Per-step metadata the kernels read: which tokens use which adapter, and where KV rows live.

Built once per step by the worker's runner (on the compute device) and passed into every layer;
no kernel keeps state between steps. The tensors are views of `kernels.step_buffers.StepBuffers`,
storage refilled in place each step, so they are valid until the next step is built. See
`loraserve.worker.pool_layout` for the pool geometry these tables index into, and
`loraserve.model_config.LORA_MODULES` for the order of the per-module tables (module m is
LORA_MODULES[m]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatch:
    """Segments of tokens that share an adapter, and the adapters' rows in the pool.

    Tokens [seg_start[s], seg_start[s] + seg_len[s]) use adapter seg_adapter[s] (an index into the
    per-adapter tables). Tokens in no segment use no adapter. Segments are disjoint and sorted.

    Per adapter a (A adapters in the step, M = 7 modules, L layers):
      rank[a], scale[a]          LoRA rank and PEFT scale (alpha / r or alpha / sqrt(r))
      page_table[a, :]           the adapter's pages; logical row l is at physical row
                                 page_table[a, l // rows_per_page] * rows_per_page + l % rows_per_page
      a_offset[a, m], b_offset[a, m]   first logical row of module m's A / B block (-1: not targeted)
      layer_active[a, layer]     0 where the adapter has no weights in that layer
    Per module m (same for every adapter): c_in[m], c_out[m] row chunks per rank vector; d_in[m],
    d_out[m] true widths.
    """

    seg_start: torch.Tensor  # int32 [S]
    seg_len: torch.Tensor  # int32 [S]
    seg_adapter: torch.Tensor  # int32 [S]
    token_adapter: torch.Tensor  # int32 [T]: adapter index of each token, -1 for none
    rank: torch.Tensor  # int32 [A]
    scale: torch.Tensor  # float32 [A]
    page_table: torch.Tensor  # int32 [A, max_pages]
    a_offset: torch.Tensor  # int32 [A, 7]
    b_offset: torch.Tensor  # int32 [A, 7]
    layer_active: torch.Tensor  # int32 [A, L]
    c_in: tuple[int, ...]  # [7]
    c_out: tuple[int, ...]  # [7]
    d_in: tuple[int, ...]  # [7]
    d_out: tuple[int, ...]  # [7]
    rows_per_page: int
    row_width: int
    max_seg_len: int
    # Host mirrors, so torch code and grid sizing never synchronize with the device.
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (start, length, adapter)
    ranks: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    a_offsets: list[list[int]] = field(default_factory=list)
    b_offsets: list[list[int]] = field(default_factory=list)
    layers_active: list[list[bool]] = field(default_factory=list)
    row_index: list[torch.Tensor] = field(default_factory=list)  # per adapter: int64 physical row of each logical row
    # Built lazily by a backend and reused by every layer of the step (index plans, per module).
    cache: dict = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.segments


@dataclass
class AttentionBatch:
    """Where each sequence's new tokens are in the step, and where its KV rows are in the pool.

    Sequence b's new (query) tokens are [query_start[b], query_start[b+1]) of the step; after the
    step its cache holds context_len[b] tokens, the new ones last, so new token i sits at position
    context_len[b] - query_len[b] + i. Token t of sequence b has its K vector at physical row
    page_table[b, t // tokens_per_page] * rows_per_page + t % tokens_per_page, V at that + tokens_per_page.
    """

    query_start: torch.Tensor  # int32 [B + 1]
    context_len: torch.Tensor  # int32 [B]
    page_table: torch.Tensor  # int32 [B, max_pages]
    new_rows: torch.Tensor  # int64 [T]: K row of every new token
    tokens_per_page: int
    max_query_len: int
    max_context_len: int
    sliding_window: int | None = None
    # Host mirrors
    query_starts: list[int] = field(default_factory=list)  # [B + 1]
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    # Lazily built by the torch path: K rows of every key position, padded per group.
    cache: dict = field(default_factory=dict)

    @property
    def rows_per_page(self) -> int:
        return 2 * self.tokens_per_page
