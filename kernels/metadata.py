"""Per-step metadata the kernels read: which tokens use which adapter, and where KV rows live.

Built once per step by the worker's runner (on the compute device) and passed into every layer;
no kernel keeps state between steps. The tensors are views of `kernels.step_buffers.StepBuffers`,
storage refilled in place each step, so they are valid until the next step is built. See
`loraserve.worker.pool_layout` for the pool geometry these tables index into, and
`loraserve.model_config.LORA_MODULES` for the order of the per-module tables (module m is
LORA_MODULES[m]).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class LoraTables:
    """The step's LoRA tables on the compute device: what the Triton kernels read.

    Tokens [seg_start[s], seg_start[s] + seg_len[s]) use adapter seg_adapter[s] (an index into the
    per-adapter tables). Tokens in no segment use no adapter. Segments are disjoint and sorted.
    A adapters in the step, M = 7 modules (module m is LORA_MODULES[m]), L layers, S segments,
    T tokens. An adapter's logical row l is at physical row
    page_table[a, l // rows_per_page] * rows_per_page + l % rows_per_page.
    """

    seg_start: torch.Tensor  # int32 [S]
    seg_len: torch.Tensor  # int32 [S]
    seg_adapter: torch.Tensor  # int32 [S]
    token_adapter: torch.Tensor  # int32 [T]: adapter index of each token, -1 for none
    rank: torch.Tensor  # int32 [A]
    scale: torch.Tensor  # float32 [A]: PEFT scale, alpha / r or alpha / sqrt(r)
    page_table: torch.Tensor  # int32 [A, max_pages]: each adapter's pages, in logical order
    a_offset: torch.Tensor  # int32 [A, M]: first logical row of module m's A block, -1 if not targeted
    b_offset: torch.Tensor  # int32 [A, M]: the same for B
    layer_active: torch.Tensor  # int32 [A, L]: 0 where the adapter has no weights in that layer
    # The shrinks (see LoraPlan.shrinks), each keyed by its first module k:
    shrink_rank: torch.Tensor  # int32 [A, M]: rows of the adapter's A the shrink k reads (0: none)
    shrink_a_offset: torch.Tensor  # int32 [A, M]: first logical row of them, -1 if none
    v_col: torch.Tensor  # int32 [A, M]: where module m's r values start in its shrink's output

    def all(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass
class LoraPlan:
    """One step's LoRA work, planned once on the host for every layer and module.

    `tables` are the device tables; the rest are host values, so that no kernel call synchronizes
    with the device or re-derives anything. `groups` are the projection groups the model applies
    LoRA to in one call (module indices sharing an input, `LORA_GROUPS` in the engine); `prepared`
    is what the step's kernel backend derived from the plan once (`KernelBackend.prepare_lora`):
    index tables for the torch path, block sizes and paths for the Triton one. A *shrink* computes
    x @ A^T for the A blocks of one or more modules of a group at once, their outputs side by side
    (module m's from column v_col), for the Triton kernels.
    """

    tables: LoraTables
    groups: tuple[tuple[int, ...], ...]
    c_in: tuple[int, ...]  # [M]: row chunks per A rank vector of module m (the same for every adapter)
    c_out: tuple[int, ...]  # [M]
    d_in: tuple[int, ...]  # [M]: true widths
    d_out: tuple[int, ...]  # [M]
    rows_per_page: int
    row_width: int
    num_tokens: int
    max_seg_len: int
    segments: list[tuple[int, int, int]]  # (start, length, adapter)
    ranks: list[int]  # [A]
    scales: list[float]  # [A]
    a_offsets: list[list[int]]  # [A][M]
    b_offsets: list[list[int]]  # [A][M]
    layers_active: list[list[bool]]  # [A][L]
    pages: list[list[int]]  # [A]: each adapter's pages, in logical order
    # [A]: the dtype of each adapter's rows where it is not the pool's (half-precision rows in a float32 pool,
    # `kernels.batch.rows_view`: rows_per_page x 2 of them per page), else None
    row_dtypes: list[torch.dtype | None] = field(default_factory=list)
    # The step's shrinks, in group order: the modules whose A blocks one shrink reads together. A
    # group is one shrink when every adapter of the step stacks its A blocks (as the engine's pool
    # does) and no adapter's stack exceeds FUSED_SHRINK_MAX_RANK rows; else each module its own.
    shrinks: tuple[tuple[int, ...], ...] = ()
    shrink_ranks: list[list[int]] = field(default_factory=list)  # [A][M]: host mirror of tables.shrink_rank
    prepared: object = None
    # [M]: on a tensor-parallel rank, its adapters hold rank / a_divisor[m] of module m's A rank vectors (their
    # shrink's share, exchanged between ranks before the expand: `kernels.lora_torch`); 1 on one rank
    a_divisor: tuple[int, ...] = (1, 1, 1, 1, 1, 1, 1)

    def row_dtype(self, adapter: int) -> torch.dtype | None:
        """The dtype of adapter `adapter`'s rows, or None: the pool's."""
        return self.row_dtypes[adapter] if self.row_dtypes else None

    def check_pool_dtype_rows(self, backend: str) -> None:
        """Raise unless every adapter's rows are at the pool's dtype (a backend that reads no half rows)."""
        if any(d is not None for d in self.row_dtypes):
            raise ValueError(f"the {backend} LoRA kernels read adapter rows at the pool's dtype only")


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
