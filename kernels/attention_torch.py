"""Paged attention over the unified pool, in plain torch: the reference and the CPU path.

    write:  pool[K row of new token t] = k[t];  pool[V row of t] = v[t]
    attend: for each sequence b, new token i at position p = context_len[b] - query_len[b] + i:
                out[t] = softmax(q[t] · K[0..p]^T * scale) · V[0..p]     (keys within the sliding
                window only, when there is one); query head h reads KV head h // (H / H_kv)

Shapes: q [T, H, D]; k, v [T, H_kv * D]; pool_layer [rows, H_kv * D]; out [T, H, D].
Sequences are gathered into a padded batch (decode-only sequences and prefill chunks apart, so a
long prompt does not pad every decode) and run through one scaled_dot_product_attention call.
A group's K and V rows come out of the pool in one gather. A key slot past its sequence's context
(padding, or a page's stale rows, which may hold another request's values, NaN included) reads
the sequence's own first key instead, which the mask then excludes: a masked weight of 0 times a
NaN would still be NaN. A decode group whose tokens are one span of the step reads and writes
that span in place. A decode group in float32 on the CPU runs `attention_cpu`'s C kernel instead,
which reads each sequence's keys where they lie, over its own context only; `native=False` keeps
every group on SDPA (the reference the kernel is tested against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraserve.kernels import attention_cpu
from loraserve.kernels.metadata import AttentionBatch


def write_kv_torch(pool_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
    pool_layer.index_copy_(0, batch.new_rows, k)
    pool_layer.index_copy_(0, batch.new_rows + batch.tokens_per_page, v)


@dataclass
class _Group:
    """Index tensors for one padded group of sequences, shared by every layer of the step."""

    query_index: torch.Tensor  # int64 [G, Qmax]: token of each (sequence, query slot)
    query_valid: torch.Tensor  # bool  [G, Qmax]
    span: slice | None  # decode groups: the group's tokens when they are one span of the step, in order
    kv_rows: torch.Tensor  # int64 [G, 2 * Smax]: K row of each key slot, then its V row
    mask: torch.Tensor  # bool  [G, 1, Qmax, Smax]: True where a query may attend a key
    keys: tuple[torch.Tensor, torch.Tensor] | None  # decode groups: int64 [G] first and end slot of the keys


def _groups(batch: AttentionBatch) -> list[_Group]:
    if "groups" in batch.cache:
        return batch.cache["groups"]
    decode = [b for b, n in enumerate(batch.query_lens) if n == 1]
    prefill = [b for b, n in enumerate(batch.query_lens) if n > 1]
    batch.cache["groups"] = [_build_group(batch, seqs) for seqs in (decode, prefill) if seqs]
    return batch.cache["groups"]


def _decode_span(batch: AttentionBatch, seqs: list[int]) -> slice | None:
    """The tokens of decode sequences `seqs` as one slice of the step, when they follow each other."""
    starts = [batch.query_starts[b] for b in seqs]
    if any(batch.query_lens[b] != 1 for b in seqs) or starts != list(range(starts[0], starts[0] + len(seqs))):
        return None
    return slice(starts[0], starts[0] + len(seqs))


def _build_group(batch: AttentionBatch, seqs: list[int]) -> _Group:
    device = batch.page_table.device
    idx = torch.tensor(seqs, device=device)
    q_lens = torch.tensor([batch.query_lens[b] for b in seqs], device=device)
    ctx = torch.tensor([batch.context_lens[b] for b in seqs], device=device)
    q_max, s_max = int(q_lens.max()), int(ctx.max())
    tp = batch.tokens_per_page

    slot = torch.arange(q_max, device=device)
    query_valid = slot[None, :] < q_lens[:, None]
    starts = batch.query_start.to(device=device, dtype=torch.int64)[idx]
    query_index = torch.where(query_valid, starts[:, None] + slot[None, :], 0)

    key_pos = torch.arange(s_max, device=device)
    pages = batch.page_table[idx][:, key_pos // tp].to(torch.int64)
    key_rows = pages * (2 * tp) + key_pos % tp
    key_rows = torch.where(key_pos[None, :] < ctx[:, None], key_rows, key_rows[:, :1])  # see the module docstring
    query_pos = (ctx - q_lens)[:, None] + slot[None, :]  # [G, Qmax]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if batch.sliding_window:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - batch.sliding_window
    mask &= query_valid[:, :, None]
    mask[:, :, 0] |= ~query_valid  # padded query slots attend key 0 rather than nothing (no NaN)
    kv_rows = torch.cat((key_rows, key_rows + tp), dim=1)
    keys = None
    if q_max == 1:  # a decode token attends keys [ctx - window, ctx) of its sequence
        keys = ((ctx - batch.sliding_window).clamp(min=0) if batch.sliding_window else torch.zeros_like(ctx), ctx)
    return _Group(query_index, query_valid, _decode_span(batch, seqs), kv_rows, mask[:, None], keys)


def attention_torch(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    batch: AttentionBatch,
    num_kv_heads: int,
    scale: float,
    native: bool = True,
) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    out = q.new_empty(q.shape)
    for group in _groups(batch):
        if native and group.keys is not None and attention_cpu.usable(q, pool_layer):  # decode, f32, CPU: in C
            _decode_in_c(q, pool_layer, group, scale, out)
            continue
        g, s_max = group.kv_rows.shape[0], group.kv_rows.shape[1] // 2
        kv = pool_layer.index_select(0, group.kv_rows.view(-1)).view(g, 2 * s_max, -1)  # [G, 2 * Smax, H_kv * D]
        k = kv[:, :s_max].view(g, s_max, num_kv_heads, head_dim).transpose(1, 2)
        v = kv[:, s_max:].view(g, s_max, num_kv_heads, head_dim).transpose(1, 2)
        span = group.span
        queries = q[span].unsqueeze(2) if span is not None else q[group.query_index].transpose(1, 2)  # [G, H, Qmax, D]
        if q.device.type == "cpu" and q.dtype != torch.float32:  # CPU SDPA: half precision is ~3x slower
            queries, k, v = queries.float(), k.float(), v.float()
        attended = F.scaled_dot_product_attention(
            queries, k, v, attn_mask=group.mask, scale=scale, enable_gqa=num_kv_heads != num_heads
        ).transpose(1, 2)  # [G, Qmax, H, D]
        attended = attended.to(q.dtype)
        if span is not None:
            out[span] = attended[:, 0]
        else:
            out[group.query_index[group.query_valid]] = attended[group.query_valid]
    return out


def _decode_in_c(q: torch.Tensor, pool_layer: torch.Tensor, group: _Group, scale: float, out: torch.Tensor) -> None:
    """A decode group through `attention_cpu`'s kernel: into out's span in place, or gathered and scattered."""
    kernel, (first, last) = attention_cpu.decode_kernel(), group.keys
    if group.span is not None:
        kernel(q[group.span], pool_layer, group.kv_rows, first, last, scale, out[group.span])
        return
    tokens = group.query_index[:, 0]
    attended = q.new_empty((tokens.shape[0], *q.shape[1:]))
    kernel(q[tokens], pool_layer, group.kv_rows, first, last, scale, attended)
    out[tokens] = attended
