"""Batched LoRA over the unified pool, in Triton: the same semantics as `lora_torch`.

    for each segment s (adapter a = seg_adapter[s], tokens t in the segment):
        if a_offset[a, m] >= 0 and layer_active[a, layer]:
            v[t]  = x[t] @ A_a^T                    shrink:  A_a [r_a, d_in]
            y[t] += (v[t] @ B_a) * scale[a]         expand:  B_a [r_a, d_out]   (B here is lora_B^T)

    A_a[j, c*W + k] = pool[row(a, a_offset[a, m] + j*c_in + c), k]      (k < W, c*W + k < d_in)
    B_a[j, c*W + n] = pool[row(a, b_offset[a, m] + j*c_out + c), n]
    row(a, l)       = page_table[a, l // R] * R + l % R

Shapes: x [T, d_in], y [T, d_out] (updated in place), pool_layer [rows, W]; metadata in the step's
`LoraPlan` (its device `tables`).

Projections that share an input (a group: q/k/v, gate/up) share one shrink when the step's adapters
stack their A blocks of the group (as the engine's pool does, `loraserve/pool_rows.py`): the k
blocks an adapter has are then one [k*r_a, d_in] matrix, read as a rank-k*r_a A from the first
one's offset (`shrink_a_offset`, `shrink_rank`, keyed by the group's first module), and x is read
once for the group. Module m's expand reads its r_a values of v from column v_col[a, m]. Otherwise
(`LoraPlan.shrinks`), each module has a shrink of its own, with the same kernels.

Both factors are read row by row straight from the adapter's pages: nothing is padded to a
maximum rank in memory, and adapters of different ranks share one launch (the rank BLOCK is a
power of two >= 16 covering the largest rank, and rows j >= r_a are masked off, never read).
Rank vectors wider than a row are `c` consecutive rows; a program walks them chunk by chunk, so
every load of a weight tile is W-contiguous within one physical row.

Two paths, each a shrink kernel and an expand kernel joined by a float32 buffer
v [SPLITS, T, BLOCK_R] (the shrink may split the d_in reduction over SPLITS programs; the expand
sums the partial vectors, so the result does not depend on the order of any atomic):

- token path (decode; S-LoRA's MBGMV, punica's BGMV): one program per token t (and split), adapter
  token_adapter[t] (-1: none); dot products as broadcast multiply + tl.sum.
    shrink grid (T, SPLITS)                          expand grid (T, c_out * ceil(W / BLOCK_N))
- segment path (prefill; S-LoRA's MBGMM, punica's SGMV): one program per tile of BLOCK_M tokens
  of a segment; tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_R] and [BLOCK_M, BLOCK_R] x
  [BLOCK_R, BLOCK_N] tiles; programs past their segment's end return at once.
    shrink grid (S, ceil(max_seg_len / BLOCK_M), SPLITS)
    expand grid (S, ceil(max_seg_len / BLOCK_M), c_out * ceil(W / BLOCK_N))

`prepare_lora_triton` makes every host-side choice once per step (the path: the token path when
every segment is one token long, a pure decode step with no adapter shared by two requests in a
row, the segment path otherwise, where a segment of n tokens reads its adapter once per tile
rather than n times; block sizes; reduction splits; the float32 buffer v of each shrink), so that
applying a group in a layer (`lora_apply_triton_group`) only launches kernels. `lora_apply_triton`
applies one module with the same launches after checking its arguments, for tests and benchmarks.
A captured decode step launches what `prepare_lora_triton_graph` prepares instead (see there).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.kernels.metadata import LoraPlan
from loraserve.model_config import LORA_MODULES

# Integer arguments that change from step to step, layer to layer or module to module. Triton would
# otherwise compile a variant of a kernel for each pattern of them (value 1, multiple of 16, other):
# hundreds of compilations of about a second each, spread over the first minutes of serving.
# Only the constexpr block sizes (and dtypes) select a compiled variant.
PER_STEP_ARGS = (
    "stride_pt",
    "module",
    "layer",
    "num_tokens",
    "d_in",
    "d_out",
    "c_in",
    "c_out",
    "splits",
    "v_stride",
)


def _jit_per_step(fn):
    """triton.jit, with no specialization on the PER_STEP_ARGS among fn's parameters."""
    params = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in PER_STEP_ARGS if name in params])


# Largest segment length for which the token path is chosen (see the module docstring).
TOKEN_PATH_MAX_SEG_LEN = 1
PATHS = ("auto", "token", "segment")


@triton.jit
def _rows(page_row_ptr, logical, mask, R: tl.constexpr):
    """Physical pool rows (int64) of an adapter's logical rows: page_row[l // R] * R + l % R."""
    page = tl.load(page_row_ptr + logical // R, mask=mask, other=0)
    return page.to(tl.int64) * R + logical % R


@triton.jit
def _block_offset(a, module, layer, offset_ptr, layer_active_ptr, stride_la):
    """(first logical row of adapter a's block for the module, whether a skips it in this layer)."""
    offset = tl.load(offset_ptr + a * 7 + module)
    active = tl.load(layer_active_ptr + a * stride_la + layer)
    return offset, (offset < 0) | (active == 0)


@_jit_per_step
def _shrink_token_kernel(
    x_ptr,
    stride_xt,
    pool_ptr,
    v_ptr,
    token_adapter_ptr,
    rank_ptr,
    page_table_ptr,
    stride_pt,
    a_offset_ptr,
    layer_active_ptr,
    stride_la,
    module,
    layer,
    num_tokens,
    d_in,
    c_in,
    splits,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """v[split, t, j] = sum over this split's k of x[t, k] * A_a[j, k]   (a = token_adapter[t])"""
    t = tl.program_id(0)
    split = tl.program_id(1)
    a = tl.load(token_adapter_ptr + t)
    if a < 0:
        return
    a_off, skip = _block_offset(a, module, layer, a_offset_ptr, layer_active_ptr, stride_la)
    if skip:
        return
    j = tl.arange(0, BLOCK_R)
    j_ok = j < tl.load(rank_ptr + a * 7 + module)
    cols = tl.arange(0, BLOCK_K)
    blocks_per_chunk = (W + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for kb in range(split, c_in * blocks_per_chunk, splits):
        c = kb // blocks_per_chunk
        col = (kb % blocks_per_chunk) * BLOCK_K + cols
        k_ok = (col < W) & (c * W + col < d_in)
        xk = tl.load(x_ptr + t * stride_xt + c * W + col, mask=k_ok, other=0.0).to(tl.float32)
        rows = _rows(page_table_ptr + a * stride_pt, a_off + j * c_in + c, j_ok, R)
        w = tl.load(pool_ptr + rows[:, None] * W + col[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    tl.store(v_ptr + (split * num_tokens + t) * BLOCK_R + j, acc)


@_jit_per_step
def _expand_token_kernel(
    y_ptr,
    stride_yt,
    pool_ptr,
    v_ptr,
    v_stride,
    v_col_ptr,
    token_adapter_ptr,
    rank_ptr,
    scale_ptr,
    page_table_ptr,
    stride_pt,
    b_offset_ptr,
    layer_active_ptr,
    stride_la,
    module,
    layer,
    num_tokens,
    d_out,
    c_out,
    splits,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[t, n] += (sum_split v[split, t, c:c+r]) @ B_a[:, n] * scale[a], for the BLOCK_N columns n of this
    program (c = v_col[a, module]: where the module's r values lie in its shrink's output)."""
    t = tl.program_id(0)
    a = tl.load(token_adapter_ptr + t)
    if a < 0:
        return
    b_off, skip = _block_offset(a, module, layer, b_offset_ptr, layer_active_ptr, stride_la)
    if skip:
        return
    j = tl.arange(0, BLOCK_R)
    j_ok = j < tl.load(rank_ptr + a)
    v_col = tl.load(v_col_ptr + a * 7 + module)
    v = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(splits):
        v += tl.load(v_ptr + (split * num_tokens + t) * v_stride + v_col + j, mask=j_ok, other=0.0)
    blocks_per_chunk = (W + BLOCK_N - 1) // BLOCK_N
    nb = tl.program_id(1)
    c = nb // blocks_per_chunk
    col = (nb % blocks_per_chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (col < W) & (c * W + col < d_out)
    rows = _rows(page_table_ptr + a * stride_pt, b_off + j * c_out + c, j_ok, R)
    w = tl.load(pool_ptr + rows[:, None] * W + col[None, :], mask=j_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.sum(v[:, None] * w.to(tl.float32), axis=0) * tl.load(scale_ptr + a)
    y_ptrs = y_ptr + t * stride_yt + c * W + col
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_ok)


@_jit_per_step
def _shrink_segment_kernel(
    x_ptr,
    stride_xt,
    pool_ptr,
    v_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    rank_ptr,
    page_table_ptr,
    stride_pt,
    a_offset_ptr,
    layer_active_ptr,
    stride_la,
    module,
    layer,
    num_tokens,
    d_in,
    c_in,
    splits,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """v[split, tile, :] = x[tile, this split's k] @ A_a[:, k]^T   (tile: BLOCK_M tokens of segment s)"""
    s = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(seg_len_ptr + s)
    if tile * BLOCK_M >= length:
        return
    a = tl.load(seg_adapter_ptr + s)
    a_off, skip = _block_offset(a, module, layer, a_offset_ptr, layer_active_ptr, stride_la)
    if skip:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    tokens = tl.load(seg_start_ptr + s) + offs_m
    j = tl.arange(0, BLOCK_R)
    j_ok = j < tl.load(rank_ptr + a * 7 + module)
    cols = tl.arange(0, BLOCK_K)
    blocks_per_chunk = (W + BLOCK_K - 1) // BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for kb in range(split, c_in * blocks_per_chunk, splits):
        c = kb // blocks_per_chunk
        col = (kb % blocks_per_chunk) * BLOCK_K + cols
        k_ok = (col < W) & (c * W + col < d_in)
        xk = tl.load(
            x_ptr + tokens[:, None] * stride_xt + c * W + col[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        rows = _rows(page_table_ptr + a * stride_pt, a_off + j * c_in + c, j_ok, R)
        w = tl.load(
            pool_ptr + rows[None, :] * W + col[:, None], mask=k_ok[:, None] & j_ok[None, :], other=0.0
        )  # A^T tile [BLOCK_K, BLOCK_R]
        acc = tl.dot(xk, w, acc, input_precision=PRECISION)
    v_ptrs = v_ptr + (split * num_tokens + tokens[:, None]) * BLOCK_R + j[None, :]
    tl.store(v_ptrs, acc, mask=m_ok[:, None])


@_jit_per_step
def _expand_segment_kernel(
    y_ptr,
    stride_yt,
    pool_ptr,
    v_ptr,
    v_stride,
    v_col_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    rank_ptr,
    scale_ptr,
    page_table_ptr,
    stride_pt,
    b_offset_ptr,
    layer_active_ptr,
    stride_la,
    module,
    layer,
    num_tokens,
    d_out,
    c_out,
    splits,
    W: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[tile, n] += (sum_split v[split, tile, c:c+r]) @ B_a[:, n] * scale[a], for this program's BLOCK_N
    columns (c = v_col[a, module])."""
    s = tl.program_id(0)
    tile = tl.program_id(1)
    length = tl.load(seg_len_ptr + s)
    if tile * BLOCK_M >= length:
        return
    a = tl.load(seg_adapter_ptr + s)
    b_off, skip = _block_offset(a, module, layer, b_offset_ptr, layer_active_ptr, stride_la)
    if skip:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    tokens = tl.load(seg_start_ptr + s) + offs_m
    j = tl.arange(0, BLOCK_R)
    j_ok = j < tl.load(rank_ptr + a)
    v_col = tl.load(v_col_ptr + a * 7 + module)
    v = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(splits):
        v_ptrs = v_ptr + (split * num_tokens + tokens[:, None]) * v_stride + v_col + j[None, :]
        v += tl.load(v_ptrs, mask=m_ok[:, None] & j_ok[None, :], other=0.0)
    blocks_per_chunk = (W + BLOCK_N - 1) // BLOCK_N
    nb = tl.program_id(2)
    c = nb // blocks_per_chunk
    col = (nb % blocks_per_chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (col < W) & (c * W + col < d_out)
    rows = _rows(page_table_ptr + a * stride_pt, b_off + j * c_out + c, j_ok, R)
    w = tl.load(pool_ptr + rows[:, None] * W + col[None, :], mask=j_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(v.to(w.dtype), w, input_precision=PRECISION) * tl.load(scale_ptr + a)  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + c * W + col[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


_SMS: dict[torch.device, int] = {}


def _num_splits(programs: int, k_blocks: int, device: torch.device) -> int:
    """Split the d_in reduction until the shrink fills the GPU (about two programs per SM); 1 on CPU."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(k_blocks, 16, triton.cdiv(2 * _SMS[device], max(programs, 1))))


def _token_block(block_r: int, row_width: int) -> int:
    """The token path's BLOCK_K and BLOCK_N: weight tiles of at most 8192 elements, so that a
    [BLOCK_R, BLOCK_K] tile stays in registers at rank 128."""
    return min(triton.next_power_of_2(row_width), max(16, 8192 // block_r))


@dataclass(frozen=True)
class _Expand:
    """One module a shrink feeds: its output in the group and its expand's block sizes."""

    module: int
    slot: int  # index of the module in its group: the output it updates
    block_r: int  # covers the largest rank among the adapters targeting the module
    block_n: int
    grid: tuple[int, ...]  # its expand kernel's launch grid


@dataclass(frozen=True)
class _Shrink:
    """One shrink of the step and the expands that read it, decided once (see `prepare_lora_triton`)."""

    key: int  # the shrink's first module: its column in the shrink tables
    layers: frozenset[int]  # layers in which some adapter has weights for it
    path: str  # "token" or "segment"
    block_r: int  # covers the most A rows an adapter has in the shrink (k modules x rank)
    block_k: int
    block_m: int
    splits: int
    v: torch.Tensor  # float32 [splits, T, block_r]: the shrink's output, the expands' input
    expands: tuple[_Expand, ...]
    grid: tuple[int, ...]  # its shrink kernel's launch grid


def _shrink(
    plan: LoraPlan, shrink: tuple[int, ...], group: tuple[int, ...], device: torch.device, path: str, splits: int | None
) -> _Shrink | None:
    key = shrink[0]
    targeting = [a for a, ranks in enumerate(plan.shrink_ranks) if ranks[key] > 0]
    if not targeting or plan.num_tokens == 0:
        return None
    layers = frozenset(i for a in targeting for i, on in enumerate(plan.layers_active[a]) if on)
    block_r = _pow2_at_least(max(plan.shrink_ranks[a][key] for a in targeting), 16)  # tl.dot needs K >= 16 on GPU
    w, width = plan.row_width, triton.next_power_of_2(plan.row_width)
    if path == "auto":
        path = "token" if plan.max_seg_len <= TOKEN_PATH_MAX_SEG_LEN else "segment"
    tile = max(16, min(width, 64))  # the segment path's BLOCK_K and BLOCK_N: tl.dot needs K and N >= 16 on GPU
    if path == "token":
        block_k, block_m, rows = _token_block(block_r, w), 1, (plan.num_tokens,)  # a program per token
    else:
        block_m = 16 if plan.max_seg_len <= 16 or device.type != "cuda" else 32
        block_k, rows = tile, (len(plan.segments), triton.cdiv(plan.max_seg_len, block_m))  # per segment tile
    splits = splits or _num_splits(math.prod(rows), plan.c_in[key] * triton.cdiv(w, block_k), device)
    v = torch.empty(splits, plan.num_tokens, block_r, dtype=torch.float32, device=device)
    expands = []
    for m in shrink:
        using = [plan.ranks[a] for a in targeting if plan.a_offsets[a][m] >= 0]
        if using:
            expand_r = _pow2_at_least(max(using), 16)
            block_n = _token_block(expand_r, w) if path == "token" else tile
            grid = (*rows, plan.c_out[m] * triton.cdiv(w, block_n))
            expands.append(_Expand(m, group.index(m), expand_r, block_n, grid))
    return _Shrink(key, layers, path, block_r, block_k, block_m, splits, v, tuple(expands), (*rows, splits))


def prepare_lora_triton(
    plan: LoraPlan, dtype: torch.dtype, *, path: str = "auto", splits: int | None = None
) -> list[list[_Shrink]]:
    """Per group of `plan.groups`: its shrinks' path, block sizes, splits, v buffer and expands (a
    shrink no adapter uses is left out). `path` ("auto", "token", "segment") and `splits` are for
    tests and benchmarks; the result does not depend on them beyond rounding."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
    plan.check_pool_dtype_rows("triton")
    device = plan.tables.rank.device
    prepared = []
    for group in plan.groups:
        shrinks = (_shrink(plan, shrink, group, device, path, splits) for shrink in plan.shrinks if shrink[0] in group)
        prepared.append([p for p in shrinks if p is not None])
    return prepared


def prepare_lora_triton_graph(plan: LoraPlan, dtype: torch.dtype, max_rank: int) -> list[list[_Shrink]]:
    """What a captured decode step launches, for a plan from `kernels.graph_tables.graph_lora_plan`:
    a shrink per module (the step is staged with `fuse_shrinks=False`), each on the token path in
    every layer (the kernels skip tokens without an adapter and adapters without the module or
    layer, from the tables), with a rank block covering `max_rank` (the largest the engine
    accepts), and splits and v buffers sized for the plan's tokens. Nothing in it depends on a
    particular step, so one graph serves every step of its batch size."""
    device, tokens, w = plan.tables.rank.device, plan.num_tokens, plan.row_width
    block_r = _pow2_at_least(max_rank, 16)
    block = _token_block(block_r, w)
    every_layer = frozenset(range(plan.tables.layer_active.shape[1]))
    prepared = []
    for group in plan.groups:
        shrinks = []
        for slot, m in enumerate(group):
            splits = _num_splits(tokens, plan.c_in[m] * triton.cdiv(w, block), device)
            v = torch.empty(splits, tokens, block_r, dtype=torch.float32, device=device)
            expand = _Expand(m, slot, block_r, block, (tokens, plan.c_out[m] * triton.cdiv(w, block)))
            shrinks.append(_Shrink(m, every_layer, "token", block_r, block, 1, splits, v, (expand,), (tokens, splits)))
        prepared.append(shrinks)
    return prepared


def lora_apply_triton(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, plan: LoraPlan, layer: int, module: int
) -> None:
    """y[t] += ((x[t] @ A^T) @ B) * scale[a] for every token t of an adapter segment (see module doc),
    after checking the arguments, for a plan whose groups hold the module alone (as kernel tests
    and benchmarks build them). Shapes: y [T, d_out] (in place), x [T, d_in], pool_layer [rows, W].
    `plan.prepared` must come from `prepare_lora_triton`."""
    _check(y, x, pool_layer, plan, module)
    group = next((g for g, modules in enumerate(plan.groups) if module in modules), None)
    if group is None or plan.groups[group] != (module,):
        raise ValueError(f"module {module} must be a group of its own in the plan, not in {plan.groups}")
    _launch((y,), x, pool_layer, plan, layer, group)


def _check(y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, plan: LoraPlan, module: int) -> None:
    if not 0 <= module < len(LORA_MODULES):
        raise ValueError(f"module index {module} is not in [0, {len(LORA_MODULES)})")
    name = LORA_MODULES[module]
    d_in, d_out = plan.d_in[module], plan.d_out[module]
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != d_in or y.shape[1] != d_out or x.shape[0] != y.shape[0]:
        raise ValueError(f"{name}: expected x [T, {d_in}] and y [T, {d_out}], got x {list(x.shape)}, y {list(y.shape)}")
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"{name}: x has {x.shape[0]} tokens, the LoRA plan {plan.num_tokens}")
    if pool_layer.dim() != 2 or pool_layer.shape[1] != plan.row_width:
        raise ValueError(f"pool_layer must be [rows, {plan.row_width}], got {list(pool_layer.shape)}")
    if not pool_layer.is_contiguous():
        raise ValueError("pool_layer must be contiguous (row stride == row width)")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"x and y need unit stride along features, got {x.stride()} and {y.stride()}")
    if not x.dtype == y.dtype == pool_layer.dtype:
        raise ValueError(f"x, y and pool_layer must share a dtype, got {x.dtype}, {y.dtype}, {pool_layer.dtype}")
    tables = plan.tables.all()
    devices = {t.device for t in (y, x, pool_layer, *tables)}
    if len(devices) != 1:
        raise ValueError(f"x, y, pool_layer and the LoRA plan's tables must be on one device, got {devices}")
    integer = [t for t in tables if t is not plan.tables.scale]
    if any(t.dtype != torch.int32 for t in integer) or plan.tables.scale.dtype != torch.float32:
        raise ValueError("LoRA tables must be int32 (scale float32)")
    if any(not t.is_contiguous() for t in tables):
        raise ValueError("LoRA tables must be contiguous")
    if not isinstance(plan.prepared, list):
        raise ValueError("the LoRA plan was not prepared for the triton backend (prepare_lora_triton)")


def _launch(
    outputs: Sequence[torch.Tensor], x: torch.Tensor, pool_layer: torch.Tensor, plan: LoraPlan, layer: int, group: int
) -> None:
    t = plan.tables
    num_tokens, w, rpp = plan.num_tokens, plan.row_width, plan.rows_per_page
    common = (t.page_table, t.page_table.stride(0))
    active = (t.layer_active, t.layer_active.stride(0))
    segs = (t.seg_start, t.seg_len, t.seg_adapter)
    precision = "ieee" if x.dtype == torch.float32 else None  # exact float32 products, not tf32
    for p in plan.prepared[group]:
        if layer not in p.layers:
            continue
        c_in = plan.c_in[p.key]
        shrink = (x, x.stride(0), pool_layer, p.v)
        shrink_tail = (*common, t.shrink_a_offset, *active, p.key, layer, num_tokens, plan.d_in[p.key], c_in, p.splits)
        if p.path == "token":
            _shrink_token_kernel[p.grid](
                *shrink, t.token_adapter, t.shrink_rank, *shrink_tail, W=w, R=rpp, BLOCK_R=p.block_r, BLOCK_K=p.block_k
            )
        else:
            _shrink_segment_kernel[p.grid](
                *shrink,
                *segs,
                t.shrink_rank,
                *shrink_tail,
                W=w,
                R=rpp,
                BLOCK_M=p.block_m,
                BLOCK_R=p.block_r,
                BLOCK_K=p.block_k,
                PRECISION=precision,
            )
        for e in p.expands:
            y = outputs[e.slot]
            expand = (y, y.stride(0), pool_layer, p.v, p.block_r, t.v_col)
            tail = (t.rank, t.scale, *common, t.b_offset, *active, e.module, layer, num_tokens)
            tail += (plan.d_out[e.module], plan.c_out[e.module], p.splits)
            if p.path == "token":
                _expand_token_kernel[e.grid](
                    *expand, t.token_adapter, *tail, W=w, R=rpp, BLOCK_R=e.block_r, BLOCK_N=e.block_n
                )
            else:
                _expand_segment_kernel[e.grid](
                    *expand,
                    *segs,
                    *tail,
                    W=w,
                    R=rpp,
                    BLOCK_M=p.block_m,
                    BLOCK_R=e.block_r,
                    BLOCK_N=e.block_n,
                    PRECISION=precision,
                )


# The engine's path: a group's shrinks and expands, launches only (see the module docstring).
lora_apply_triton_group = _launch
