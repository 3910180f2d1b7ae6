"""Per-step metadata lives in buffers allocated once: same addresses every step, nothing truncated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraserve.kernels.batch import LoraGeometry, build_attention_batch, build_lora_plan
from loraserve.kernels.step_buffers import StepBuffers, StepCapacity, StepCapacityError
from loraserve.model_config import LORA_MODULES, ModelConfig
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.runner import step_capacity
from loraserve.worker.sampling import SamplingParams

ATTENTION_TABLES = ("query_start", "context_len", "page_table", "new_rows")
LORA_TABLES = (
    "seg_start",
    "seg_len",
    "seg_adapter",
    "token_adapter",
    "rank",
    "scale",
    "page_table",
    "a_offset",
    "b_offset",
    "layer_active",
    "shrink_rank",
    "shrink_a_offset",
    "v_col",
)
PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 3, 99], [1, 8, 8, 8, 8, 8, 8, 200, 17, 301, 5], [1, 17], [1, 600, 2, 902, 14]]
GEOMETRY = LoraGeometry.uniform(d_in=16, d_out=16, row_width=8, rows_per_page=4, num_layers=2)


class _Recorder:
    """Stands in for the runner's model: records the address of every metadata tensor the forward pass gets."""

    def __init__(self, model):
        self.model, self.config, self.steps = model, model.config, []

    def __call__(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        tensors = {"input_ids": input_ids, "positions": batch.positions}
        tensors |= {f"attention.{n}": getattr(batch.attention, n) for n in ATTENTION_TABLES}
        if batch.lora is not None:
            tensors |= {f"lora.{n}": getattr(batch.lora.tables, n) for n in LORA_TABLES}
        self.steps.append({name: t.data_ptr() for name, t in tensors.items()})
        return self.model(input_ids, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


def test_engine_steps_refill_the_same_storage(tiny_model, tiny_adapters):
    """Prefill chunks, decodes, steps with and without adapters: every table keeps its address."""
    engine = Engine(tiny_model, EngineConfig(device="cpu", pool_pages=96, max_batched_tokens=8))
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, path)
    recorder = engine.runner.model = engine.runner.forward = _Recorder(engine.runner.model)
    staged: dict[str, set[int]] = {}
    put = engine.runner.buffers.put

    def spy(name, values, shape=None):
        view = put(name, values, shape)
        staged.setdefault(name, set()).add(view.data_ptr())
        return view

    engine.runner.buffers.put = spy
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    pairs = zip(PROMPTS, [None, *tiny_adapters], strict=True)
    requests = [GenerateRequest(prompt_ids=p, adapter=a, sampling=sampling) for p, a in pairs]
    results = engine.generate(requests)

    assert all(r.error is None and len(r.token_ids) == 6 for r in results)
    assert len(recorder.steps) > 5
    addresses: dict[str, set[int]] = {}
    for step in recorder.steps:
        for name, ptr in step.items():
            addresses.setdefault(name, set()).add(ptr)
    assert len(addresses) == 2 + len(ATTENTION_TABLES) + len(LORA_TABLES)
    assert {name: len(ptrs) for name, ptrs in addresses.items()} == dict.fromkeys(addresses, 1)
    assert len(staged) == 20 and all(len(ptrs) == 1 for ptrs in staged.values()), staged  # `last` included


def _adapter(rank: int, pages: list[int], layers=(True, True)) -> SimpleNamespace:
    offsets = [0, -1, 2 * rank, -1, -1, -1, -1]
    return SimpleNamespace(
        rank=rank, scale=0.5, pages=pages, a_offsets=offsets, b_offsets=offsets, layers=list(layers), row_dtype=None
    )


def _same(a, b, names) -> None:
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), name


def test_shared_buffers_build_what_fresh_ones_do():
    """The runner's path (one StepBuffers, refilled) and the kernel tests' (a device) give equal tables,
    also after a wider step left other values in the storage."""
    buffers = StepBuffers(StepCapacity(32, 4, 8, 4, 8, 2), "cpu")
    wide, narrow = _adapter(4, [5, 1, 7, 2, 9]), _adapter(2, [3])
    build_lora_plan(GEOMETRY, [(wide, 3), (narrow, 5), (None, 2), (wide, 1)], buffers)
    build_attention_batch([([4, 8, 1, 3, 6], 36, 3), ([2], 0, 5)], 8, None, buffers)
    buffers.upload()

    seqs = [(narrow, 2), (None, 1), (_adapter(8, [0, 6], layers=(False, True)), 3)]
    staged = build_lora_plan(GEOMETRY, seqs, buffers)
    attention = build_attention_batch([([3, 0, 5], 17, 1), ([7, 2], 4, 2)], 8, 4, buffers)
    buffers.upload()
    _same(staged.tables, build_lora_plan(GEOMETRY, seqs, "cpu").tables, LORA_TABLES)
    _same(attention, build_attention_batch([([3, 0, 5], 17, 1), ([7, 2], 4, 2)], 8, 4, "cpu"), ATTENTION_TABLES)
    assert attention.page_table.tolist() == [[3, 0, 5], [7, 0, 0]]  # only the pages the tokens occupy
    tables = staged.tables
    assert tables.layer_active.tolist() == [[1, 1], [0, 1]] and tables.token_adapter.tolist() == [0, 0, -1, 1, 1, 1]


@pytest.mark.parametrize(
    ("seqs", "limit"),
    [
        ([([0], 0, 5)] * 2, "max_tokens=10"),  # 10 tokens > 8
        ([([0], 0, 1)] * 3, "max_seqs=3"),
        ([(list(range(6)), 40, 1)], "max_seq_pages=6"),
    ],
)
def test_an_oversized_step_raises(seqs, limit):
    buffers = StepBuffers(StepCapacity(8, 2, 4, 2, 2, 2), "cpu")
    with pytest.raises(StepCapacityError, match=limit):
        build_attention_batch(seqs, 8, None, buffers)


def test_oversized_adapters_raise():
    buffers = StepBuffers(StepCapacity(8, 4, 4, 2, 2, 2), "cpu")
    with pytest.raises(StepCapacityError, match="max_adapter_pages=3"):
        build_lora_plan(GEOMETRY, [(_adapter(4, [1, 2, 3]), 1)], buffers)
    with pytest.raises(StepCapacityError, match="max_adapters=3"):
        build_lora_plan(GEOMETRY, [(_adapter(1, [i]), 1) for i in range(3)], buffers)
    with pytest.raises(StepCapacityError, match="'input_ids' needs 9 entries"):
        buffers.put("input_ids", list(range(9)))


def test_capacity_comes_from_the_engine_limits(tiny_model):
    config = EngineConfig(device="cpu", max_batch_size=5, max_batched_tokens=300, max_lora_rank=16)
    model = ModelConfig.from_dir(tiny_model)
    layout = PoolLayout.for_model(model, rows_per_page=32, num_pages=64)
    capacity = step_capacity(config, layout, model, max_model_len=100)
    assert (capacity.max_tokens, capacity.max_seqs, capacity.max_adapters) == (300, 5, 5)
    assert capacity.max_seq_pages == layout.kv_pages_for(100)
    assert capacity.max_adapter_pages == layout.adapter_layout(model, 16, LORA_MODULES).num_pages


def test_the_engine_sizes_the_buffers_from_its_config(tiny_model):
    config = EngineConfig(device="cpu", pool_pages=64, max_batch_size=100, max_batched_tokens=4096)
    engine = Engine(tiny_model, config)
    capacity = engine.runner.buffers.capacity
    assert capacity == step_capacity(config, engine.layout, engine.model_config, engine.max_model_len)
