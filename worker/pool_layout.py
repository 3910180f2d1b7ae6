"""Geometry of the unified page pool: where a token's KV and an adapter's weights live.

The pool is ONE tensor, allocated once:

    pool: [num_layers, num_pages * rows_per_page, row_width]      row_width W = num_kv_heads × head_dim

A *row* is W elements of one layer. A *page* is `rows_per_page` (R) consecutive rows, at the same
place in every layer; pages are what the allocator hands out, to KV cache or to adapters alike.

KV cache. A page holds `tokens_per_page` = R/2 tokens of one sequence: rows [0, R/2) are their K
vectors, rows [R/2, R) their V vectors (a K or V vector of one token is exactly one row: W is the
KV width, so grouped-query attention wastes nothing). Token t of a sequence with page table P:

    K row = P[t // (R/2)] * R + t % (R/2)          V row = K row + R/2

With tensor parallelism each rank has a pool of its own, holding its KV heads (`row_width` is their width)
and its part of every adapter (`loraserve/partition.py`), at the same pages on every rank.

Adapters. An adapter's A and B blocks fill its logical rows as the adapter rows contract lays them out
(`loraserve/pool_rows.py`, shared with the adapter store, which packs them); logical row ℓ lives at
physical row  pages[ℓ // R] * R + ℓ % R, the same in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.model_config import ModelConfig
from loraserve.partition import ONE_RANK, Shard, local_model
from loraserve.pool_rows import AdapterLayout, adapter_layout, ceil_div


@dataclass(frozen=True)
class PoolLayout:
    num_layers: int
    row_width: int
    rows_per_page: int
    num_pages: int
    shard: Shard = field(default_factory=Shard)  # the tensor-parallel rank whose part of KV and adapters it holds

    def __post_init__(self) -> None:
        if self.rows_per_page < 2 or self.rows_per_page % 2:
            raise ValueError(f"rows_per_page must be an even number >= 2, got {self.rows_per_page}")
        if self.num_pages < 1:
            raise ValueError(f"the pool needs at least one page, got {self.num_pages}")

    @classmethod
    def for_model(cls, config: ModelConfig, rows_per_page: int, num_pages: int, shard: Shard = ONE_RANK) -> PoolLayout:
        """The pool of one rank (`shard`): rows as wide as that rank's KV heads."""
        return cls(config.num_layers, local_model(config, shard).kv_width, rows_per_page, num_pages, shard)

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
        """Lay out an adapter of rank `rank` on `modules` in this pool's rows and pages (`loraserve/pool_rows.py`);
        `active_layers`: the layers it has weights in, by default all of the pool's."""
        layers = self.num_layers if active_layers is None else active_layers
        return adapter_layout(config, rank, modules, self.row_width, self.rows_per_page, layers, self.shard)
