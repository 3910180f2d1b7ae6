"""At what precision an adapter's rows are held in the pool (`--adapter-dtype`).

A decode step reads every adapter of its batch whole, so on a CPU, where a step is bound by the bytes it
reads, an adapter costs its bytes. A float32 pool can hold an adapter's rows at half precision instead, two of
its rows in one pool row (`kernels.batch.rows_view`): half the bytes per step and half the pages. The kernels
widen each value to float32 as they read it and compute in float32.

    auto      (the default) an adapter whose weights are all float16, or all bfloat16, keeps them so: exact,
              as widening them to float32 is; any other adapter at the pool's dtype
    pool      every adapter at the pool's dtype
    bfloat16  every adapter rounded to bfloat16 (float16: to float16)

Only a float32 pool read by the torch kernel backend on one rank holds half rows (a half-precision pool holds
adapters at half precision already); elsewhere `auto` holds every adapter at the pool's dtype and the half
types are refused (`engine_setup.adapter_dtype`).
"""

from __future__ import annotations

import torch

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def row_dtype(setting: str, own: torch.dtype, pool: torch.dtype) -> torch.dtype | None:
    """The dtype an adapter whose weights are `own` takes in a pool of `pool` under `setting`, when it is not
    the pool's; None: the pool's."""
    if setting == "pool" or pool != torch.float32:
        return None
    if setting == "auto":
        return own if own in HALF.values() else None
    return HALF[setting]
