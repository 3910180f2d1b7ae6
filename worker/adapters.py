"""PEFT LoRA adapters in the worker: read, validated, turned into torch tensors, packed into pool rows.

Reading and every check live in `loraserve/adapter_format.py` (torch-free, shared with the adapter
store, so both refuse the same files with the same `InvalidAdapterError`); here the validated
weights become torch tensors, without a copy, and an adapter packs itself into the pool's rows.

Semantics are PEFT's: for a targeted projection, y = x W^T + scale · (x A^T) B^T with
A = lora_A.weight [r, d_in], B = lora_B.weight [d_out, r], scale = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.adapter_config import CONFIG_FILE, lora_scale
from loraserve.adapter_format import BIN_FILE, SAFETENSORS_FILE, CheckedAdapter, StoredTensor, check_adapter_bytes
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import ModelConfig
from loraserve.partition import ONE_RANK, Shard, lora_slice
from loraserve.pool_rows import AdapterLayout, adapter_rows_layout
from loraserve.worker.pool_layout import PoolLayout

_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in host memory, its weights as torch tensors (CPU), ready to pack."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    modules: tuple[str, ...]  # targeted projections, in LORA_MODULES order
    layers: tuple[int, ...]  # layers that carry weights
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B); {}: rows only
    config: dict
    sha256: str | None = None  # hex SHA-256 of the weights file it was read from, when the caller checked it
    # The rows `pack` makes for one pool's geometry, packed ahead of a load (`with_rows`), or as the store
    # sent them (`worker/adapter_rows.py`: then the only copy of the weights, in the adapter's own dtype).
    packed: torch.Tensor | None = field(default=None, compare=False, repr=False)
    packed_shard: Shard = ONE_RANK  # the tensor-parallel rank whose part of the weights `packed` holds
    # On a tensor-parallel worker's rank 0: the rows of ranks 1..N-1, each its part, handed to them at a load.
    rank_rows: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    @property
    def scale(self) -> float:
        return lora_scale(self.lora_alpha, self.rank, self.use_rslora)

    @property
    def nbytes(self) -> int:
        """Host RAM held: the weights, and the packed rows when there are some."""
        packed = self.packed.nbytes if self.packed is not None else 0
        packed += sum(rows.nbytes for rows in self.rank_rows)
        return packed + sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def dtype(self) -> torch.dtype:
        """Its weights' dtype when they share one (float32 when they mix); with rows only, the rows'."""
        if not self.weights and self.packed is not None:
            return self.packed.dtype
        dtypes = {t.dtype for pair in self.weights.values() for t in pair}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def layout(self, pool: PoolLayout, model: ModelConfig) -> AdapterLayout:
        return pool.adapter_layout(model, self.rank, self.modules, active_layers=len(self.layers))

    def pack(self, pool: PoolLayout, model: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
        """The adapter's logical rows for every layer, as pool.py lays them out: on a tensor-parallel rank,
        that rank's part of the weights (`loraserve/partition.py`; a rank padded with zero rank vectors).

        Shape: [num_layers, layout.num_rows, row_width]; layers without weights are zero.
        """
        layout = self.layout(pool, model)
        w = pool.row_width
        rows = torch.zeros(pool.num_layers, layout.num_rows, w, dtype=dtype)
        for (layer, module), weights in self.full_weights(model).items():
            block = layout.block(module)
            assert block is not None
            part = lora_slice(model, module, self.rank, pool.shard)
            a, b = _padded_rank(*weights, part.rank)
            a_rows = _chunk_rows(a[_span(part.a_ranks), _span(part.a_inputs)], block.c_in, w)  # [a_rank * c_in, W]
            b_rows = _chunk_rows(b[_span(part.b_outputs)].t(), block.c_out, w)  # [rank * c_out, W]
            rows[layer, block.a_offset : block.a_offset + len(a_rows)] = a_rows
            rows[layer, block.b_offset : block.b_offset + len(b_rows)] = b_rows
        return rows

    def full_weights(self, model: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """(layer, module) -> (A, B): the weights, or when only rows the store packed are held, read back
        from them (views, no copy)."""
        if self.weights:
            return self.weights
        if self.packed is None or self.packed_shard != ONE_RANK:
            raise ValueError("this adapter holds neither weights nor its whole rows")
        layout = adapter_rows_layout(model, self.rank, self.modules)
        r = self.rank
        weights = {}
        for layer in self.layers:
            rows = self.packed[layer]
            for block in layout.blocks:
                a = rows[block.a_offset : block.a_offset + r * block.c_in].reshape(r, -1)[:, : block.d_in]
                b = rows[block.b_offset : block.b_offset + r * block.c_out].reshape(r, -1)[:, : block.d_out]
                weights[(layer, block.module)] = (a, b.t())
        return weights

    def with_rows(self, rows: torch.Tensor, shard: Shard = ONE_RANK) -> LoraAdapter:
        """This adapter carrying `rows`, what `pack` made for a pool of rank `shard` (so that loading it only
        copies)."""
        return dataclasses.replace(self, packed=rows, packed_shard=shard)

    def rows(self, pool: PoolLayout, model: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
        """`pack(pool, model, dtype)`: the rows packed ahead of time when they fit that pool (cast when only
        their dtype differs: exact, as packing only ever widened the weights), else packed now."""
        rows = self.packed
        if rows is not None and self.packed_shard == pool.shard and rows.shape == self._packed_shape(pool, model):
            return rows if rows.dtype == dtype else rows.to(dtype)
        return self.pack(pool, model, dtype)

    def _packed_shape(self, pool: PoolLayout, model: ModelConfig) -> tuple[int, int, int]:
        return (pool.num_layers, self.layout(pool, model).num_rows, pool.row_width)


def _span(part: range) -> slice:
    return slice(part.start, part.stop)


def _padded_rank(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, d_in] and B [d_out, r] with zero rank vectors added up to `rank`."""
    extra = rank - a.shape[0]
    if extra == 0:
        return a, b
    return torch.cat([a, a.new_zeros(extra, a.shape[1])]), torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)


def _chunk_rows(matrix: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """[r, d] -> [r * chunks, width]: each rank vector cut into row-sized chunks, the last zero-padded."""
    r, d = matrix.shape
    padded = torch.zeros(r, chunks * width, dtype=matrix.dtype)
    padded[:, :d] = matrix
    return padded.view(r * chunks, width)


# ---- reading -----------------------------------------------------------------------------------
def load_adapter_dir(path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and validate a PEFT adapter directory."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidAdapterError(f"{path} is not a directory holding {CONFIG_FILE} and {SAFETENSORS_FILE}")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise InvalidAdapterError(f"{path} has no {CONFIG_FILE}")
    if (path / SAFETENSORS_FILE).is_file():
        weights, fmt = (path / SAFETENSORS_FILE).read_bytes(), "safetensors"
    elif (path / BIN_FILE).is_file():
        weights, fmt = (path / BIN_FILE).read_bytes(), "bin"
    else:
        raise InvalidAdapterError(f"{path} has no {SAFETENSORS_FILE} (or {BIN_FILE})")
    return load_adapter_bytes(config_path.read_bytes(), weights, model, max_rank, weights_format=fmt)


def load_adapter_bytes(
    config_json: bytes | memoryview | str,
    weights: bytes | memoryview,
    model: ModelConfig,
    max_rank: int,
    weights_format: str = "safetensors",
    sha256: str | None = None,
) -> LoraAdapter:
    """Validate an adapter given as the bytes of its two files, and hold its weights as tensors.

    `sha256`: the weights' content hash, already checked by the caller (the worker's fetcher); kept
    on the adapter so the host cache can tell two contents of one (name, version) apart.
    """
    return to_lora_adapter(check_adapter_bytes(config_json, weights, model, max_rank, weights_format), sha256)


def to_lora_adapter(checked: CheckedAdapter, sha256: str | None = None) -> LoraAdapter:
    """The validated weights as torch tensors viewing the same bytes (no copy)."""
    config = checked.config
    return LoraAdapter(
        rank=config.rank,
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        modules=checked.modules,
        layers=checked.layers,
        weights={key: (_tensor(a), _tensor(b)) for key, (a, b) in checked.weights.items()},
        config=config.raw,
        sha256=sha256,
    )


def _tensor(stored: StoredTensor) -> torch.Tensor:
    return torch.from_numpy(stored.data).view(_TORCH_DTYPES[stored.dtype]).view(stored.shape)
