"""Decode steps through the CUDA-graph path, and the warm-up before serving.

On CUDA the decode graphs are captured and replayed. Without a GPU the same path runs "uncaptured":
each bucket's forward pass over the same fixed views, with the same step-independent launches, is
called every step under the Triton interpreter. Either way the greedy tokens must be transformers +
peft's, for batches that shrink through the buckets as requests finish.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from loraserve.errors import InvalidConfigError
from loraserve.kernels.graph_tables import graph_attention_batch, graph_lora_plan
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.warm_up import rank_blocks

PROMPTS = [[1, 5, 9, 33, 7, 12], [1, 44, 3, 99], [1, 8, 8, 8, 8, 200, 17], [1, 17], [1, 600, 2], [1, 9, 9]]
ADAPTERS = [None, "r4-qv", "r16-all-rslora", "r64-mlp", "r4-qv", "r16-all-rslora"]


def _engine(model, adapters, **overrides) -> Engine:
    config = EngineConfig(dtype="float32", pool_pages=240, rows_per_page=8, max_batch_size=8, **overrides)
    engine = Engine(model, config)
    for name in sorted({a for a in ADAPTERS if a}):
        engine.register_adapter(name, adapters[name])
    return engine


def _requests() -> list[GenerateRequest]:
    # different lengths: the decode batch shrinks from 6 (padded to 8) through 4, 2 and 1
    return [
        GenerateRequest(prompt_ids=p, adapter=a, sampling=SamplingParams(max_new_tokens=2 + i, ignore_eos=True))
        for i, (p, a) in enumerate(zip(PROMPTS, ADAPTERS, strict=True))
    ]


def test_graph_path_is_token_exact_with_peft(tiny_model, tiny_adapters, kernel_device):
    mode = "auto" if kernel_device == "cuda" else "uncaptured"  # auto: captured on CUDA
    engine = _engine(tiny_model, tiny_adapters, device=kernel_device, backend="triton", cuda_graphs=mode)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes() == [1, 2, 4, 8]
    assert graphs.mode == ("capture" if kernel_device == "cuda" else "uncaptured")
    replayed: list[int] = []
    run = graphs.run
    graphs.run = lambda size: replayed.append(size) or run(size)  # observe, don't alter
    requests = _requests()
    results = engine.generate(requests)
    assert set(replayed) == {1, 2, 4, 8}, replayed
    for request, result in zip(requests, results, strict=True):
        expected = hf_greedy(tiny_model, tiny_adapters.get(request.adapter), request.prompt_ids, len(result.token_ids))
        assert result.token_ids == expected, request.adapter
    engine.pool.check_invariants()
    assert engine.stats()["pool"]["kv_pages"] == 1  # only the scratch page stays


def test_graph_views_are_where_the_steps_stage_their_tables(tiny_model, tiny_adapters):
    """A replayed graph reads the addresses and row strides it was captured with: the tables every
    step stages (fixed_width) must start at those addresses with those strides."""
    engine = _engine(tiny_model, tiny_adapters, backend="triton", cuda_graphs="uncaptured")
    runner, buffers = engine.runner, engine.runner.buffers
    seen, staged_steps = [], []
    run, stage = runner.graphs.run, runner._stage
    runner._stage = lambda batch, graphed: staged_steps.append(s := stage(batch, graphed)) or s

    def check(size: int) -> torch.Tensor:
        lora = graph_lora_plan(runner.geometry, buffers, size)
        attention = graph_attention_batch(buffers, size, engine.layout.tokens_per_page, None)
        seen.append((size, lora.tables.page_table.stride(), attention.page_table.stride()))
        staged = staged_steps[-1]
        assert staged.lora is None or staged.lora.tables.page_table.stride() == lora.tables.page_table.stride()
        assert staged.attention.page_table.stride() == attention.page_table.stride()
        for name in ("query_start", "context_len", "page_table", "new_rows"):
            assert getattr(staged.attention, name).data_ptr() == getattr(attention, name).data_ptr(), name
        if staged.lora is not None:
            for mine, captured in zip(staged.lora.tables.all(), lora.tables.all(), strict=True):
                assert mine.data_ptr() == captured.data_ptr()
        assert staged.input_ids.data_ptr() == buffers.view("input_ids", (size,)).data_ptr()
        return run(size)

    runner.graphs.run = check
    engine.generate(_requests()[:5])
    assert {s for s, _, _ in seen} == {1, 2, 4, 8}


def test_graph_modes_are_checked(tiny_model):
    with pytest.raises(InvalidConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="always")
    with pytest.raises(InvalidConfigError, match="needs the triton kernel backend"):
        Engine(tiny_model, EngineConfig(device="cpu", backend="torch", cuda_graphs="uncaptured", pool_pages=64))
    eager = Engine(tiny_model, EngineConfig(device="cpu", pool_pages=64))  # auto on CPU: no graphs, no padding
    assert eager.runner.graphs is None and eager.runner.decode_padding is None


def test_warm_up_leaves_nothing_behind(tiny_model, tiny_adapters):
    """The dummy steps write only to the scratch page: afterwards the pool holds nothing else and
    generation gives exactly what an engine without warm-up gives."""
    warm = _engine(tiny_model, tiny_adapters, device="cpu", warm_up="on", max_lora_rank=64)
    assert warm.warm_up_seconds is not None and rank_blocks(64) == [16, 32, 64]
    assert warm.steps == 0 and warm.stats()["pool"]["kv_pages"] == 1
    warm.pool.check_invariants()
    cold = _engine(tiny_model, tiny_adapters, device="cpu", warm_up="off", max_lora_rank=64)
    assert cold.warm_up_seconds is None
    assert [r.token_ids for r in warm.generate(_requests())] == [r.token_ids for r in cold.generate(_requests())]


@pytest.mark.gpu
def test_warm_up_compiles_every_kernel_variant(tiny_model, tiny_adapters):
    """After warm-up, serving adapters of every rank with prefill and decode compiles nothing more."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from loraserve.kernels import attention_triton, lora_triton

    kernels = [getattr(lora_triton, n) for n in dir(lora_triton) if n.endswith("_kernel")]
    kernels += [getattr(attention_triton, n) for n in dir(attention_triton) if n.endswith("_kernel")]

    def compiled() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    engine = _engine(tiny_model, tiny_adapters, device="cuda", backend="triton", max_lora_rank=64)
    before = compiled()
    engine.generate(_requests())
    assert compiled() == before


def test_enforce_eager_reaches_every_worker():
    """`up --enforce-eager` puts the flag on each worker's command line, where it turns graphs off."""
    import argparse

    from loraserve.launcher import commands as launcher
    from loraserve.worker import main as worker_main
    from loraserve.worker.cli import engine_config_from_args

    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    worker = argparse.ArgumentParser()
    worker_main.add_arguments(worker)
    for argv, graphs in (([], "auto"), (["--enforce-eager"], "off")):
        commands = launcher.role_commands(up.parse_args(["--workers", "2", *argv]))
        for name in ("worker-0", "worker-1"):
            line = commands[name]
            args = worker.parse_args(line[line.index("worker") + 1 :])
            assert engine_config_from_args(args).cuda_graphs == graphs
