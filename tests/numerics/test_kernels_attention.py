"""Triton paged attention against the torch reference and a float32 dense recomputation.

Sweeps: MHA and GQA (groups of 2, 3 and 8 query heads per KV head); head_dim 16 and 32 (and 128
on GPU); pages in random order, tokens_per_page odd and even; decode-only, prefill-only and mixed
steps, with chunked prefill (query_len > 1 after earlier cached context) and one-token contexts;
with and without a sliding window. The dense reference attends each query over its sequence's
keys in plain float32, from the K/V vectors as the pool stores them.

Every test that runs a kernel takes `kernel_device` (conftest): on a machine without CUDA the
kernels run in Triton's interpreter on CPU tensors; with CUDA the same tests run compiled on the
GPU (marked `gpu`, with the GPU's tile sizes), and `test_gpu_real_sizes` adds head_dim 128 and
contexts up to 2048.

Tolerance (absolute and relative, on the attention output, |out| <= ~2): see TOL below.
"""

from __future__ import annotations

import pytest
import torch
import triton
from helpers import needs_cuda

from loraserve.bench.common.kernel_cases import AttentionCase, make_attention_case
from loraserve.kernels.attention_torch import attention_torch, write_kv_torch
from loraserve.kernels.attention_triton import MIN_SPLIT_KEYS, attention_triton, decode_splits, write_kv_triton

TOL = {  # dtype -> (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
# (context_len, query_len): decodes (one after a one-token context), a fresh prompt longer than a
# query tile, chunked prefills after earlier context, a chunk of 2.
MIXED = [(7, 1), (1, 1), (21, 21), (30, 9), (12, 2), (40, 1)]
HEADS = {"mha": (2, 2, 32), "gqa2": (4, 2, 16), "gqa3": (6, 2, 16), "gqa8": (8, 1, 16)}  # (H, H_kv, D)

gpu = pytest.mark.gpu


def dense_reference(case: AttentionCase, num_heads: int, num_kv_heads: int, scale: float) -> torch.Tensor:
    """float32 [T, H, D]: every query over its own sequence's keys, causal, windowed."""
    batch, group = case.batch, num_heads // num_kv_heads
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    q32 = case.q.float().cpu()
    for b, (ctx, q_len) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        keys = case.keys[b].repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = case.values[b].repeat_interleave(group, dim=1)
        for i in range(q_len):
            t, pos = batch.query_starts[b] + i, ctx - q_len + i
            lo = max(0, pos - batch.sliding_window + 1) if batch.sliding_window else 0
            scores = torch.einsum("hd,shd->hs", q32[t], keys[lo : pos + 1]) * scale
            out[t] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), values[lo : pos + 1])
    return out


def _check(case: AttentionCase, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    head_dim = case.q.shape[2]
    scale = head_dim**-0.5
    before = case.pool_layer.clone()
    write_kv_triton(case.pool_layer, case.k, case.v, case.batch)
    write_kv_torch(before, case.k, case.v, case.batch)
    assert torch.equal(case.pool_layer, before)
    expected = attention_torch(case.q, case.pool_layer, case.batch, num_kv_heads, scale)
    out = attention_triton(case.q, case.pool_layer, case.batch, num_kv_heads, scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    dense = dense_reference(case, num_heads, num_kv_heads, scale)
    torch.testing.assert_close(out.float().cpu(), dense, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step(dtype: torch.dtype, heads: str, window: int | None, kernel_device: str):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    case = make_attention_case(
        MIXED, num_heads, num_kv_heads, head_dim, 3, dtype, device=kernel_device, sliding_window=window
    )
    _check(case, num_heads, num_kv_heads, dtype)


@pytest.mark.parametrize(
    "seqs",
    [[(9, 1), (17, 1), (4, 1), (33, 1)], [(16, 16), (5, 5), (26, 8)]],
    ids=["decode-only", "prefill-only"],
)
def test_decode_only_and_prefill_only(seqs: list[tuple[int, int]], kernel_device: str):
    case = make_attention_case(seqs, 4, 2, 16, 4, torch.float32, device=kernel_device, seed=1)
    _check(case, 4, 2, torch.float32)


def test_window_longer_than_context_and_one_token_pages(kernel_device: str):
    case = make_attention_case(
        [(6, 3), (3, 1)], 2, 1, 16, 1, torch.float32, device=kernel_device, sliding_window=100, seed=2
    )
    _check(case, 2, 1, torch.float32)


def test_rejects_bad_arguments(kernel_device: str):
    case = make_attention_case([(4, 2)], 4, 2, 16, 2, torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="share a dtype"):
        attention_triton(case.q.half(), case.pool_layer, case.batch, 2, 0.25)
    with pytest.raises(ValueError, match="groups"):
        attention_triton(case.q, case.pool_layer, case.batch, 3, 0.25)
    with pytest.raises(ValueError, match=r"\[rows, 2 \* 16\]"):
        attention_triton(case.q, case.pool_layer[:, :16], case.batch, 2, 0.25)
    with pytest.raises(ValueError, match="tokens"):
        attention_triton(case.q[:1], case.pool_layer, case.batch, 2, 0.25)
    if kernel_device == "cuda":  # CPU tensors are refused before they reach a kernel compiled for the GPU
        with pytest.raises(ValueError, match="one device"):
            attention_triton(case.q.cpu(), case.pool_layer.cpu(), case.batch, 2, 0.25)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_real_sizes(dtype: torch.dtype, window: int | None):
    seqs = [(700, 1), (1, 1), (1500, 1), (513, 513), (2048, 300), (90, 2)] + [(n, 1) for n in range(20, 400, 37)]
    case = make_attention_case(seqs, 32, 8, 128, 16, dtype, device="cuda", sliding_window=window, seed=3)
    _check(case, 32, 8, dtype)


@pytest.mark.parametrize("splits", [2, 3, 50])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads", ["gqa3", "mha"])
def test_split_decode(splits: int, window: int | None, heads: str, kernel_device: str):
    """Flash-decoding: keys cut into ranges, one program each, then combined; a mixed step (the
    prefill chunks are not split), contexts shorter than a range (empty ranges) and windows."""
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    seqs = [(70, 1), (1, 1), (45, 1), (16, 1), (30, 9), (17, 1)]
    case = make_attention_case(
        seqs, num_heads, num_kv_heads, head_dim, 3, torch.float32, device=kernel_device, sliding_window=window, seed=4
    )
    scale = head_dim**-0.5
    write_kv_triton(case.pool_layer, case.k, case.v, case.batch)
    out = attention_triton(case.q, case.pool_layer, case.batch, num_kv_heads, scale, splits=splits)
    atol, rtol = TOL[torch.float32]
    expected = attention_torch(case.q, case.pool_layer, case.batch, num_kv_heads, scale)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    dense = dense_reference(case, num_heads, num_kv_heads, scale)
    torch.testing.assert_close(out.cpu(), dense, atol=atol, rtol=rtol)


def test_decode_splits_policy():
    """No split on CPU or when the sequences fill the GPU; ranges of at least MIN_SPLIT_KEYS keys."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_splits(8, 4096, 64, cpu) == 1
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(cuda).multi_processor_count
        assert decode_splits(8, 4096, 64, cuda) == min(triton.cdiv(2 * sms, 8), 4096 // MIN_SPLIT_KEYS)
        assert decode_splits(4 * sms, 4096, 64, cuda) == 1
        assert decode_splits(8, MIN_SPLIT_KEYS - 1, 64, cuda) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stale_rows_past_the_context_do_not_leak(backend: str, kernel_device: str):
    """A page's rows past its sequence's context hold what the page held before — another request's
    values, NaN included (a request that broke down). They must not reach any output: a masked
    weight of 0 times NaN is NaN, so masking the scores alone is not enough."""
    case = make_attention_case(MIXED, 4, 2, 16, 4, torch.float32, device=kernel_device, seed=5)
    write_kv_triton(case.pool_layer, case.k, case.v, case.batch)
    attend = attention_torch if backend == "torch" else attention_triton
    clean = attend(case.q, case.pool_layer, case.batch, 2, 0.25)
    tp, table = case.batch.tokens_per_page, case.batch.page_table.cpu()
    for b, ctx in enumerate(case.batch.context_lens):
        for pos in range(ctx, triton.cdiv(ctx, tp) * tp):  # the rest of the sequence's last page
            row = int(table[b, pos // tp]) * 2 * tp + pos % tp
            case.pool_layer[row] = float("nan")  # K
            case.pool_layer[row + tp] = float("nan")  # V
    assert torch.equal(attend(case.q, case.pool_layer, case.batch, 2, 0.25), clean)
