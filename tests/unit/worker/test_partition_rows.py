"""Each tensor-parallel rank's part of an adapter, packed into its pool rows (`loraserve/partition.py`): the
same from the adapter's weights (a file) as from the whole rows the adapter store keeps, the same as the
part the store cuts for that rank, and, reassembled over the ranks, the adapter's whole A and B (zero-padded to a
rank every ranks count divides)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_adapter
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loraserve.adapter_format import check_adapter_bytes
from loraserve.model_config import ModelConfig
from loraserve.partition import ROW_MODULES, Shard, lora_slice
from loraserve.pool_rows import RowsSpec, pack_rows, rows_spec, shard_rows
from loraserve.worker.adapter_rows import TORCH_ROW_DTYPES
from loraserve.worker.adapters import load_adapter_bytes, load_adapter_dir
from loraserve.worker.pool_layout import PoolLayout

DTYPE = torch.float32


def _parts(adapter, model: ModelConfig, size: int) -> list[tuple[PoolLayout, torch.Tensor]]:
    layouts = [PoolLayout.for_model(model, 32, 64, Shard(size, i)) for i in range(size)]
    return [(layout, adapter.pack(layout, model, DTYPE)) for layout in layouts]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["r16-all-rslora", "r8-kod-layer1"])
def test_a_ranks_rows_are_the_same_from_the_weights_and_from_the_stores_rows(tiny_model, tiny_adapters, name, size):
    model = ModelConfig.from_dir(tiny_model)
    adapter = load_adapter_dir(tiny_adapters[name], model, 64)
    whole = adapter.rows(PoolLayout.for_model(model, 2, 1), model, DTYPE)  # what the store packs
    from_store = dataclasses.replace(adapter, weights={}, packed=whole)
    for layout, rows in _parts(adapter, model, size):
        assert torch.equal(from_store.rows(layout, model, DTYPE), rows)


@pytest.fixture(scope="module")
def rank_three(tiny_model, tmp_path_factory):
    return make_adapter(tiny_model, tmp_path_factory.mktemp("r3") / "r3", 3, "all-linear", seed=12)


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_parts_reassemble_the_whole_adapter(tiny_model, rank_three, size):
    """A rank-3 adapter on every projection: padded to 4 with zeros; with 4 ranks, one A rank vector per rank
    on q/k/v/gate/up, and each of the 2 KV heads' k/v outputs on two ranks."""
    model = ModelConfig.from_dir(tiny_model)
    adapter = load_adapter_dir(rank_three, model, 64)
    parts = _parts(adapter, model, size)
    for (layer, module), (a, b) in adapter.weights.items():
        padded = lora_slice(model, module, adapter.rank, Shard(size, 0)).rank
        a_whole, b_whole = a.new_zeros(padded, a.shape[1]), b.new_zeros(b.shape[0], padded)
        for i, (layout, rows) in enumerate(parts):
            block = layout.adapter_layout(model, adapter.rank, adapter.modules).block(module)
            part = lora_slice(model, module, adapter.rank, Shard(size, i))
            w = layout.row_width
            a_rows = rows[layer, block.a_offset : block.a_offset + block.a_rank * block.c_in]
            a_part = a_rows.reshape(block.a_rank, block.c_in * w)[:, : block.d_in]
            b_rows = rows[layer, block.b_offset : block.b_offset + part.rank * block.c_out]
            b_part = b_rows.reshape(part.rank, block.c_out * w)[:, : block.d_out].T
            a_whole[part.a_ranks.start : part.a_ranks.stop, part.a_inputs.start : part.a_inputs.stop] = a_part
            b_whole[part.b_outputs.start : part.b_outputs.stop] = b_part
        assert torch.equal(a_whole[: adapter.rank], a) and torch.equal(b_whole[:, : adapter.rank], b), (layer, module)
        assert not a_whole[adapter.rank :].any() and not b_whole[:, adapter.rank :].any()  # the padding
        assert block.a_rank == (padded if module in ROW_MODULES else padded // size)  # all, or this rank's share


def _stored(directory, dtype: torch.dtype) -> tuple[bytes, bytes]:
    """The adapter's files, its weights re-saved in `dtype`."""
    tensors = {
        k: v.to(dtype) for k, v in load_safetensors((directory / "adapter_model.safetensors").read_bytes()).items()
    }
    return (directory / "adapter_config.json").read_bytes(), save_safetensors(tensors)


def _array_rows(buffer, spec: RowsSpec) -> torch.Tensor:
    rows = torch.frombuffer(bytearray(buffer), dtype=TORCH_ROW_DTYPES[spec.dtype])
    return rows.view(spec.num_layers, spec.num_rows, spec.row_width)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stores_part_for_each_rank_is_what_that_rank_packs(tiny_model, tiny_adapters, rank_three, size, dtype):
    """Two ways to one rank's rows, bit for bit: the store cutting them from its whole rows (numpy, what it
    sends a rank) and the rank packing the weights itself (torch, what the PEFT-exact tests run); ranks 3 to
    64, every target or some, layers skipped."""
    model = ModelConfig.from_dir(tiny_model)
    for directory in [*tiny_adapters.values(), rank_three]:
        config, weights = _stored(directory, dtype)
        checked = check_adapter_bytes(config, weights, model, 64)
        whole_spec = rows_spec(model, checked)
        whole = np.zeros(whole_spec.nbytes, dtype=np.uint8)
        pack_rows(checked, model, whole)
        adapter = load_adapter_bytes(config, weights, model, 64)
        for i in range(size):
            shard = Shard(size, i)
            spec, cut = shard_rows(whole.data, whole_spec, model, checked.config.rank, checked.modules,
                                   checked.layers, shard)  # fmt: skip
            layout = PoolLayout.for_model(model, 32, 64, shard)
            assert torch.equal(_array_rows(cut, spec), adapter.pack(layout, model, dtype)), (directory.name, i)
