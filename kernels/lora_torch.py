"""Batched LoRA over the unified pool, in plain torch: the reference and the CPU path.

    for each adapter a of the step and each group of projections sharing the input x (q/k/v, ...):
        v[t]    = x[t] @ A^T                  A: the group's A blocks of a, stacked [k*r, d_in]
        y_m[t] += v[t, m's r columns] @ B_m * scale[a]     for each module m of the group a targets

(B here is lora_B^T, [r, d_out].) Shapes: x [T, d_in], each y_m [T, d_out_m] (updated in place),
pool_layer [rows, W].

`prepare_lora_torch` plans the whole step once, for every layer and group. Each adapter's tokens
form a *tile*; tiles of the same rank, targeted modules and token count form a *bucket*, with the
index tables its calls need. Per layer and group a bucket then costs a fixed handful of torch
calls however many adapters it holds, and each adapter's weights are read once, not once per token:

    xs = x[tokens]                           [n, t, d_in]       n tiles of t tokens
    A  = pool_layer[a_rows]                  [n, k*r, d_in]     the stacked A blocks
    v  = bmm(xs, A^T) * weight[layer]        [n, t, k*r]        weight: scale, 0 in layers the adapter skips
    B  = pool_layer[b_rows]                  [Σ_m n * r * c_out_m, W]   module by module, then tile by tile
    per module m:  y_m[tokens] += bmm(v[..., m's columns], B_m)

The runner orders a step's sequences by adapter (`kernels.batch.lora_order`), so that a bucket's tokens are
usually one contiguous span of the step: x is then read as a view and y updated in place by
`baddbmm_` (or a bmm added to y, when y is a column view of a fused projection's output), with no
gather or scatter of activations. Any other order works through index tables.

In float32 on a CPU computing on one thread, a bucket of a few tokens per tile (decode) is one call of
`lora_cpu`'s C kernel over the same tables, which reads the rows where they lie; `native=False` keeps
every bucket on the torch calls above (the reference).

An adapter may hold its rows at half precision in a float32 pool (`plan.row_dtypes`, `--adapter-dtype`):
its row tables then index `rows_view(pool_layer, dtype)` (two half rows per pool row), its tiles go in
buckets of their own, and the gathered rows are widened to the activations' dtype before the bmm.

On a rank of a tensor-parallel worker (`loraserve/partition.py`) a bucket's A blocks hold that rank's share
of the rank vectors (column-parallel groups) or of the input (row-parallel groups);
`lora_apply_torch_partitioned` computes every bucket's v first, exchanges them all between the ranks in one
collective (all-gathered or summed), then expands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from loraserve.kernels import lora_cpu
from loraserve.kernels.batch import page_rows, row_packing, rows_view
from loraserve.kernels.metadata import LoraPlan


@dataclass(frozen=True)
class _Output:
    """Where one module of a bucket writes: its output slot in the group, and its slice of v and B."""

    slot: int  # index into the group's outputs
    v_cols: slice  # its r columns of v
    b_rows: slice  # its n * r * c_out rows of the gathered B (module by module, tile by tile), or of the pool
    c_out: int
    d_out: int


@dataclass(frozen=True)
class _Bucket:
    """Tiles of one rank, one set of targeted modules and one token count (see the module docstring)."""

    n: int  # tiles
    t: int  # tokens per tile
    rank: int
    span: slice | None  # the bucket's tokens when they are one contiguous span of the step, in tile order
    tokens: torch.Tensor | None  # int64 [n * t]: else the token of each slot
    a_rows: torch.Tensor | slice  # int64 [n * k * r * c_in]: physical rows of each tile's stacked A; a slice: in place
    b_rows: torch.Tensor | None  # int64 [n * r * Σ c_out]: rows of the B blocks, module by module, tile by tile;
    # None: read in place, each output's rows a run of the pool
    weight: torch.Tensor  # [L, n, 1, 1]: scale, 0 where the adapter skips the layer
    c_in: int
    d_in: int
    outputs: tuple[_Output, ...]
    native: lora_cpu.BucketCall | None = None  # what its C kernel calls share (a short tile's bucket on the CPU)
    row_dtype: torch.dtype | None = None  # its adapters' rows' dtype when not the pool's: rows of `rows_view`


def prepare_lora_torch(plan: LoraPlan, dtype: torch.dtype) -> list[list[_Bucket]]:
    """The buckets of every group of `plan.groups` (see the module docstring), built once per step."""
    rows = _StepRows(plan, dtype)
    tokens = _adapter_tokens(plan)
    device = plan.tables.rank.device
    layers = np.asarray(plan.layers_active, dtype=np.float32).reshape(len(plan.ranks), -1)  # [A, L]
    weights = torch.from_numpy(layers * np.asarray(plan.scales, dtype=np.float32)[:, None]).to(dtype)
    groups = [_group_buckets(plan, group, tokens, weights, rows, device, dtype) for group in plan.groups]
    if device.type != "cpu":
        return groups
    short = lora_cpu.MAX_TILE_TOKENS
    return [[replace(b, native=lora_cpu.BucketCall.of(b)) if b.t <= short else b for b in g] for g in groups]


class _StepRows:
    """The physical pool row of every logical row of every adapter of the step, in one array (a row of
    `rows_view(pool, the adapter's row dtype)`)."""

    def __init__(self, plan: LoraPlan, pool_dtype: torch.dtype):
        packing = [row_packing(pool_dtype, plan.row_dtype(a)) for a in range(len(plan.pages))]
        per_adapter = [page_rows(p, plan.rows_per_page * k).numpy() for p, k in zip(plan.pages, packing, strict=True)]
        self.rows = np.concatenate(per_adapter)
        self.base = np.cumsum([0] + [len(r) for r in per_adapter[:-1]])  # [A]: where each adapter's rows start
        self.a_offsets = np.asarray(plan.a_offsets, dtype=np.int64)  # [A, M]
        self.b_offsets = np.asarray(plan.b_offsets, dtype=np.int64)
        # [A]: the adapter's pages follow each other, so each of its blocks is one run of pool rows
        self.consecutive = [bool(np.all(np.diff(p) == 1)) for p in plan.pages]

    def blocks(self, adapters: list[int], offsets: np.ndarray, modules: list[int], lengths: list[int]) -> np.ndarray:
        """Physical rows of each adapter's blocks of `modules` (module i: lengths[i] rows), adapter by adapter."""
        first = self.base[adapters][:, None] + offsets[adapters][:, modules]  # [n, k]
        index = np.concatenate([first[:, [i]] + np.arange(n) for i, n in enumerate(lengths)], axis=1)
        return self.rows[index.ravel()]


def lora_apply_torch(
    outputs: Sequence[torch.Tensor],
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    plan: LoraPlan,
    layer: int,
    group: int,
    native: bool = True,
) -> None:
    """outputs[i] += the LoRA term of module plan.groups[group][i], for every adapter token of the step; a
    bucket of a few tokens per tile in C where `lora_cpu` can (`native=False`: in torch, the reference)."""
    in_c = native and lora_cpu.usable(x, pool_layer)
    for b in plan.prepared[group]:
        if in_c and b.t <= lora_cpu.MAX_TILE_TOKENS:
            lora_cpu.apply_bucket(b, x, pool_layer, layer, outputs)
        else:
            _expand(b, _shrink(b, x, pool_layer, layer), outputs, pool_layer)


# Turns each bucket's shrink output, [n, t, k, r'] (k modules, r' rank vectors of each held here), into what its
# expand reads, [n, t, k * r]: on tensor-parallel ranks, the exchange of the ranks' shares
# (`worker/tensor_parallel/collectives.py`). The bool: whether the group is column-parallel.
Exchange = Callable[[list[torch.Tensor], bool], list[torch.Tensor]]


def lora_apply_torch_partitioned(
    outputs: Sequence[torch.Tensor],
    x: torch.Tensor,
    pool_layer: torch.Tensor,
    plan: LoraPlan,
    layer: int,
    group: int,
    exchange: Exchange,
) -> None:
    """`lora_apply_torch` on one rank of a tensor-parallel worker: every bucket's shrink first, then one
    `exchange` of all of them between the ranks, then the expands."""
    buckets = plan.prepared[group]
    if not buckets:
        return
    shrinks = [_shrink(b, x, pool_layer, layer).view(b.n, b.t, len(b.outputs), -1) for b in buckets]
    column = plan.a_divisor[plan.groups[group][0]] > 1
    for b, v in zip(buckets, exchange(shrinks, column), strict=True):
        _expand(b, v, outputs, pool_layer)


def _shrink(b: _Bucket, x: torch.Tensor, pool_layer: torch.Tensor, layer: int) -> torch.Tensor:
    """[n, t, k * a_rank]: the bucket's tokens times the A blocks of its modules, scaled."""
    w, pool = pool_layer.shape[1], rows_view(pool_layer, b.row_dtype)
    xs = x[b.span] if b.span is not None else x.index_select(0, b.tokens)
    a = pool[b.a_rows] if isinstance(b.a_rows, slice) else pool.index_select(0, b.a_rows)
    a = a.to(x.dtype).view(b.n, -1, b.c_in * w)[:, :, : b.d_in]
    return torch.bmm(xs.view(b.n, b.t, -1), a.transpose(1, 2)).mul_(b.weight[layer])


def _expand(b: _Bucket, v: torch.Tensor, outputs: Sequence[torch.Tensor], pool_layer: torch.Tensor) -> None:
    """outputs += v (n, t, k * rank) times each module's B block."""
    w, pool = pool_layer.shape[1], rows_view(pool_layer, b.row_dtype)
    bw = pool if b.b_rows is None else pool.index_select(0, b.b_rows)
    for out in b.outputs:
        bm = bw[out.b_rows].to(v.dtype).view(b.n, b.rank, out.c_out * w)[:, :, : out.d_out]  # a view unless widened
        y, term = outputs[out.slot], v[:, :, out.v_cols]
        if b.span is None:
            y.index_add_(0, b.tokens, torch.bmm(term, bm).view(b.n * b.t, -1))
        elif y.is_contiguous():
            y[b.span].view(b.n, b.t, -1).baddbmm_(term, bm)
        else:  # a column view of a fused GEMM's output, which baddbmm_ would fill batch by batch
            y[b.span].view(b.n, b.t, -1).add_(torch.bmm(term, bm))


def _adapter_tokens(plan: LoraPlan) -> list[np.ndarray]:
    """The step's token indices of each adapter, in step order."""
    runs: list[list[np.ndarray]] = [[] for _ in plan.ranks]
    for start, length, adapter in plan.segments:
        runs[adapter].append(np.arange(start, start + length, dtype=np.int64))
    return [np.concatenate(r) for r in runs]


def _contiguous(tokens: np.ndarray) -> bool:
    return int(tokens[-1]) - int(tokens[0]) == len(tokens) - 1


def _tiles(plan: LoraPlan, group: tuple[int, ...], tokens: list[np.ndarray]) -> list[tuple[tuple, list[int]]]:
    """Adapters that target the group, as (bucket key, adapters): runs of adapters with one key whose
    tokens follow each other in the step, then the other adapters grouped by key."""
    spans: list[tuple[tuple, list[int]]] = []
    scattered: dict[tuple, list[int]] = {}
    for a in sorted(range(len(plan.ranks)), key=lambda a: int(tokens[a][0])):
        targeted = tuple(i for i, m in enumerate(group) if plan.a_offsets[a][m] >= 0)
        if not targeted:
            continue
        key = (plan.ranks[a], targeted, len(tokens[a]), plan.row_dtype(a))
        if not _contiguous(tokens[a]):
            scattered.setdefault(key, []).append(a)
        elif spans and spans[-1][0] == key and int(tokens[spans[-1][1][-1]][-1]) + 1 == int(tokens[a][0]):
            spans[-1][1].append(a)
        else:
            spans.append((key, [a]))
    return [((*key, True), adapters) for key, adapters in spans] + [
        ((*key, False), adapters) for key, adapters in scattered.items()
    ]


DIRECT_MIN_BYTES = 256 * 1024  # see `_Tile.direct`


def _group_buckets(
    plan: LoraPlan,
    group: tuple[int, ...],
    tokens: list[np.ndarray],
    weights: torch.Tensor,
    rows: _StepRows,
    device: torch.device,
    pool_dtype: torch.dtype,
) -> list[_Bucket]:
    buckets = []
    for (r, targeted, t, row_dtype, spanned), adapters in _tiles(plan, group, tokens):
        tile = _Tile(plan, group, targeted, r, t, rows, row_dtype)
        row_bytes = plan.row_width * (row_dtype or pool_dtype).itemsize
        direct = [a for a in adapters if tile.direct(a, row_bytes)]
        gathered = [a for a in adapters if a not in direct]
        for a in direct:  # a bucket of its own, its rows read in place
            buckets.append(tile.bucket([a], tokens, weights, device, gather=False, spanned=spanned))
        if gathered:  # what is left of a span of tiles may no longer be one span
            rest = spanned and _contiguous(np.concatenate([tokens[a] for a in gathered]))
            buckets.append(tile.bucket(gathered, tokens, weights, device, gather=True, spanned=rest))
    return buckets


class _Tile:
    """One bucket key of a group (rank, targeted modules, tokens per tile, row dtype): its buckets' rows and
    outputs."""

    def __init__(
        self,
        plan: LoraPlan,
        group: tuple[int, ...],
        targeted: tuple[int, ...],
        r: int,
        t: int,
        rows: _StepRows,
        row_dtype: torch.dtype | None,
    ):
        self.plan, self.targeted, self.r, self.t, self.rows, self.row_dtype = plan, targeted, r, t, rows, row_dtype
        self.modules = [group[i] for i in targeted]
        self.c_in, self.c_out = plan.c_in[self.modules[0]], [plan.c_out[m] for m in self.modules]
        self.a_r = r // plan.a_divisor[self.modules[0]]  # A rank vectors held here (a tensor-parallel share)

    def a_rows(self, adapters: list[int]) -> np.ndarray:
        return self.rows.blocks(adapters, self.rows.a_offsets, self.modules, [self.a_r * self.c_in] * len(self.modules))

    def b_rows(self, adapters: list[int], module: int) -> np.ndarray:
        return self.rows.blocks(adapters, self.rows.b_offsets, [self.modules[module]], [self.r * self.c_out[module]])

    def direct(self, adapter: int, row_bytes: int) -> bool:
        """Whether the adapter's rows for the group are read in place: its pages consecutive and its A blocks
        stacked (so they are one run of the pool, and each module's B rows another), and enough rows that
        copying them out (5-7 GB/s on one thread here) costs more than the dozen extra calls of a bucket of
        its own."""
        rows = self.a_r * len(self.modules) * self.c_in + self.r * sum(self.c_out)
        if not self.rows.consecutive[adapter] or rows * row_bytes < DIRECT_MIN_BYTES:
            return False
        starts = self.rows.a_offsets[adapter][self.modules]  # the group's A blocks, stacked: one after another
        return bool(np.all(np.diff(starts) == self.a_r * self.c_in))

    def bucket(
        self,
        adapters: list[int],
        tokens: list[np.ndarray],
        weights: torch.Tensor,
        device: torch.device,
        gather: bool,
        spanned: bool,
    ) -> _Bucket:
        n, r, plan = len(adapters), self.r, self.plan
        outputs, v_col, b_row = [], 0, 0
        for i, (slot, m, co) in enumerate(zip(self.targeted, self.modules, self.c_out, strict=True)):
            # gathered: rows of the bucket's gathered B, module by module; in place: the module's rows of the pool
            b_rows = slice(b_row, b_row + n * r * co) if gather else _as_slice(self.b_rows(adapters, i))
            outputs.append(_Output(slot, slice(v_col, v_col + r), b_rows, co, plan.d_out[m]))
            v_col, b_row = v_col + r, b_row + n * r * co
        first = int(tokens[adapters[0]][0])
        return _Bucket(
            n=n,
            t=self.t,
            rank=r,
            span=slice(first, first + n * self.t) if spanned else None,
            tokens=None if spanned else _tensor(np.concatenate([tokens[a] for a in adapters]), device),
            a_rows=_tensor(self.a_rows(adapters), device) if gather else _as_slice(self.a_rows(adapters)),
            b_rows=(
                _tensor(np.concatenate([self.b_rows(adapters, i) for i in range(len(self.modules))]), device)
                if gather
                else None
            ),
            weight=weights[adapters].T[:, :, None, None].to(device),
            c_in=self.c_in,
            d_in=plan.d_in[self.modules[0]],
            outputs=tuple(outputs),
            row_dtype=self.row_dtype,
        )


def _as_slice(rows: np.ndarray) -> slice:
    return slice(int(rows[0]), int(rows[-1]) + 1)


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(values).to(device)
