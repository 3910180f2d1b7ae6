"""LoRA of decode buckets in C, on the CPU in float32 (`kernels/csrc/lora_decode.c`).

A bucket of the torch path (`kernels/lora_torch.py`) whose tiles hold a few tokens each — a decode step's
adapters, each with one or a few sequences — is computed by one C call that reads each adapter's A and
B rows where they lie in the pool, once per tile: no gather of the rows into a contiguous copy, no bmm
over it, no per-module calls. Buckets of longer tiles (prefill chunks), where a GEMM over the gathered
rows pays, keep the torch path (`MAX_TILE_TOKENS`).
`lora_apply_torch` calls it where `usable` (a float32 pool, the CPU, one torch thread: `kernels/native.py`
builds and loads it) and is its reference (tests/numerics/test_lora_plan.py). Adapters whose rows are
bfloat16 or float16 in the float32 pool (`kernels.batch.rows_view`) have a function of their own, which
widens each value as it reads it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraserve.kernels import native

if TYPE_CHECKING:
    from loraserve.kernels.lora_torch import _Bucket

I64, PTR = ctypes.c_int64, ctypes.c_void_p
# Tiles of more tokens keep the torch path: there a GEMM over the gathered rows computes faster than the C
# loops (which read each row once per tile, as it does, but multiply one token at a time).
MAX_TILE_TOKENS = 8


# the C function for each dtype of adapter rows (None: the pool's, float32)
_FUNCTIONS = {None: "lora_bucket_f32", torch.bfloat16: "lora_bucket_bf16", torch.float16: "lora_bucket_f16"}


@functools.cache
def bucket_kernel(row_dtype: torch.dtype | None = None) -> Callable | None:
    """The C function for adapter rows of `row_dtype` (see its source's comment), or None where it cannot be
    built."""
    library = native.library("lora_decode.c")
    if library is None:
        return None
    function = getattr(library, _FUNCTIONS[row_dtype])
    function.restype = None
    function.argtypes = [PTR, I64, PTR, I64, I64, PTR, I64, PTR, I64, I64, I64, I64, PTR, PTR, I64]
    function.argtypes += [PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR]
    return function


def usable(x: torch.Tensor, pool_layer: torch.Tensor) -> bool:
    """Whether the C kernel can take this group's LoRA here (then `bucket_kernel()` is not None)."""
    contiguous = x.stride(-1) == 1 and pool_layer.stride(1) == 1
    return contiguous and native.one_thread(x, pool_layer) and bucket_kernel() is not None


@dataclass(frozen=True)
class BucketCall:
    """What a bucket's calls of the kernel share, built once with the bucket (`lora_torch.prepare_lora_torch`):
    its token table, row tables, per-output geometry and scales, and the scratch for its shrinks."""

    tokens: torch.Tensor  # int64 [n * t]
    a_table: int | None  # pointer to the bucket's A rows, or None: read in place from a_start
    a_start: int
    b_table: int | None
    vectors: int  # A rank vectors per tile: modules x rank
    outputs: tuple[ctypes.Array, ...]  # b_start, v_col, c_out, d_out: one int64 per output each
    scales: torch.Tensor  # float32 [L, n], contiguous
    shrinks: torch.Tensor  # float32 [t * vectors]: the tile's shrinks, reused call after call

    @classmethod
    def of(cls, b: _Bucket) -> BucketCall:
        k, spanned = len(b.outputs), b.tokens is None
        in_place = isinstance(b.a_rows, slice)

        def int64s(values) -> ctypes.Array:
            return (I64 * k)(*values)

        return cls(
            torch.arange(b.span.start, b.span.stop) if spanned else b.tokens,
            None if in_place else b.a_rows.data_ptr(),
            b.a_rows.start if in_place else 0,
            None if b.b_rows is None else b.b_rows.data_ptr(),
            k * b.rank,
            (
                int64s(o.b_rows.start for o in b.outputs),
                int64s(o.v_cols.start for o in b.outputs),
                int64s(o.c_out for o in b.outputs),
                int64s(o.d_out for o in b.outputs),
            ),
            b.weight.reshape(b.weight.shape[0], -1).float().contiguous(),
            torch.empty(b.t * k * b.rank, dtype=torch.float32),
        )


def apply_bucket(
    b: _Bucket, x: torch.Tensor, pool_layer: torch.Tensor, layer: int, outputs: Sequence[torch.Tensor]
) -> None:
    """outputs += bucket b's LoRA terms for its tokens (as `lora_torch._shrink` then `_expand`)."""
    call = b.native or BucketCall.of(b)
    ys = [outputs[o.slot] for o in b.outputs]
    k = len(ys)
    bucket_kernel(b.row_dtype)(
        x.data_ptr(), x.stride(0), call.tokens.data_ptr(), b.n, b.t,
        pool_layer.data_ptr(), pool_layer.shape[1], call.a_table, call.a_start, call.vectors, b.c_in, b.d_in,
        call.scales[layer].data_ptr(), call.b_table, k, *call.outputs,
        (PTR * k)(*(y.data_ptr() for y in ys)), (I64 * k)(*(y.stride(0) for y in ys)), b.rank,
        call.shrinks.data_ptr(),
    )  # fmt: skip
