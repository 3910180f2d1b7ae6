"""Paged attention over the unified pool, in Triton: the same semantics as `attention_torch`.

    write:  pool[K row of new token t] = k[t];  pool[V row of t] = v[t]
    attend: for each sequence b, new token i at position p = context_len[b] - query_len[b] + i:
                out[t, h] = softmax(q[t, h] · K_g[0..p]^T * scale) · V_g[0..p],   g = h // (H / H_kv)
            keys at positions <= p - window masked when there is a sliding window;
            K_g[s] = pool[page_table[b, s // tp] * 2tp + s % tp, g*D : (g+1)*D],  V_g[s]: that row + tp

Shapes: q [T, H, D]; k, v [T, H_kv * D]; pool_layer [rows, H_kv * D]; out [T, H, D].

One kernel, flash-attention style (online softmax in float32, exp2 with the scale folded in), launched
twice per step: once over the decode sequences (query_len 1) and once over the prefill chunks
(query_len > 1, possibly after earlier cached context: chunked prefill). A program owns one sequence,
one KV head g and a tile of BLOCK_Q query tokens, and packs the G = H / H_kv query heads that share
g into the rows of its query tile, so every K/V block is read once for all of them:

    row i of the tile: query token q0 + i // G_PAD, query head g*G + i % G_PAD   (M = BLOCK_Q * G_PAD rows)
    for key blocks [s0, s0 + BLOCK_N) from the window's start to the tile's last position:
        S = Q_tile @ K_blk^T (tl.dot), masked causally / by the window; online-softmax update of O

    decode:  grid (decode sequences, 1, H_kv),                          BLOCK_Q = 1, G_PAD >= 16
    prefill: grid (prefill sequences, ceil(max query_len / BLOCK_Q), H_kv), BLOCK_Q * G_PAD >= 16
(M >= 16 and BLOCK_D >= 16 because tl.dot needs them on GPU; padded rows and dims are masked.)
Key positions are gathered through the page table per position, so tokens_per_page need not be a
power of two.

Split decode (flash-decoding): a few long sequences give too few programs to fill the GPU (one
sequence of 8 KV heads: 8 programs for 132 SMs on an H100, measured at 20x the bandwidth roofline
for a 4096-token context). Then the keys of each sequence are cut into SPLITS ranges of split_len
(a multiple of BLOCK_N), one program each, grid (decode sequences, SPLITS, H_kv); each writes its
unnormalised output and its running max and sum, and a second kernel combines the ranges:

    m = max_s m_s;   l = sum_s l_s 2^(m_s - m);   out = sum_s acc_s 2^(m_s - m) / l
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraserve.kernels.attention_torch import write_kv_torch
from loraserve.kernels.metadata import AttentionBatch

_LOG2E = math.log2(math.e)


def write_kv_triton(pool_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
    """pool[new_rows[t]] = k[t]; pool[new_rows[t] + tp] = v[t].   k, v: [T, H_kv * D]

    Two torch index_copy_ calls (the torch backend's own): a scatter of T rows is bandwidth-bound
    and not a hot spot, so it has no Triton kernel of its own.
    """
    write_kv_torch(pool_layer, k, v, batch)


# The page table's row stride and the split length change from step to step: no variant per value.
@triton.jit(do_not_specialize=["stride_pt", "split_len"])
def _attention_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    out_ptr,
    stride_ot,
    stride_oh,
    pool_ptr,
    stride_row,
    seq_index_ptr,
    query_start_ptr,
    context_len_ptr,
    page_table_ptr,
    stride_pt,
    qk_scale,
    window,
    group,
    head_dim,
    split_len,
    partial_ptr,
    max_sum_ptr,
    TP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """out[tile rows] = softmax(Q K^T * scale, causal/window-masked) V over sequence b's cached keys.

    SPLIT (decode only): program_id(1) is a range of split_len keys, and the program writes its
    unnormalised rows to partial_ptr and their running max and sum to max_sum_ptr instead.
    """
    b = tl.load(seq_index_ptr + tl.program_id(0))
    q_tile = 0 if SPLIT else tl.program_id(1)
    g = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_begin
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_len_ptr + b)

    i = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q_tile * BLOCK_Q + i // G_PAD  # query token of each row, within the sequence's new tokens
    hg = i % G_PAD
    row_ok = (qi < q_len) & (hg < group)
    head = g * group + hg
    q_pos = ctx - q_len + qi  # [M]: position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    tokens = q_begin + qi
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, BLOCK_D]

    first = ctx - q_len + q_tile * BLOCK_Q  # smallest query position in the tile
    last = tl.minimum(first + BLOCK_Q, ctx) - 1  # largest
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0) // BLOCK_N * BLOCK_N  # window's first key
    hi = last + 1
    if SPLIT:  # this program's range of keys; split_len is a multiple of BLOCK_N, so lo stays aligned
        lo += tl.program_id(1) * split_len
        hi = tl.minimum(lo + split_len, hi)
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, BLOCK_D], dtype=tl.float32)
    pages = page_table_ptr + b * stride_pt
    for s0 in range(lo, hi, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        s_ok = s <= last
        k_rows = tl.load(pages + s // TP, mask=s_ok, other=0).to(tl.int64) * (2 * TP) + s % TP
        kv_cols = g * head_dim + d
        k = tl.load(
            pool_ptr + k_rows[None, :] * stride_row + kv_cols[:, None], mask=d_ok[:, None] & s_ok[None, :], other=0.0
        )  # K^T [BLOCK_D, BLOCK_N]
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [M, BLOCK_N], log2 units
        allowed = s_ok[None, :] & (s[None, :] <= q_pos[:, None])
        allowed &= (window <= 0) | (s[None, :] > q_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            pool_ptr + (k_rows + TP)[:, None] * stride_row + kv_cols[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:  # slot (sequence, split, KV head) of the scratch buffers, G_PAD rows each
        slot = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + g
        tl.store(partial_ptr + (slot * G_PAD + i[:, None]) * BLOCK_D + d[None, :], acc)
        tl.store(max_sum_ptr + (slot * G_PAD + i) * 2, m_i)
        tl.store(max_sum_ptr + (slot * G_PAD + i) * 2 + 1, l_i)
        return
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    partial_ptr,
    max_sum_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    seq_index_ptr,
    query_start_ptr,
    group,
    head_dim,
    num_splits,
    G_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[token of sequence b, heads of g] = the split ranges' outputs, rescaled to one softmax."""
    b = tl.load(seq_index_ptr + tl.program_id(0))
    g = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    i = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        slot = (tl.program_id(0) * num_splits + split) * num_kv_heads + g
        m = tl.maximum(m, tl.load(max_sum_ptr + (slot * G_PAD + i) * 2))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        slot = (tl.program_id(0) * num_splits + split) * num_kv_heads + g
        weight = tl.math.exp2(tl.load(max_sum_ptr + (slot * G_PAD + i) * 2) - m_safe)  # 0 for an empty range
        total += tl.load(max_sum_ptr + (slot * G_PAD + i) * 2 + 1) * weight
        acc += tl.load(partial_ptr + (slot * G_PAD + i[:, None]) * BLOCK_D + d[None, :]) * weight[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    token = tl.load(query_start_ptr + b)
    head = g * group + i
    tl.store(
        out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(i < group)[:, None] & (d < head_dim)[None, :],
    )


# Keys per split range at least (below that a range's fixed cost outweighs the parallelism gained).
MIN_SPLIT_KEYS = 256


def decode_splits(programs: int, key_span: int, block_n: int, device: torch.device) -> int:
    """Split ranges per decode sequence: enough programs for about two per SM, ranges of at least
    MIN_SPLIT_KEYS keys; 1 (no split) when the sequences alone fill the GPU, and on CPU."""
    if device.type != "cuda" or programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, key_span // max(MIN_SPLIT_KEYS, block_n)))


def _sequence_groups(batch: AttentionBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(decode sequence indices, prefill sequence indices, longest prefill chunk, longest decode
    context), built once per step."""
    key = "triton_sequence_groups"
    if key not in batch.cache:
        decode = [b for b, n in enumerate(batch.query_lens) if n == 1]
        prefill = [b for b, n in enumerate(batch.query_lens) if n > 1]
        longest = max((batch.query_lens[b] for b in prefill), default=0)
        context = max((batch.context_lens[b] for b in decode), default=0)
        as_tensor = lambda idx: torch.tensor(idx, dtype=torch.int32, device=device)  # noqa: E731
        batch.cache[key] = (as_tensor(decode), as_tensor(prefill), longest, context)
    return batch.cache[key]


def _check(q: torch.Tensor, pool_layer: torch.Tensor, batch: AttentionBatch, num_kv_heads: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {list(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into groups of {num_kv_heads} KV heads")
    if pool_layer.dim() != 2 or pool_layer.shape[1] != num_kv_heads * head_dim or pool_layer.stride(1) != 1:
        raise ValueError(
            f"pool_layer must be [rows, {num_kv_heads} * {head_dim}] with unit column stride, "
            f"got {list(pool_layer.shape)} strides {pool_layer.stride()}"
        )
    if q.stride(2) != 1:
        raise ValueError(f"q needs unit stride along head_dim, got strides {q.stride()}")
    if q.dtype != pool_layer.dtype:
        raise ValueError(f"q and pool_layer must share a dtype, got {q.dtype} and {pool_layer.dtype}")
    if batch.query_starts and batch.query_starts[-1] != num_tokens:
        raise ValueError(f"q has {num_tokens} tokens, the attention batch {batch.query_starts[-1]}")
    tables = (batch.query_start, batch.context_len, batch.page_table)
    if any(t.device != q.device for t in (pool_layer, *tables)):
        raise ValueError("q, pool_layer and the attention batch's tables must be on one device")
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in tables):
        raise ValueError("AttentionBatch's query_start, context_len and page_table must be contiguous int32")


def attention_triton(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    batch: AttentionBatch,
    num_kv_heads: int,
    scale: float,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """out[t, h] = softmax(q[t, h] · K^T * scale) · V over the sequence's cached keys (module doc).

    Shapes: q [T, H, D], pool_layer [rows, H_kv * D] -> out [T, H, D] (same dtype as q).
    `splits` (split ranges per decode sequence; default: decode_splits) is for tests and
    benchmarks; the result does not depend on it beyond rounding.
    """
    _check(q, pool_layer, batch, num_kv_heads)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    decode, prefill, longest, context = _sequence_groups(batch, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    g_pad = triton.next_power_of_2(group)
    on_gpu = q.device.type == "cuda"
    args = (
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        pool_layer,
        pool_layer.stride(0),
    )
    meta = dict(TP=batch.tokens_per_page, BLOCK_D=block_d, PRECISION="ieee" if q.dtype == torch.float32 else None)
    scalars = (scale * _LOG2E, batch.sliding_window or 0, group, head_dim)
    tables = (batch.query_start, batch.context_len, batch.page_table, batch.page_table.stride(0))
    block_n = 64 if on_gpu else 16
    unsplit = (0, out, out)  # split_len and the scratch buffers, unused
    if decode.numel():
        n, g_rows = decode.numel(), max(16, g_pad)
        # keys a decode program walks: its context, or its window from a block-aligned start
        span = max(1, min(context, batch.sliding_window + block_n - 1) if batch.sliding_window else context)
        splits = splits or decode_splits(n * num_kv_heads, span, block_n, q.device)
        split_len = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n
        splits = triton.cdiv(span, split_len)  # no empty trailing range
        if splits == 1:
            _attention_kernel[(n, 1, num_kv_heads)](
                *args,
                decode,
                *tables,
                *scalars,
                *unsplit,
                G_PAD=g_rows,
                BLOCK_Q=1,
                BLOCK_N=block_n,
                SPLIT=False,
                **meta,
            )
        else:
            slots = n * splits * num_kv_heads * g_rows
            partial = torch.empty(slots * block_d, dtype=torch.float32, device=q.device)
            max_sum = torch.empty(slots * 2, dtype=torch.float32, device=q.device)
            _attention_kernel[(n, splits, num_kv_heads)](
                *args,
                decode,
                *tables,
                *scalars,
                split_len,
                partial,
                max_sum,
                G_PAD=g_rows,
                BLOCK_Q=1,
                BLOCK_N=block_n,
                SPLIT=True,
                **meta,
            )
            _combine_splits_kernel[(n, num_kv_heads)](
                partial,
                max_sum,
                out,
                out.stride(0),
                out.stride(1),
                decode,
                batch.query_start,
                group,
                head_dim,
                splits,
                G_PAD=g_rows,
                BLOCK_D=block_d,
            )
    if prefill.numel():
        block_q = max(1, (64 if on_gpu else 16) // g_pad)
        _attention_kernel[(prefill.numel(), triton.cdiv(longest, block_q), num_kv_heads)](
            *args,
            prefill,
            *tables,
            *scalars,
            *unsplit,
            G_PAD=g_pad,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            SPLIT=False,
            **meta,
        )
    return out
