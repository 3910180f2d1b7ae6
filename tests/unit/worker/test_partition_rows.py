"""Each tensor-parallel rank's part of an adapter, packed into its pool rows (`loraserve/partition.py`): the
same from the adapter's weights (a file) as from the whole rows the adapter store sends, and, reassembled
over the ranks, the adapter's whole A and B (zero-padded to a rank every ranks count divides)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_adapter

from loraserve.model_config import ModelConfig
from loraserve.partition import ROW_MODULES, Shard, lora_slice
from loraserve.worker.adapters import load_adapter_dir
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
