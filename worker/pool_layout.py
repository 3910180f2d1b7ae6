"""Geometry of the unified page pool: where a token's KV and an adapter's weights live.

The pool is ONE tensor, allocated once:

    pool: [num_layers, num_pages * rows_per_page, row_width]      row_width W = num_kv_heads × head_dim

A *row* is W elements of one layer. A *page* is `rows_per_page` (R) consecutive rows, at the same
place in every layer; pages are what the allocator hands out, to KV cache or to adapters alike.

KV cache. A page holds `tokens_per_page` = R/2 tokens of one sequence: rows [0, R/2) are their K
vectors, rows [R/2, R) their V vectors (a K or V vector of one token is exactly one row: W is the
KV width, so grouped-query attention wastes nothing). Token t of a sequence with page table P:

    K row = P[t // (R/2)] * R + t % (R/2)          V row = K row + R/2

Adapters. S-LoRA stores a rank-r weight as r vectors; here each rank vector is split into
row-sized chunks. For a target module with in/out widths (d_in, d_out), c_in = ceil(d_in / W),
c_out = ceil(d_out / W):

    A block: r × c_in rows,  row j*c_in + c  = lora_A[j, c*W : (c+1)*W]     (lora_A: [r, d_in])
    B block: r × c_out rows, row j*c_out + c = lora_B[c*W : (c+1)*W, j]     (lora_B: [d_out, r])

Blocks of the adapter's modules follow each other group by group (`LORA_GROUPS`: q/k/v, o,
gate/up, down) in the adapter's *logical* row space: first the A blocks of the group's targeted
modules (in `LORA_MODULES` order), then their B blocks. The A blocks of projections that share an
input are thus one stacked [k*r, d_in] matrix, read by one shrink. Logical row ℓ lives at physical
row  pages[ℓ // R] * R + ℓ % R. Every layer uses the same logical layout, so one page list per
adapter serves all layers. Widths that are
multiples of W (hidden size, KV width and, in most models, the MLP width: 14336 = 14 × 1024 in
Llama-3-8B) waste nothing; otherwise only the last chunk of each rank vector is padded.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from loraserve.model_config import LORA_GROUPS, LORA_MODULES, MODULE_INDEX, ModelConfig


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_offsets(
    targeted: Collection[int],
    rank: int,
    c_in: Sequence[int],
    c_out: Sequence[int],
    groups: tuple[tuple[int, ...], ...] = LORA_GROUPS,
) -> tuple[dict[int, tuple[int, int]], int]:
    """The layout rule (module docstring), on module indices: {module: (first row of its A block, of
    its B block)} for the `targeted` modules of a rank-`rank` adapter, and the rows they take. Group
    by group, the targeted modules' A blocks follow each other, then their B blocks. `c_in`, `c_out`:
    row chunks per rank vector of every module."""
    offsets: dict[int, tuple[int, int]] = {}
    offset = 0
    for group in groups:
        present = [m for m in group if m in targeted]
        b_offset = offset + rank * sum(c_in[m] for m in present)
        for m in present:
            offsets[m] = (offset, b_offset)
            offset, b_offset = offset + rank * c_in[m], b_offset + rank * c_out[m]
        offset = b_offset
    return offsets, offset


@dataclass(frozen=True)
class ModuleBlock:
    """Where one target module's A and B live in an adapter's logical rows."""

    module: str
    d_in: int
    d_out: int
    c_in: int  # row chunks per A rank vector
    c_out: int  # row chunks per B rank vector
    a_offset: int  # first logical row of the A block
    b_offset: int  # first logical row of the B block


@dataclass(frozen=True)
class AdapterLayout:
    """The logical row layout of one adapter (rank r, some target modules)."""

    rank: int
    blocks: tuple[ModuleBlock, ...]
    num_rows: int
    num_pages: int
    useful_elements: int  # weights actually stored, summed over layers (for waste accounting)

    def block(self, module: str) -> ModuleBlock | None:
        return next((b for b in self.blocks if b.module == module), None)

    @functools.cached_property  # read for every step's batch metadata
    def a_offsets(self) -> tuple[int, ...]:
        """First logical row of each module's A block, in LORA_MODULES order; -1 where not targeted."""
        return tuple(b.a_offset if b else -1 for b in map(self.block, LORA_MODULES))

    @functools.cached_property
    def b_offsets(self) -> tuple[int, ...]:
        return tuple(b.b_offset if b else -1 for b in map(self.block, LORA_MODULES))


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    row_width: int
    rows_per_page: int
    num_pages: int

    def __post_init__(self) -> None:
        if self.rows_per_page < 2 or self.rows_per_page % 2:
            raise ValueError(f"rows_per_page must be an even number >= 2, got {self.rows_per_page}")
        if self.num_pages < 1:
            raise ValueError(f"the pool needs at least one page, got {self.num_pages}")

    @classmethod
    def for_model(cls, config: ModelConfig, rows_per_page: int, num_pages: int) -> PoolLayout:
        return cls(config.num_layers, config.kv_width, rows_per_page, num_pages)

    @property
    def tokens_per_page(self) -> int:
        return self.rows_per_page // 2

    @property
    def rows_per_layer(self) -> int:
        return self.num_pages * self.rows_per_page

    @property
    def page_elements(self) -> int:
        """Elements of one page over all layers."""
        return self.num_layers * self.rows_per_page * self.row_width

    def describe(self, element_size: int) -> str:
        """The geometry in one line, for the log."""
        mib = self.num_layers * self.rows_per_layer * self.row_width * element_size / 2**20
        return (
            f"{self.num_pages} pages x {self.rows_per_page} rows x {self.row_width} wide x {self.num_layers} layers "
            f"({mib:.1f} MiB, {self.tokens_per_page} tokens per KV page)"
        )

    def kv_pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.tokens_per_page)

    def adapter_layout(
        self, config: ModelConfig, rank: int, modules: tuple[str, ...], active_layers: int | None = None
    ) -> AdapterLayout:
        """Lay out an adapter of rank `rank` on `modules` (any order; stored in LORA_MODULES order)."""
        unknown = set(modules) - set(LORA_MODULES)
        if unknown:
            raise ValueError(f"unknown LoRA modules {sorted(unknown)}")
        shapes = [config.module_shape(m) for m in LORA_MODULES]
        c_in = [ceil_div(d_in, self.row_width) for d_in, _ in shapes]
        c_out = [ceil_div(d_out, self.row_width) for _, d_out in shapes]
        targeted = {MODULE_INDEX[m] for m in modules}
        offsets, rows = block_offsets(targeted, rank, c_in, c_out)
        blocks = [
            ModuleBlock(LORA_MODULES[m], *shapes[m], c_in[m], c_out[m], a, b) for m, (a, b) in sorted(offsets.items())
        ]
        useful = sum(rank * (b.d_in + b.d_out) for b in blocks)
        layers = self.num_layers if active_layers is None else active_layers
        return AdapterLayout(
            rank=rank,
            blocks=tuple(blocks),
            num_rows=rows,
            num_pages=ceil_div(rows, self.rows_per_page),
            useful_elements=useful * layers,
        )
