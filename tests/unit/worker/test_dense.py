"""`DenseLinear` (worker/dense.py) against `F.linear` on each projection's own weight: one GEMM over
concatenated weights, oneDNN's reordered layout where this machine has it, any row count and input strides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.worker.dense import DenseLinear

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # of the outputs' scale


@settings(max_examples=40, deadline=None)
@given(
    d_in=st.integers(1, 96),
    widths=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    rows=st.integers(0, 70),
    bias=st.lists(st.booleans(), min_size=3, max_size=3),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_each_output_is_its_projection_of_the_input(d_in, widths, rows, bias, strided, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(w, d_in, generator=g).to(dtype) for w in widths]
    biases = [torch.randn(w, generator=g).to(dtype) if b else None for w, b in zip(widths, bias, strict=False)]
    x = torch.randn(rows, d_in + 5 if strided else d_in, generator=g).to(dtype)
    x = x[:, 3 : 3 + d_in] if strided else x  # a column view, as a fused GEMM's output feeds the next one
    with torch.inference_mode():
        outputs = DenseLinear(weights, biases)(x)
    assert len(outputs) == len(widths)
    for y, w, b in zip(outputs, weights, biases, strict=True):
        expected = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert y.shape == (rows, w.shape[0]) and y.dtype == dtype
        scale = max(1.0, expected.abs().max().item()) if rows else 1.0
        torch.testing.assert_close(y.float(), expected, rtol=0, atol=TOLERANCE[dtype] * scale * d_in**0.5)


def test_float32_and_bfloat16_weights_are_reordered_for_onednn_on_cpu():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    for dtype in (torch.float32, torch.bfloat16):
        dense = DenseLinear([torch.randn(8, 4, dtype=dtype)], [None])
        assert dense.onednn and dense.weight.is_mkldnn  # the reordered weight replaced the original


def test_the_outputs_are_column_views_of_one_result():
    q, k = torch.randn(6, 4), torch.randn(2, 4)
    with torch.inference_mode():
        yq, yk = DenseLinear([q, k], [None, None])(torch.randn(3, 4))
    assert yq.untyped_storage().data_ptr() == yk.untyped_storage().data_ptr()
    assert yk.data_ptr() == yq.data_ptr() + 6 * yq.element_size()
