"""Paged decode attention in C, on the CPU in float32 (`kernels/csrc/decode_attention.c`).

A decode token's keys and values are read where they lie in the pool, each row once for all the query
heads, over the sequence's own context only: no gather into a padded batch and no SDPA call per group.
`attention_torch` uses it for decode groups where `usable` (float32, the CPU, one torch thread:
`kernels/native.py` builds and loads it) and is its reference (tests/numerics/test_kernels_attention_cpu.py).

In the offline engine on a 52M Llama (8 layers, 12 heads, 4 KV heads of 64), a decode step of 8
sequences ran 5-6 % faster with it than with the gather and SDPA (32- and 300-token prompts): the
keys and values are read once, a page's rows in order, at about the rate one core reads memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from loraserve.kernels import native

Tensor = torch.Tensor
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor], None]
I64, PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """`kernel(q, pool_layer, rows, first, last, scale, out)`: out[g] = attention of q[g] [H, D] over keys
    rows[g, first[g]:last[g]] and values rows[g, S + first[g]:S + last[g]] of pool_layer [rows, H_kv * D];
    q's last dimension contiguous, out [G, H, D] contiguous, rows int64 [G, 2 * S], first/last int64 [G]."""
    library = native.library("decode_attention.c")
    if library is None:
        return None
    function = library.decode_attention_f32
    function.restype = None
    function.argtypes = [PTR, I64, I64, PTR, I64, PTR, I64, PTR, PTR, I64, I64, I64, I64, ctypes.c_float, PTR, PTR]

    def kernel(q, pool_layer, rows, first, last, scale, out) -> None:
        seqs, heads, dim = q.shape
        scratch = torch.empty(heads * rows.shape[1] // 2, dtype=torch.float32)
        function(
            q.data_ptr(), q.stride(0), q.stride(1), pool_layer.data_ptr(), pool_layer.stride(0),
            rows.data_ptr(), rows.shape[1] // 2, first.data_ptr(), last.data_ptr(),
            seqs, heads, pool_layer.shape[1] // dim, dim, scale, out.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip

    return kernel


def usable(q: torch.Tensor, pool_layer: torch.Tensor) -> bool:
    """Whether the C kernel can attend q over pool_layer here (then `decode_kernel()` is not None)."""
    contiguous = q.stride(2) == 1 and pool_layer.stride(1) == 1
    return contiguous and native.one_thread(q, pool_layer) and decode_kernel() is not None
