"""Adapters as the store packs them (`loraserve/pool_rows.py`), checked and loaded by a worker, layer by layer.

- The store's numpy rows, cast to any pool dtype, are bit for bit what the worker's own torch packing makes
  from the files (adapters of mixed ranks and targets, rsLoRA, `layers_to_transform`, float32 / float16 /
  bfloat16 / mixed weights; a model with grouped-query attention and an MLP width not a multiple of the row).
- An engine serving rows-only adapters, and one whose adapter copy is still running layer by layer when the
  prefill starts, gives the same tokens as the files' path (token-exact).
- Rows that do not fit the worker's model, or do not match their config, are refused before they are read;
  bytes that do not hash to the store's layer digests are refused by the fetcher.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loraserve.adapter_format import check_adapter_bytes
from loraserve.adapter_store.client import FetchedRows, _checked_rows
from loraserve.errors import DataLossError, InvalidAdapterError
from loraserve.model_config import ModelConfig
from loraserve.pool_rows import layer_digests, pack_rows, rows_spec
from loraserve.wire import AdapterRows
from loraserve.worker.adapter_rows import TORCH_ROW_DTYPES, rows_adapter
from loraserve.worker.adapters import load_adapter_bytes
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.sampling import SamplingParams

MAX_RANK = 64
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = ([1, 5, 9, 33, 7, 12, 40], [1, 44, 3, 99], [1, 8, 8, 8, 200, 17, 301, 5])


def _files(directory, dtype: str | None = None) -> tuple[bytes, bytes]:
    """The adapter's two files; `dtype` re-saves its weights in float16, bfloat16 or "mixed" (A half, B bf16)."""
    config = (directory / "adapter_config.json").read_bytes()
    weights = (directory / "adapter_model.safetensors").read_bytes()
    if dtype is None:
        return config, weights
    tensors = load_safetensors(weights)
    for name, t in tensors.items():
        wanted = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
        if dtype == "mixed":
            wanted = torch.float16 if "lora_A" in name else torch.bfloat16
        tensors[name] = t.to(wanted)
    return config, save_safetensors(tensors)


def _rows(model: ModelConfig, config: bytes, weights: bytes, name: str = "a", version: int = 1) -> FetchedRows:
    """What a worker receives for these files: the store's packing and header, as the fetcher hands it over."""
    checked = check_adapter_bytes(config, weights, model, MAX_RANK)
    spec = rows_spec(model, checked)
    buffer = np.zeros(spec.nbytes, dtype=np.uint8)
    pack_rows(checked, model, buffer)
    header = AdapterRows(
        name, version, "ab" * 32, checked.config.rank, list(checked.modules), list(checked.layers), spec.dtype,
        spec.num_layers, spec.num_rows, spec.row_width, layer_digests(buffer.data, spec),
    )  # fmt: skip
    return FetchedRows(header, config, memoryview(buffer), shared=False)


@pytest.mark.parametrize("file_dtype", [None, "float16", "bfloat16", "mixed"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_stores_rows_are_what_the_worker_packs(tiny_model, tiny_adapters, file_dtype, pool_dtype):
    model = ModelConfig.from_dir(tiny_model)
    layout = PoolLayout.for_model(model, 8, 64)
    for directory in tiny_adapters.values():
        config, weights = _files(directory, file_dtype)
        own = load_adapter_bytes(config, weights, model, MAX_RANK).pack(layout, model, pool_dtype)
        rows = rows_adapter(_rows(model, config, weights), model, MAX_RANK)
        assert rows.packed.dtype == TORCH_ROW_DTYPES[{None: "float32", "mixed": "float32"}.get(file_dtype, file_dtype)]
        assert torch.equal(rows.rows(layout, model, pool_dtype), own), directory.name


def _engine(tiny_model, tiny_adapters, rows: bool) -> Engine:
    engine = Engine(tiny_model, EngineConfig(device="cpu", pool_pages=96, max_lora_rank=MAX_RANK))
    model = engine.model_config
    for name, directory in tiny_adapters.items():
        config, weights = _files(directory)
        if rows:
            adapter = rows_adapter(_rows(model, config, weights), model, MAX_RANK)
            engine.adapters.add(name, engine.pool.copier.prepare(adapter))
        else:
            engine.register_adapter(name, directory)
    return engine


def _generate(engine: Engine, adapters: list[str]) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(adapters))]
    pairs = zip(prompts, adapters, strict=True)
    requests = [GenerateRequest(prompt_ids=list(p), adapter=a, sampling=GREEDY) for p, a in pairs]
    return [r.token_ids for r in engine.generate(requests)]


def test_rows_only_adapters_and_a_copy_still_landing_layer_by_layer_are_token_exact(tiny_model, tiny_adapters):
    names = list(tiny_adapters)
    files_engine = _engine(tiny_model, tiny_adapters, rows=False)
    expected = _generate(files_engine, names)
    files_engine.close()

    rows_engine = _engine(tiny_model, tiny_adapters, rows=True)
    assert _generate(rows_engine, names) == expected  # rows from the store, copied in on demand
    rows_engine.close()

    engine = _engine(tiny_model, tiny_adapters, rows=True)  # nothing in its pool yet
    pool, copy_layers, events = engine.pool, PoolCopier.copy_layers, []

    def slow(self, rows, runs, layers, progress):  # each layer lands 30 ms after the one before
        for layer in layers:
            time.sleep(0.03)
            copy_layers(self, rows, runs, range(layer, layer + 1), progress)
            events.append(("landed", time.monotonic()))

    execute = engine.runner.execute

    def timed(batch, kv_copies=()):
        events.append(("step", time.monotonic()))
        return execute(batch, kv_copies)

    pool.copier.copy_layers = slow.__get__(pool.copier)
    engine.runner.execute = timed
    assert len(engine.adapters.prefetch(names)) == len(names)  # background copies, as a worker starts them on a fetch
    assert _generate(engine, names) == expected
    first_step = next(t for kind, t in events if kind == "step")
    last_layer = max(t for kind, t in events if kind == "landed")
    assert first_step < last_layer  # the prefill started while layers were still landing
    assert pool.stats.prefetch_late >= 1
    engine.close()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (lambda h: {"rank": h.rank * 2}, "differ from its adapter_config.json"),
        (lambda h: {"modules": ["q_proj"]}, "differ from its adapter_config.json"),
        (lambda h: {"layers": [0]}, "differ from its adapter_config.json"),
        (lambda h: {"num_rows": h.num_rows - 1}, "expected"),
        (lambda h: {"row_width": h.row_width * 2}, "expected"),
        (lambda h: {"num_layers": h.num_layers + 1, "digests": h.digests * 2}, "expected"),
        (lambda h: {"dtype": "int8"}, "expected"),
    ],
)
def test_rows_that_do_not_fit_this_worker_or_their_config_are_refused(tiny_model, tiny_adapters, changes, message):
    model = ModelConfig.from_dir(tiny_model)
    config, weights = _files(tiny_adapters["r4-qv"])
    good = _rows(model, config, weights)
    header = msgspec.structs.replace(good.header, **changes(good.header))
    with pytest.raises(InvalidAdapterError, match=message):
        rows_adapter(FetchedRows(header, config, good.rows, shared=False), model, MAX_RANK)
    with pytest.raises(InvalidAdapterError, match="rank"):  # the config is checked as on a file: here, the rank
        rows_adapter(good, model, max_rank=2)


def test_the_fetcher_refuses_rows_that_do_not_hash_to_the_stores_digests(tiny_model, tiny_adapters):
    model = ModelConfig.from_dir(tiny_model)
    config, weights = _files(tiny_adapters["r4-qv"])
    good = _rows(model, config, weights)
    reply = msgspec.structs.replace(good.header, config_json=config)
    rows = bytearray(good.rows)
    assert _checked_rows(reply, memoryview(rows), shared=False, verify=True).rows.nbytes == len(rows)
    rows[-1] ^= 1  # one bit of the last layer
    with pytest.raises(DataLossError, match=f"layer {good.header.num_layers - 1}"):
        _checked_rows(reply, memoryview(rows), shared=False, verify=True)
    with pytest.raises(DataLossError, match="announced"):
        _checked_rows(reply, memoryview(rows)[:-4], shared=False, verify=True)
