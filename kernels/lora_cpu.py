"""LoRA of decode buckets in C, on the CPU in float32 (`kernels/csrc/lora_decode.c`).

A bucket of the torch path (`kernels/lora_torch.py`) whose tiles hold a few tokens each — a decode step's
adapters, each with one or a few sequences — is computed by one C call that reads each adapter's A and
B rows where they lie in the pool, once per tile: no gather of the rows into a contiguous copy, no bmm
over it, no per-module calls. Buckets of longer tiles (prefill chunks), where a GEMM over the gathered
rows pays, keep the torch path (`MAX_TILE_TOKENS`).
`lora_apply_torch` calls it where `usable` (float32, the CPU, one torch thread: `kernels/native.py`
builds and loads it) and is its reference (tests/numerics/test_kernels_lora_cpu.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from loraserve.kernels import native

if TYPE_CHECKING:
    from loraserve.kernels.lora_torch import _Bucket

I64, PTR = ctypes.c_int64, ctypes.c_void_p
# Tiles of more tokens keep the torch path: there a GEMM over the gathered rows computes faster than the C
# loops (which read each row once per tile, as it does, but multiply one token at a time).
MAX_TILE_TOKENS = 8


@functools.cache
def bucket_kernel() -> Callable | None:
    """The C function (see its source's comment), or None where it cannot be built."""
    library = native.library("lora_decode.c")
    if library is None:
        return None
    function = library.lora_bucket_f32
    function.restype = None
    function.argtypes = [PTR, I64, PTR, I64, I64, PTR, I64, PTR, I64, I64, I64, I64, PTR, PTR, I64]
    function.argtypes += [PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR]
    return function


def usable(x: torch.Tensor, pool_layer: torch.Tensor) -> bool:
    """Whether the C kernel can take this group's LoRA here (then `bucket_kernel()` is not None)."""
    contiguous = x.stride(-1) == 1 and pool_layer.stride(1) == 1
    return contiguous and native.one_thread(x, pool_layer) and bucket_kernel() is not None


def apply_bucket(
    b: _Bucket, x: torch.Tensor, pool_layer: torch.Tensor, layer: int, outputs: Sequence[torch.Tensor]
) -> None:
    """outputs += bucket b's LoRA terms for its tokens (as `lora_torch._shrink` then `_expand`)."""
    tokens = b.tokens if b.tokens is not None else torch.arange(b.span.start, b.span.stop)
    a_table, a_start = (None, b.a_rows.start) if isinstance(b.a_rows, slice) else (b.a_rows.data_ptr(), 0)
    scale = b.weight[layer].reshape(-1).contiguous()
    ys = [outputs[o.slot] for o in b.outputs]
    k = len(b.outputs)

    def int64s(values) -> ctypes.Array:
        return (I64 * k)(*values)

    vectors = k * b.rank
    v = torch.empty(b.t * vectors, dtype=torch.float32)  # the tile's shrinks
    bucket_kernel()(
        x.data_ptr(), x.stride(0), tokens.data_ptr(), b.n, b.t,
        pool_layer.data_ptr(), pool_layer.shape[1], a_table, a_start, vectors, b.c_in, b.d_in, scale.data_ptr(),
        None if b.b_rows is None else b.b_rows.data_ptr(), k,
        int64s(o.b_rows.start for o in b.outputs), int64s(o.v_cols.start for o in b.outputs),
        int64s(o.c_out for o in b.outputs), int64s(o.d_out for o in b.outputs),
        (PTR * k)(*(y.data_ptr() for y in ys)), int64s(y.stride(0) for y in ys), b.rank,
        v.data_ptr(),
    )  # fmt: skip
