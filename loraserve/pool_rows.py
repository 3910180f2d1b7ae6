"""An adapter's weights in the unified pool's row layout, packed without torch (the adapter store does it).

A worker's pool keeps an adapter as logical rows of `row_width` = the model's KV width, the same rows in
every layer (`worker/pool_layout.py` has the layout rule). The rows depend only on the model's shape and
the adapter, not on a worker's pool size, so the store packs them once per registered version and sends
them as they are; a worker copies them into its pool pages without repacking:

    rows: [num_layers, num_rows, row_width] in `dtype`, little-endian, C order; layers without weights zero

`dtype` is the adapter's own: the dtype of its tensors, or when they mix, one that holds every value exactly
(float32, or float64 if any tensor is float64). The worker casts to its pool's dtype when they differ, which
gives exactly what casting each tensor directly would, as the store's widening is exact. bfloat16 rows are
stored as their uint16 bits (numpy has no bfloat16). `layer_digests` is the sha256 of each layer's bytes: the
store computes them once, a worker checks what it received against them.

The adapter store packs only adapters that passed `check_adapter_bytes`, so every value here is finite and
within the validation's bounds; a worker checks that rows it receives fit its own layout (`RowsSpec`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from loraserve.adapter_format import CheckedAdapter, StoredTensor
from loraserve.model_config import ModelConfig
from loraserve.worker.pool_layout import AdapterLayout, PoolLayout

# rows dtype name -> numpy type of its stored values (bfloat16 as bits)
ROW_DTYPES = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_CODES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}  # safetensors code -> name


@dataclass(frozen=True)
class RowsSpec:
    """The shape and type of an adapter's packed rows."""

    dtype: str  # a key of ROW_DTYPES
    num_layers: int
    num_rows: int
    row_width: int

    @property
    def itemsize(self) -> int:
        return ROW_DTYPES[self.dtype].itemsize

    @property
    def layer_bytes(self) -> int:
        return self.num_rows * self.row_width * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_bytes


def adapter_rows_layout(model: ModelConfig, rank: int, modules: tuple[str, ...]) -> AdapterLayout:
    """The logical row layout of a rank-`rank` adapter on `modules`, as every pool of `model` lays it out."""
    return PoolLayout(model.num_layers, model.kv_width, rows_per_page=2, num_pages=1).adapter_layout(
        model, rank, modules
    )


def rows_dtype(checked: CheckedAdapter) -> str:
    """The adapter's own dtype (see the module docstring): its tensors', or one holding all of them exactly."""
    names = {_CODES[t.dtype] for pair in checked.weights.values() for t in pair}
    if len(names) == 1:
        return names.pop()
    return "float64" if "float64" in names else "float32"


def rows_spec(model: ModelConfig, checked: CheckedAdapter) -> RowsSpec:
    layout = adapter_rows_layout(model, checked.config.rank, checked.modules)
    return RowsSpec(rows_dtype(checked), model.num_layers, layout.num_rows, model.kv_width)


def pack_rows(checked: CheckedAdapter, model: ModelConfig, out: np.ndarray) -> None:
    """Write the adapter's rows into `out`, a zeroed uint8 buffer of `rows_spec(model, checked).nbytes`."""
    spec = rows_spec(model, checked)
    if out.nbytes != spec.nbytes:
        raise ValueError(f"the rows need {spec.nbytes} bytes, the buffer has {out.nbytes}")
    rows = out.view(ROW_DTYPES[spec.dtype]).reshape(spec.num_layers, spec.num_rows, spec.row_width)
    layout = adapter_rows_layout(model, checked.config.rank, checked.modules)
    r, w = checked.config.rank, spec.row_width
    for (layer, module), (a, b) in checked.weights.items():
        block = layout.block(module)
        assert block is not None  # the layout was made from these modules
        a_rows = rows[layer, block.a_offset : block.a_offset + r * block.c_in].reshape(r, block.c_in * w)
        a_rows[:, : block.d_in] = _values(a, spec.dtype)  # A [r, d_in]: each rank vector cut into rows
        b_rows = rows[layer, block.b_offset : block.b_offset + r * block.c_out].reshape(r, block.c_out * w)
        b_rows[:, : block.d_out] = _values(b, spec.dtype).T  # B [d_out, r]: its columns are the rank vectors


def layer_digests(rows: memoryview | bytes, spec: RowsSpec) -> list[str]:
    """The hex sha256 of each layer's bytes."""
    view = memoryview(rows).cast("B")
    step = spec.layer_bytes
    return [hashlib.sha256(view[i * step : (i + 1) * step]).hexdigest() for i in range(spec.num_layers)]


def _values(t: StoredTensor, dtype: str) -> np.ndarray:
    """A stored tensor's values in the rows' numpy type, exactly (only ever widened)."""
    stored = t.data.view(ROW_DTYPES[_CODES[t.dtype]]).reshape(t.shape)
    source = _CODES[t.dtype]
    if source == dtype:
        return stored
    if source == "bfloat16":  # the top half of a float32
        wide = stored.astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32).astype(ROW_DTYPES[dtype], copy=False)
    return stored.astype(ROW_DTYPES[dtype])
