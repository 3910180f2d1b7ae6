"""An adapter the store sent already packed in the pool's row layout, checked and held without a copy.

The store validated the weights when it registered them (`loraserve/adapter_format.py`, the code a worker
runs on files) and packed them (`loraserve/pool_rows.py`); the fetcher checked the bytes against the store's
per-layer digests (or mapped the store's private shared-memory file). What is left to check here is that the
rows are what this worker's pool expects: the config parses and passes the same checks as on a file
(rank within `max_rank`, targets that exist in this model), the targeted modules and layers are exactly the
config's, and the rows' shape is the layout of that rank and those modules for this model (of its part
of them, for a tensor-parallel rank). Anything else is InvalidAdapterError, and the rows are never looked at.

The result is a `LoraAdapter` with no per-tensor weights, only `packed` rows: a torch view of the received
frame or of the private shared-memory mapping. Loading it into the pool is the one copy of its bytes (a cast
on the way when the pool's dtype differs; casting the exactly widened rows gives what casting each tensor
would, so outputs are token-exact with the files' path).
"""

from __future__ import annotations

import warnings

import torch

from loraserve.adapter_config import parse_lora_config
from loraserve.adapter_store.client import FetchedRows
from loraserve.errors import InvalidAdapterError
from loraserve.model_config import LORA_MODULES, ModelConfig
from loraserve.partition import ONE_RANK, Shard, local_model
from loraserve.pool_rows import adapter_rows_layout
from loraserve.worker.adapters import LoraAdapter

TORCH_ROW_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def rows_adapter(fetched: FetchedRows, model: ModelConfig, max_rank: int, shard: Shard = ONE_RANK) -> LoraAdapter:
    """Check `fetched` against this worker's model (see the module docstring) and hold its rows as a tensor;
    `shard`: the tensor-parallel rank whose part of the rows they are."""
    h = fetched.header
    where = f"adapter {h.name} v{h.version} (rows)"
    config = parse_lora_config(fetched.config_json, model, max_rank)
    modules = tuple(m for m in LORA_MODULES if any(t == m for _, t in config.targets))
    layers = tuple(sorted({layer for layer, _ in config.targets}))
    if h.rank != config.rank or tuple(h.modules) != modules or tuple(h.layers) != layers:
        raise InvalidAdapterError(f"{where}: rank, modules or layers differ from its adapter_config.json")
    layout = adapter_rows_layout(model, config.rank, modules, shard)
    expected = (model.num_layers, layout.num_rows, local_model(model, shard).kv_width)
    if (h.num_layers, h.num_rows, h.row_width) != expected or h.dtype not in TORCH_ROW_DTYPES:
        raise InvalidAdapterError(
            f"{where}: rows [{h.num_layers}, {h.num_rows}, {h.row_width}] of {h.dtype[:16]!r}, expected "
            f"{list(expected)} of float16, bfloat16, float32 or float64 for this model"
        )
    with warnings.catch_warnings():  # a received frame is read-only: the rows are only ever read
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.frombuffer(fetched.rows, dtype=TORCH_ROW_DTYPES[h.dtype]).view(expected)
    return LoraAdapter(
        rank=config.rank,
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        modules=modules,
        layers=layers,
        weights={},
        config=config.raw,
        sha256=h.sha256,
        packed=rows,
        packed_shard=shard,
    )
