"""The C decode attention (`kernels/attention_cpu.py`) against the torch path and a dense recomputation.

`attention_torch` runs decode groups in float32 on the CPU, on one thread, through the C kernel; with `native=False`
every group runs SDPA over gathered keys (the reference). Sweeps: MHA and GQA (2, 3 and 8 query heads
per KV head), head_dim 16 and 32, pages in random order, tokens_per_page odd and even, contexts of one
token to a few pages, with and without a sliding window; decode tokens that are one span of the step
(written in place) and decode tokens scattered among prefill chunks (gathered, then scattered back).
Tolerance: atol = rtol = 1e-5 (float32, different summation orders).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_attention import HEADS, dense_reference

from loraserve.bench.common.kernel_cases import make_attention_case
from loraserve.kernels import attention_cpu, native
from loraserve.kernels.attention_torch import attention_torch, write_kv_torch

TOL = 1e-5
DECODES = [(7, 1), (1, 1), (40, 1), (13, 1), (2, 1)]
SCATTERED = [(7, 1), (21, 21), (40, 1), (30, 9), (1, 1)]  # decode tokens between prefill chunks


@pytest.fixture(autouse=True)
def one_thread():
    """The kernel computes on one thread and runs where torch does (`attention_cpu.usable`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_kernel_builds_here():
    """Else every other test here would only compare the torch path with itself."""
    assert attention_cpu.decode_kernel() is not None


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tokens_per_page", [4, 5])
@pytest.mark.parametrize("seqs", [DECODES, SCATTERED], ids=["decode-span", "scattered"])
def test_decode_in_c_matches_the_torch_path(heads, window, tokens_per_page, seqs):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    case = make_attention_case(
        seqs, num_heads, num_kv_heads, head_dim, tokens_per_page, torch.float32, sliding_window=window, seed=3
    )
    write_kv_torch(case.pool_layer, case.k, case.v, case.batch)
    scale = head_dim**-0.5
    out = attention_torch(case.q, case.pool_layer, case.batch, num_kv_heads, scale)
    reference = attention_torch(case.q, case.pool_layer, case.batch, num_kv_heads, scale, native=False)
    torch.testing.assert_close(out, reference, atol=TOL, rtol=TOL)
    dense = dense_reference(case, num_heads, num_kv_heads, scale)
    torch.testing.assert_close(out, dense, atol=TOL, rtol=TOL)


def test_q_as_a_view_of_the_fused_projection():
    """The model passes q as the first heads of the roped q|k block: a strided view."""
    case = make_attention_case(DECODES, 6, 2, 16, 4, torch.float32, seed=4)
    write_kv_torch(case.pool_layer, case.k, case.v, case.batch)
    qk = torch.cat((case.q, torch.randn(case.q.shape[0], 2, 16)), dim=1)  # [T, H + H_kv, D]
    q = qk[:, :6]
    assert not q.is_contiguous()
    out = attention_torch(q, case.pool_layer, case.batch, 2, 0.25)
    torch.testing.assert_close(out, attention_torch(q.contiguous(), case.pool_layer, case.batch, 2, 0.25, native=False))


def test_stale_rows_past_the_context_are_never_read():
    case = make_attention_case(DECODES, 4, 2, 16, 4, torch.float32, seed=5)
    write_kv_torch(case.pool_layer, case.k, case.v, case.batch)
    clean = attention_torch(case.q, case.pool_layer, case.batch, 2, 0.25)
    tp, table = case.batch.tokens_per_page, case.batch.page_table
    for b, ctx in enumerate(case.batch.context_lens):
        for pos in range(ctx, -(-ctx // tp) * tp):  # the rest of the sequence's last page
            row = int(table[b, pos // tp]) * 2 * tp + pos % tp
            case.pool_layer[row] = case.pool_layer[row + tp] = float("nan")
    assert torch.equal(attention_torch(case.q, case.pool_layer, case.batch, 2, 0.25), clean)


def test_with_more_threads_sdpa_runs():
    case = make_attention_case(DECODES, 4, 2, 16, 4, torch.float32, seed=6)
    assert attention_cpu.usable(case.q, case.pool_layer)
    torch.set_num_threads(2)
    assert not attention_cpu.usable(case.q, case.pool_layer)


def test_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "CACHE", tmp_path / "kernels")
    with caplog.at_level("INFO", logger=native.__name__):
        assert native.library.__wrapped__("decode_attention.c") is None
    assert "the torch path runs" in caplog.text
