"""The adapter rows contract: how an adapter's A and B live in the unified pool's rows, shared by the
adapter store (which packs them, without torch) and the worker (whose pool holds them).

A worker's pool keeps every layer as rows of `row_width` W = the model's KV width (num_kv_heads × head_dim;
`worker/pool_layout.py` has the pool's pages and its KV cache). S-LoRA stores a rank-r weight as r vectors;
here each rank vector is split into row-sized chunks. For a target module with in/out widths (d_in, d_out),
c_in = ceil(d_in / W), c_out = ceil(d_out / W):

    A block: r × c_in rows,  row j*c_in + c  = lora_A[j, c*W : (c+1)*W]     (lora_A: [r, d_in])
    B block: r × c_out rows, row j*c_out + c = lora_B[c*W : (c+1)*W, j]     (lora_B: [d_out, r])

Blocks of the adapter's modules follow each other group by group (`LORA_GROUPS`: q/k/v, o, gate/up, down)
in the adapter's *logical* row space: first the A blocks of the group's targeted modules (in `LORA_MODULES`
order), then their B blocks. The A blocks of projections that share an input are thus one stacked
[k*r, d_in] matrix, read by one shrink. A pool of R rows per page keeps logical row ℓ at physical row
pages[ℓ // R] * R + ℓ % R; every layer uses the same logical layout, so one page list per adapter serves all
layers. Widths that are multiples of W (hidden size, KV width and, in most models, the MLP width: 14336 =
14 × 1024 in Llama-3-8B) waste nothing; otherwise only the last chunk of each rank vector is padded.

The rows depend only on the model's shape and the adapter, not on a worker's pool size, so the store packs
them once per registered version and sends them as they are; a worker copies them into its pool pages
without repacking:

    rows: [num_layers, num_rows, row_width] in `dtype`, little-endian, C order; layers without weights zero

A tensor-parallel rank holds its part of every adapter (`loraserve/partition.py`) in rows as wide as its KV
heads, laid out by the same rule over its share of each block (`adapter_layout(..., shard)`). The store cuts
each rank's rows from the whole ones when a rank asks for them (`shard_rows`), so a rank receives its part
and nothing more.

`dtype` is the adapter's own: the dtype of its tensors, or when they mix, one that holds every value exactly
(float32, or float64 if any tensor is float64). The worker casts to its pool's dtype when they differ, which
gives exactly what casting each tensor directly would, as the store's widening is exact. bfloat16 rows are
stored as their uint16 bits (numpy has no bfloat16). `layer_digests` is the sha256 of each layer's bytes: the
store computes them once, a worker checks what it received against them.

The adapter store packs only adapters that passed `check_adapter_bytes`, so every value here is finite and
within the validation's bounds; a worker checks that rows it receives fit its own layout (`RowsSpec`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from loraserve.adapter_format import CheckedAdapter, StoredTensor
from loraserve.model_config import LORA_GROUPS, LORA_MODULES, MODULE_INDEX, ModelConfig
from loraserve.partition import ONE_RANK, LoraSlice, Shard, local_model, lora_slice


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_offsets(
    targeted: Collection[int],
    rank: int,
    c_in: Sequence[int],
    c_out: Sequence[int],
    groups: tuple[tuple[int, ...], ...] = LORA_GROUPS,
    a_ranks: Sequence[int] | None = None,
) -> tuple[dict[int, tuple[int, int]], int]:
    """The layout rule (module docstring), on module indices: {module: (first row of its A block, of
    its B block)} for the `targeted` modules of a rank-`rank` adapter, and the rows they take. Group
    by group, the targeted modules' A blocks follow each other, then their B blocks. `c_in`, `c_out`:
    row chunks per rank vector of every module; `a_ranks`: the A rank vectors each module holds, when
    not `rank` (a tensor-parallel rank's share, `loraserve/partition.py`)."""
    a_ranks = a_ranks or [rank] * len(c_in)
    offsets: dict[int, tuple[int, int]] = {}
    offset = 0
    for group in groups:
        present = [m for m in group if m in targeted]
        b_offset = offset + sum(a_ranks[m] * c_in[m] for m in present)
        for m in present:
            offsets[m] = (offset, b_offset)
            offset, b_offset = offset + a_ranks[m] * c_in[m], b_offset + rank * c_out[m]
        offset = b_offset
    return offsets, offset


@dataclass(frozen=True)
class ModuleBlock:
    """Where one target module's A and B live in an adapter's logical rows."""

    module: str
    d_in: int
    d_out: int
    c_in: int  # row chunks per A rank vector
    c_out: int  # row chunks per B rank vector
    a_offset: int  # first logical row of the A block
    b_offset: int  # first logical row of the B block
    a_rank: int  # rank vectors of the A block (the adapter's rank, or a tensor-parallel rank's share of it)


@dataclass(frozen=True)
class AdapterLayout:
    """The logical row layout of one adapter (rank r, some target modules) on one rank of its partition."""

    rank: int  # B's rank vectors: the adapter's rank, padded to a multiple of the tensor-parallel size
    blocks: tuple[ModuleBlock, ...]
    num_rows: int
    num_pages: int
    useful_elements: int  # weights actually stored, summed over layers (for waste accounting)

    def block(self, module: str) -> ModuleBlock | None:
        return next((b for b in self.blocks if b.module == module), None)

    @functools.cached_property  # read for every step's batch metadata
    def a_offsets(self) -> tuple[int, ...]:
        """First logical row of each module's A block, in LORA_MODULES order; -1 where not targeted."""
        return tuple(b.a_offset if b else -1 for b in map(self.block, LORA_MODULES))

    @functools.cached_property
    def b_offsets(self) -> tuple[int, ...]:
        return tuple(b.b_offset if b else -1 for b in map(self.block, LORA_MODULES))


def adapter_layout(
    model: ModelConfig,
    rank: int,
    modules: tuple[str, ...],
    row_width: int,
    rows_per_page: int,
    active_layers: int | None = None,
    shard: Shard = ONE_RANK,
) -> AdapterLayout:
    """Lay out an adapter of rank `rank` on `modules` (any order; stored in LORA_MODULES order) in rows of
    `row_width`, counted in pages of `rows_per_page` rows; `active_layers`: the layers it has weights in;
    `shard`: the tensor-parallel rank whose part of the adapter the rows hold (`loraserve/partition.py`)."""
    unknown = set(modules) - set(LORA_MODULES)
    if unknown:
        raise ValueError(f"unknown LoRA modules {sorted(unknown)}")
    slices = [lora_slice(model, m, rank, shard) for m in LORA_MODULES]
    c_in = [ceil_div(len(s.a_inputs), row_width) for s in slices]
    c_out = [ceil_div(len(s.b_outputs), row_width) for s in slices]
    a_ranks = [len(s.a_ranks) for s in slices]
    targeted = {MODULE_INDEX[m] for m in modules}
    padded = slices[0].rank
    offsets, rows = block_offsets(targeted, padded, c_in, c_out, a_ranks=a_ranks)
    blocks = [
        ModuleBlock(
            LORA_MODULES[m], len(slices[m].a_inputs), len(slices[m].b_outputs), c_in[m], c_out[m], a, b, a_ranks[m]
        )
        for m, (a, b) in sorted(offsets.items())
    ]
    useful = sum(b.a_rank * b.d_in + padded * b.d_out for b in blocks)
    layers = model.num_layers if active_layers is None else active_layers
    return AdapterLayout(
        rank=padded,
        blocks=tuple(blocks),
        num_rows=rows,
        num_pages=ceil_div(rows, rows_per_page),
        useful_elements=useful * layers,
    )


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


def adapter_rows_layout(
    model: ModelConfig, rank: int, modules: tuple[str, ...], shard: Shard = ONE_RANK
) -> AdapterLayout:
    """The logical row layout of a rank-`rank` adapter on `modules`, as every pool of `model` lays it out
    (rows of the KV width of `shard`'s heads; counted in pages of one row: a worker's pool pages them)."""
    return adapter_layout(model, rank, modules, local_model(model, shard).kv_width, rows_per_page=1, shard=shard)


def rows_dtype(checked: CheckedAdapter) -> str:
    """The adapter's own dtype (see the module docstring): its tensors', or one holding all of them exactly."""
    names = {_CODES[t.dtype] for pair in checked.weights.values() for t in pair}
    if len(names) == 1:
        return names.pop()
    return "float64" if "float64" in names else "float32"


def layout_spec(model: ModelConfig, layout: AdapterLayout, dtype: str, shard: Shard = ONE_RANK) -> RowsSpec:
    return RowsSpec(dtype, model.num_layers, layout.num_rows, local_model(model, shard).kv_width)


def rows_spec(model: ModelConfig, checked: CheckedAdapter) -> RowsSpec:
    layout = adapter_rows_layout(model, checked.config.rank, checked.modules)
    return layout_spec(model, layout, rows_dtype(checked))


def pack_rows(checked: CheckedAdapter, model: ModelConfig, out: np.ndarray) -> None:
    """Write the adapter's rows into `out`, a zeroed uint8 buffer of `rows_spec(model, checked).nbytes`."""
    spec = rows_spec(model, checked)
    rows = _rows_array(out, spec)
    layout = adapter_rows_layout(model, checked.config.rank, checked.modules)
    for (layer, module), (a, b) in checked.weights.items():
        _write_block(rows, layer, layout, module, _values(a, spec.dtype), _values(b, spec.dtype).T)


def shard_rows(
    whole: memoryview,
    spec: RowsSpec,
    model: ModelConfig,
    rank: int,
    modules: Sequence[str],
    layers: Sequence[int],
    shard: Shard,
) -> tuple[RowsSpec, bytearray]:
    """One rank's rows (`shard`) read from the whole rows `whole` (`spec`) of a rank-`rank` adapter on
    `modules`, with weights in `layers`: (their RowsSpec, a new buffer). What one tensor-parallel rank holds,
    cut from what the store packed once."""
    source = _rows_array(np.frombuffer(whole, dtype=np.uint8), spec)
    whole_layout = adapter_rows_layout(model, rank, tuple(modules))
    layout = adapter_rows_layout(model, rank, tuple(modules), shard)
    out_spec = layout_spec(model, layout, spec.dtype, shard)
    buffer = bytearray(out_spec.nbytes)
    rows = _rows_array(np.frombuffer(buffer, dtype=np.uint8), out_spec)
    for layer in layers:
        for block in whole_layout.blocks:
            a, bt = _read_block(source, layer, whole_layout, block)
            part = lora_slice(model, block.module, rank, shard)
            _write_block(rows, layer, layout, block.module, *_part(a, bt, part))
    return out_spec, buffer


def _rows_array(buffer: np.ndarray, spec: RowsSpec) -> np.ndarray:
    if buffer.nbytes != spec.nbytes:
        raise ValueError(f"the rows need {spec.nbytes} bytes, the buffer has {buffer.nbytes}")
    return buffer.view(ROW_DTYPES[spec.dtype]).reshape(spec.num_layers, spec.num_rows, spec.row_width)


def _part(a: np.ndarray, bt: np.ndarray, part: LoraSlice) -> tuple[np.ndarray, np.ndarray]:
    """A rank's part of A [r, d_in] and of B's rank vectors [r, d_out] (`part`; rank vectors past r are the
    zero padding, left as the buffer's zeros)."""
    r = a.shape[0]
    ranks = slice(min(part.a_ranks.start, r), min(part.a_ranks.stop, r))
    inputs, outputs = slice(part.a_inputs.start, part.a_inputs.stop), slice(part.b_outputs.start, part.b_outputs.stop)
    return a[ranks, inputs], bt[:, outputs]


def _block_views(
    rows: np.ndarray, layer: int, layout: AdapterLayout, block: ModuleBlock
) -> tuple[np.ndarray, np.ndarray]:
    """A's rows as [A rank vectors, c_in·W] and B's as [rank, c_out·W] (views)."""
    w = rows.shape[2]
    a = rows[layer, block.a_offset : block.a_offset + block.a_rank * block.c_in].reshape(block.a_rank, -1)
    b = rows[layer, block.b_offset : block.b_offset + layout.rank * block.c_out].reshape(layout.rank, -1)
    assert a.shape[1] == block.c_in * w and b.shape[1] == block.c_out * w
    return a, b


def _read_block(
    rows: np.ndarray, layer: int, layout: AdapterLayout, block: ModuleBlock
) -> tuple[np.ndarray, np.ndarray]:
    """A [a_rank, d_in] and B's rank vectors [rank, d_out] of one block (views)."""
    a, b = _block_views(rows, layer, layout, block)
    return a[:, : block.d_in], b[:, : block.d_out]


def _write_block(
    rows: np.ndarray, layer: int, layout: AdapterLayout, module: str, a: np.ndarray, bt: np.ndarray
) -> None:
    """Each rank vector of A [n, d_in] and of B [n, d_out] cut into rows of one block."""
    block = layout.block(module)
    assert block is not None  # the layout was made from these modules
    a_rows, b_rows = _block_views(rows, layer, layout, block)
    a_rows[: a.shape[0], : a.shape[1]] = a
    b_rows[: bt.shape[0], : bt.shape[1]] = bt


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
