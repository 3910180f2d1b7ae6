"""The base model's dense projections, where a step spends most of its time: x W^T (+ b).

`DenseLinear` runs one GEMM for the projections that share an input, their weights concatenated
along the output dimension at load (q/k/v in one, gate/up in another), and returns each
projection's output as a column view of that one result, in the order given.

On CPU with oneDNN (`torch.backends.mkldnn`), float32 and bfloat16 weights are reordered once,
at load, into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout
inductor's frozen CPU graphs use) and multiplied by `torch.ops.mkldnn._linear_pointwise`. On the
2-vCPU AMD EPYC (AVX-512) the project benchmarks on, one thread, a 52M Llama's projections ran
1.7-2.0x faster than with `F.linear` (MKL) at 4-32 rows, 1.4x at 64-1024, and 1.1x slower at one row
(`python -m loraserve.bench.suites.overhead.gemm`: docs/overhead/gemm/results.json). The reordered
weight replaces the original (no second copy). Elsewhere (CUDA, float16 on a CPU without
AVX512-FP16, no oneDNN) the weight stays as it is and `F.linear` runs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 8  # the row count oneDNN's layout is chosen for; measured best here from 1 to 1024 rows


def _onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout, or None where oneDNN cannot multiply it here."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except RuntimeError as e:  # e.g. a CPU without the instructions the dtype needs
        log.info("oneDNN cannot pack a %s weight here (%s): F.linear", weight.dtype, e)
        return None


class DenseLinear(torch.nn.Module):
    """y_i = x W_i^T (+ b_i) for projections i sharing the input x, in one GEMM."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        super().__init__()
        self.widths = [w.shape[0] for w in weights]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        bias = None
        if any(b is not None for b in biases):
            zeros = [w.new_zeros(w.shape[0]) for w in weights]
            bias = torch.cat([z if b is None else b for z, b in zip(zeros, biases, strict=True)])
        packed = _onednn_weight(weight)
        self.onednn = packed is not None
        # buffers, so that a compiled graph takes them as inputs rather than copying them in as constants
        self.register_buffer("weight", packed if self.onednn else weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The one GEMM's output: [T, sum of widths], projection after projection."""
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fused(x)
        return (y,) if len(self.widths) == 1 else y.split(self.widths, dim=-1)
