"""Building a step's kernel metadata from plain data: the one builder the runner and the kernel tests share.

    lora = build_lora_plan(geometry, [(adapter_or_None, num_tokens), ...], buffers, backend.prepare_lora)
    attention = build_attention_batch([(kv_page_table, start, num_tokens), ...], tokens_per_page, window, buffers)

Sequences are given in step order. For LoRA, consecutive sequences of one adapter merge into one
segment (Punica's SGMV segments) and the per-adapter tables list each adapter once, in order of
first use; adapters are told apart by identity, so pass the same object for the same adapter.

`buffers` is the runner's `StepBuffers` (tables staged in storage allocated once; the caller
uploads them once the whole step is staged), or a device: the builder then stages into buffers
that fit just this step and uploads them itself (kernel tests and benchmarks). Either way the
tables are built by the same code.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from loraserve.kernels.metadata import AttentionBatch, LoraPlan, LoraTables
from loraserve.kernels.step_buffers import StepBuffers, StepCapacity
from loraserve.model_config import LORA_GROUPS, LORA_MODULES

# Every module its own group: what kernel tests and benchmarks apply, one module at a time.
ONE_MODULE_GROUPS = tuple((m,) for m in range(len(LORA_MODULES)))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def page_rows(pages: Sequence[int], rows_per_page: int) -> torch.Tensor:
    """int64 [len(pages) * rows_per_page]: the physical pool row of each logical row of something
    stored on `pages` (logical row l is row l % rows_per_page of pages[l // rows_per_page])."""
    first = torch.as_tensor(list(pages), dtype=torch.int64)[:, None] * rows_per_page
    return (first + torch.arange(rows_per_page)).view(-1)


def row_packing(pool_dtype: torch.dtype, row_dtype: torch.dtype | None) -> int:
    """Rows of `row_dtype` one pool row holds: 2 for half-precision adapter rows in a float32 pool, else 1."""
    return 1 if row_dtype is None else pool_dtype.itemsize // row_dtype.itemsize


def rows_view(pool: torch.Tensor, row_dtype: torch.dtype | None) -> torch.Tensor:
    """The pool's rows ([rows, W] of one layer, or [L, rows, W]) read as rows of `row_dtype`: a float32 row is
    two rows of a half type side by side, so half-precision row h of the view is half h % 2 of pool row h // 2
    (an adapter on pages P then has rows_per_page x 2 rows per page). None or the pool's dtype: the pool."""
    if row_dtype is None or row_dtype == pool.dtype:
        return pool
    return pool.view(row_dtype).view(*pool.shape[:-2], -1, pool.shape[-1])


@dataclass(frozen=True)
class LoraGeometry:
    """Widths of the 7 projections (LORA_MODULES order) and the pool's row/page shape."""

    d_in: tuple[int, ...]
    d_out: tuple[int, ...]
    row_width: int
    rows_per_page: int
    num_layers: int = 1
    # [7]: a tensor-parallel rank holds rank / this many of each module's A rank vectors (`loraserve/partition.py`)
    a_divisor: tuple[int, ...] = (1,) * len(LORA_MODULES)

    @classmethod
    def uniform(cls, d_in: int, d_out: int, row_width: int, rows_per_page: int, num_layers: int = 1):
        """Every module maps d_in -> d_out (enough for kernel tests, which run one module at a time)."""
        n = len(LORA_MODULES)
        return cls((d_in,) * n, (d_out,) * n, row_width, rows_per_page, num_layers)

    @property
    def c_in(self) -> tuple[int, ...]:
        return tuple(ceil_div(d, self.row_width) for d in self.d_in)

    @property
    def c_out(self) -> tuple[int, ...]:
        return tuple(ceil_div(d, self.row_width) for d in self.d_out)

    def plan_fields(self) -> dict:
        """The widths a LoraPlan carries (its c_in, c_out, d_in, d_out, rows_per_page, row_width)."""
        return dict(
            c_in=self.c_in,
            c_out=self.c_out,
            d_in=self.d_in,
            d_out=self.d_out,
            rows_per_page=self.rows_per_page,
            row_width=self.row_width,
            a_divisor=self.a_divisor,
        )


class PooledAdapter(Protocol):
    """An adapter's place in the pool, as the LoRA kernels index it."""

    rank: int
    scale: float
    pages: Sequence[int] | torch.Tensor  # its pages, in logical order
    a_offsets: Sequence[int]  # [7]: first logical row of each module's A block, -1 if not targeted
    b_offsets: Sequence[int]
    layers: Sequence[bool]  # [L]: it has weights in that layer
    row_dtype: torch.dtype | None  # the dtype of its rows when not the pool's (`rows_view`), else None


def _staging(target: StepBuffers | torch.device | str, sizes: dict[str, int]) -> tuple[StepBuffers, bool]:
    """(buffers, own): the step's buffers after checking `sizes` fit, or new ones that fit exactly (own)."""
    if isinstance(target, StepBuffers):
        target.capacity.check(**sizes)
        return target, False
    fitting = {f.name: max(1, sizes.get(f.name, 1)) for f in fields(StepCapacity)}
    return StepBuffers(StepCapacity(**fitting), target), True


def _host_pages(pages: Sequence[int] | torch.Tensor) -> list[int]:
    return pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)


def _padded(rows: list[list[int]], width: int) -> list[int]:
    """Rows flattened row-major, each zero-padded to `width`."""
    flat: list[int] = []
    for row in rows:
        flat += row
        flat += [0] * (width - len(row))
    return flat


def lora_order(adapters: Sequence[Hashable | None], ranks: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """An order of a step's sequences (given their adapter, its rank and their token counts) that
    puts each adapter's sequences together, adapters of one rank and one token count side by side,
    and sequences without adapter last. A LoRA plan of the step in this order has one segment per
    adapter, and the torch path's buckets are spans of the step (`kernels.lora_torch`)."""
    count: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, (a, n) in enumerate(zip(adapters, tokens, strict=True)):
        if a is not None:
            count[a] = count.get(a, 0) + n
            first.setdefault(a, i)

    def key(i: int) -> tuple:
        a = adapters[i]
        if a is None:
            return (1, 0, 0, i)
        return (0, ranks[i], count[a], first[a])

    return sorted(range(len(adapters)), key=key)


# Rows of one adapter's stacked A blocks a fused shrink reads at most: beyond it, the group's modules
# get a shrink each (the Triton kernels' rank block, and so their tiles, stay at most 128 wide).
FUSED_SHRINK_MAX_RANK = 128


@dataclass(frozen=True)
class _Shrinks:
    """The step's shrinks and their per-adapter tables (see LoraPlan.shrinks and LoraTables)."""

    shrinks: tuple[tuple[int, ...], ...]
    ranks: list[list[int]]  # [A][M], keyed by each shrink's first module
    a_offsets: list[list[int]]  # [A][M]
    v_cols: list[list[int]]  # [A][M]


def _stacked(a_offsets: Sequence[int], modules: list[int], rank: int, c_in: Sequence[int]) -> bool:
    """Whether the A blocks of `modules` (in order) follow each other in the adapter's rows."""
    return all(a_offsets[n] == a_offsets[m] + rank * c_in[m] for m, n in itertools.pairwise(modules))


def plan_shrinks(
    groups: tuple[tuple[int, ...], ...],
    ranks: Sequence[int],
    a_offsets: Sequence[Sequence[int]],
    c_in: Sequence[int],
    fuse: bool = True,
) -> _Shrinks:
    """One shrink per group where every adapter stacks the A blocks it has of the group (and at most
    FUSED_SHRINK_MAX_RANK rows of them), else one per module; `fuse=False`: one per module always."""
    modules, count = len(LORA_MODULES), len(ranks)
    shrink_ranks = [[0] * modules for _ in range(count)]
    offsets = [[-1] * modules for _ in range(count)]
    v_cols = [[0] * modules for _ in range(count)]
    shrinks: list[tuple[int, ...]] = []
    for group in groups:
        targeted = [[m for m in group if a_offsets[a][m] >= 0] for a in range(count)]
        fused = (
            fuse
            and len(group) > 1
            and all(
                _stacked(a_offsets[a], ms, ranks[a], c_in) and len(ms) * ranks[a] <= FUSED_SHRINK_MAX_RANK
                for a, ms in enumerate(targeted)
            )
        )
        if fused:
            shrinks.append(group)
            for a, ms in enumerate(targeted):
                if ms:
                    shrink_ranks[a][group[0]], offsets[a][group[0]] = len(ms) * ranks[a], a_offsets[a][ms[0]]
                for i, m in enumerate(ms):
                    v_cols[a][m] = i * ranks[a]
            continue
        for m in group:
            shrinks.append((m,))
            for a in range(count):
                if a_offsets[a][m] >= 0:
                    shrink_ranks[a][m], offsets[a][m] = ranks[a], a_offsets[a][m]
    return _Shrinks(tuple(shrinks), shrink_ranks, offsets, v_cols)


class ReusePrepared:
    """A backend's `prepare_lora` that returns the last result again when the plan's host values are
    unchanged: in steady decode, consecutive steps run the same adapters in the same order with the
    same token counts. What a backend prepares depends on nothing else, so reuse is exact."""

    def __init__(self, prepare: Callable[[LoraPlan], object]):
        self._prepare = prepare
        self._key: tuple | None = None
        self._prepared: object = None

    def __call__(self, plan: LoraPlan) -> object:
        key = (
            plan.num_tokens,
            plan.groups,
            tuple(plan.segments),
            tuple(plan.ranks),
            tuple(plan.scales),
            *(tuple(map(tuple, rows)) for rows in (plan.a_offsets, plan.b_offsets, plan.layers_active, plan.pages)),
            tuple(plan.row_dtypes),
        )
        if key != self._key:
            self._key, self._prepared = key, self._prepare(plan)
        return self._prepared


def build_lora_plan(
    geometry: LoraGeometry,
    seqs: Sequence[tuple[PooledAdapter | None, int]],
    buffers: StepBuffers | torch.device | str,
    prepare: Callable[[LoraPlan], object] | None = None,
    groups: tuple[tuple[int, ...], ...] = LORA_GROUPS,
    *,
    fixed_width: bool = False,
    fuse_shrinks: bool = True,
) -> LoraPlan | None:
    """The step's LoRA plan for sequences of (adapter or None, tokens this step); None when no token
    uses an adapter. `prepare` (a backend's `prepare_lora`) derives the backend's per-step work from
    it once; `groups` are the module groups the backend will be called with. `fixed_width` pads the
    page table to the buffers' capacity, the row stride a captured decode graph was launched with
    (`kernels.graph_tables`); `fuse_shrinks=False` gives every module its own shrink (`plan_shrinks`)."""
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

    pages = [_host_pages(a.pages) for a in adapters]
    width, num_adapters, num_layers = max(map(len, pages)), len(adapters), geometry.num_layers
    sizes = dict(
        max_tokens=start,
        max_seqs=len(segments),
        max_adapters=num_adapters,
        max_adapter_pages=width,
        num_layers=num_layers,
    )
    buffers, own = _staging(buffers, sizes)
    if fixed_width:
        width = buffers.capacity.max_adapter_pages
    a_offsets = [list(a.a_offsets) for a in adapters]
    b_offsets = [list(a.b_offsets) for a in adapters]
    layers = [[bool(x) for x in a.layers] for a in adapters]
    modules = len(LORA_MODULES)
    shrinks = plan_shrinks(groups, [a.rank for a in adapters], a_offsets, geometry.c_in, fuse_shrinks)
    tables = LoraTables(
        seg_start=buffers.put("seg_start", [s for s, _, _ in segments]),
        seg_len=buffers.put("seg_len", [n for _, n, _ in segments]),
        seg_adapter=buffers.put("seg_adapter", [a for _, _, a in segments]),
        token_adapter=buffers.put("token_adapter", token_adapter),
        rank=buffers.put("rank", [a.rank for a in adapters]),
        scale=buffers.put("scale", [a.scale for a in adapters]),
        page_table=buffers.put("lora_page_table", _padded(pages, width), (num_adapters, width)),
        a_offset=buffers.put("a_offset", _padded(a_offsets, modules), (num_adapters, modules)),
        b_offset=buffers.put("b_offset", _padded(b_offsets, modules), (num_adapters, modules)),
        layer_active=buffers.put("layer_active", _padded(layers, num_layers), (num_adapters, num_layers)),
        shrink_rank=buffers.put("shrink_rank", _padded(shrinks.ranks, modules), (num_adapters, modules)),
        shrink_a_offset=buffers.put("shrink_a_offset", _padded(shrinks.a_offsets, modules), (num_adapters, modules)),
        v_col=buffers.put("v_col", _padded(shrinks.v_cols, modules), (num_adapters, modules)),
    )
    plan = LoraPlan(
        tables=tables,
        groups=groups,
        **geometry.plan_fields(),
        num_tokens=start,
        max_seg_len=max(n for _, n, _ in segments),
        segments=segments,
        ranks=[a.rank for a in adapters],
        scales=[a.scale for a in adapters],
        a_offsets=a_offsets,
        b_offsets=b_offsets,
        layers_active=layers,
        pages=pages,
        row_dtypes=[a.row_dtype for a in adapters],
        shrinks=shrinks.shrinks,
        shrink_ranks=shrinks.ranks,
    )
    if own:
        buffers.upload()
    if prepare is not None:
        plan.prepared = prepare(plan)
    return plan


def build_attention_batch(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    tokens_per_page: int,
    sliding_window: int | None,
    buffers: StepBuffers | torch.device | str,
    *,
    fixed_width: bool = False,
) -> AttentionBatch:
    """AttentionBatch for sequences of (KV page table, tokens already cached, new tokens this step).

    A page table may run past the sequence's tokens; only the pages they occupy are passed on.
    `fixed_width` pads the page tables to the buffers' capacity, as `build_lora_plan` does.
    """
    tp, rpp = tokens_per_page, 2 * tokens_per_page
    query_start, context, tables, new_rows = [0], [], [], []
    for table, start, n in seqs:
        end = start + n
        query_start.append(query_start[-1] + n)
        context.append(end)
        tables.append(list(table[: ceil_div(end, tp)]))
        new_rows += [table[p // tp] * rpp + p % tp for p in range(start, end)]
    width = max(map(len, tables))
    sizes = dict(max_tokens=query_start[-1], max_seqs=len(tables), max_seq_pages=width)
    buffers, own = _staging(buffers, sizes)
    if fixed_width:
        width = buffers.capacity.max_seq_pages
    batch = AttentionBatch(
        query_start=buffers.put("query_start", query_start),
        context_len=buffers.put("context_len", context),
        page_table=buffers.put("kv_page_table", _padded(tables, width), (len(tables), width)),
        new_rows=buffers.put("new_rows", new_rows),
        tokens_per_page=tp,
        max_query_len=max(n for _, _, n in seqs),
        max_context_len=max(context),
        sliding_window=sliding_window,
        query_starts=query_start,
        query_lens=[n for _, _, n in seqs],
        context_lens=context,
    )
    if own:
        buffers.upload()
    return batch
