"""A model split over ranks (tensor parallelism, `loraserve/partition.py`) against transformers + peft and
against the same engine on one rank: gloo process groups on the CPU, every rank a real process.

Greedy tokens are identical to PEFT's and to one rank's; seeded sampling identical to one rank's. The
ranks' partial sums are added in another order than one GEMM adds them (float32 here), which the greedy
choices of these models do not feel. Adapters of ranks 1 to 64 (ranks that are not a multiple of the
ranks count are padded with zero rank vectors), every target, layers skipped, rsLoRA; grouped-query
attention with fewer KV heads than ranks (4 ranks, 2 KV heads: each KV head on two ranks).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import TinySpec, hf_greedy, make_adapter, make_model

from loraserve.adapter_store.config import MIB, StoreLimits
from loraserve.adapter_store.data_plane import DataPlane
from loraserve.adapter_store.packing import RowsMaker
from loraserve.adapter_store.store import AdapterStore
from loraserve.errors import InvalidConfigError
from loraserve.model_config import LORA_MODULES, ModelConfig
from loraserve.partition import Shard
from loraserve.worker.config import EngineConfig, FetchConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.fetch_threads import FetchThreads, Wakeup
from loraserve.worker.sampling import SamplingParams

NEW_TOKENS = 10
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 3, 99], [1, 8, 8, 8, 8, 8, 8, 200, 17, 301, 5], [1, 17], [1, 600, 2, 902]]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """The shared tiny adapters (ranks 4, 8, 16, 64) and two whose rank no ranks count divides."""
    root = tmp_path_factory.mktemp("odd-ranks")
    return {
        **tiny_adapters,
        "r1-all": make_adapter(tiny_model, root / "r1", 1, list(LORA_MODULES), seed=5),
        "r3-qkv-down": make_adapter(tiny_model, root / "r3", 3, ["q_proj", "k_proj", "v_proj", "down_proj"], seed=6),
    }


def _requests(names: list[str | None]) -> list[GenerateRequest]:
    """A greedy request per adapter and the base model, then the same seeded-sampled."""
    requests = []
    for i, name in enumerate(names):
        prompt = PROMPTS[i % len(PROMPTS)]
        seeded = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7 + i)
        requests.append(GenerateRequest(prompt_ids=prompt, adapter=name, sampling=GREEDY))
        requests.append(GenerateRequest(prompt_ids=prompt, adapter=name, sampling=seeded))
    return requests


@pytest.fixture(scope="module")
def one_rank(tiny_model, adapters) -> list[list[int]]:
    """The tokens of `_requests` on one rank."""
    return _generate(tiny_model, adapters, 1, _requests([None, *adapters]))


@pytest.fixture(scope="module")
def peft(tiny_model, adapters) -> list[list[int]]:
    """The greedy tokens of `_requests` by transformers + peft."""
    return [
        hf_greedy(tiny_model, None if r.adapter is None else adapters[r.adapter], r.prompt_ids, NEW_TOKENS)
        for r in _requests([None, *adapters])[::2]
    ]


def _generate(
    model: Path, adapters: dict[str, Path], size: int, requests: list[GenerateRequest], device: str = "cpu"
) -> list[list[int]]:
    config = EngineConfig(device=device, dtype="float32", pool_pages=160, tensor_parallel=size)
    engine = Engine(model, config)
    try:
        for name, path in adapters.items():
            engine.register_adapter(name, path)
        return [r.token_ids for r in engine.generate(requests)]
    finally:
        engine.close()


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_engine_is_token_exact_with_peft_and_with_one_rank(tiny_model, adapters, one_rank, peft, size):
    split = _generate(tiny_model, adapters, size, _requests([None, *adapters]))
    assert split == one_rank
    assert split[::2] == peft  # the greedy ones


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_model_split_over_two_gpus_is_token_exact_with_one_gpu_and_peft(tiny_model, adapters, peft):
    """NCCL between the ranks' processes, one GPU each; float32, as PEFT runs."""
    requests = _requests([None, *adapters])
    split = _generate(tiny_model, adapters, 2, requests, device="cuda")
    assert split == _generate(tiny_model, adapters, 1, requests, device="cuda")
    assert split[::2] == peft


def test_each_rank_gets_its_own_part_of_the_adapters_from_the_store(tiny_model, adapters, peft):
    """The store cuts each rank's part of its rows (its data plane on a real socket); rank 0's fetch threads
    fetch one part per rank, and at each load hand rank 1 its own part alone: the tokens are PEFT's, and rank
    1 receives exactly the bytes of its parts, about half of the whole rows."""
    model = ModelConfig.from_dir(tiny_model)
    store = AdapterStore(model, StoreLimits(max_adapter_bytes=MIB, budget_bytes=64 * MIB), rows=RowsMaker(model, None))
    for name, path in adapters.items():
        store.register(
            name, (path / "adapter_config.json").read_bytes(), (path / "adapter_model.safetensors").read_bytes()
        )
    plane = DataPlane(store, "tcp://127.0.0.1:*")
    plane.start()
    engine = Engine(tiny_model, EngineConfig(device="cpu", dtype="float32", pool_pages=160, tensor_parallel=2))
    fetches = FetchThreads(FetchConfig(store_address=plane.endpoint), engine, Wakeup())
    try:
        for name in adapters:
            fetches.submit((name, 1), for_prefetch=True, trace=None)  # as the scheduler's prefetch would
            fetched = fetches.results.get(timeout=30)
            assert (fetched.error, fetched.source) == (None, "rows")
            engine.adapters.add(fetched.key[0], fetched.adapter)
        requests = _requests([None, *adapters])[::2]
        assert [r.token_ids for r in engine.generate(requests)] == peft
        whole = {name: store.get_rows(name, 1)[2] for name in adapters}
        parts = sum(store.rows.part(rows, Shard(2, 1)).spec.nbytes for rows in whole.values())
        assert engine.leader.channel.rows_sent == {1: parts}
        assert parts < 0.6 * sum(rows.spec.nbytes for rows in whole.values())
    finally:
        fetches.close()
        engine.close()
        plane.stop()


def test_biases_are_split_with_their_projections(tmp_path):
    """Qwen2's q/k/v biases go with their rows; an untied output layer and a wider MLP."""
    model = make_model(tmp_path / "qwen2", TinySpec(arch="qwen2", heads=4, kv_heads=4, intermediate=96))
    adapter = {"all": make_adapter(model, tmp_path / "all", 6, "all-linear", seed=9)}
    requests = [GenerateRequest(prompt_ids=p, adapter=a, sampling=GREEDY) for p in PROMPTS[:2] for a in (None, "all")]
    split = _generate(model, adapter, 2, requests)
    for request, tokens in zip(requests, split, strict=True):
        path = None if request.adapter is None else adapter["all"]
        assert tokens == hf_greedy(model, path, request.prompt_ids, NEW_TOKENS), request.adapter


def test_the_bytes_each_rank_sends_are_the_papers(tiny_model, tmp_path):
    """One prefill step of B tokens with a rank-r adapter on q, k, v and o, N = 2 ranks, hidden h, L layers:
    the base model all-reduces [B, h] twice per layer (o, down): 2 x 2(N-1)Bh/N elements; the LoRA terms
    all-gather the q/k/v shrinks and all-reduce o's: 3(N-1)Br/N + 2(N-1)Br/N = 5(N-1)Br/N (S-LoRA, 6.2)."""
    r, tokens, n = 8, 12, 2
    adapter = make_adapter(tiny_model, tmp_path / "attn", r, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=11)
    engine = Engine(tiny_model, EngineConfig(device="cpu", pool_pages=64, tensor_parallel=n))
    try:
        engine.register_adapter("attn", adapter)
        engine.add_request(list(range(1, tokens + 1)), SamplingParams(max_new_tokens=1), adapter="attn")
        engine.step()
        traffic = engine.leader.collectives.traffic
        layers, h, element = engine.model_config.num_layers, engine.model_config.hidden_size, 4
        assert traffic.base == layers * 2 * 2 * (n - 1) * tokens * h // n * element
        assert traffic.lora == layers * 5 * (n - 1) * tokens * r // n * element
    finally:
        engine.close()


def test_a_rank_that_cannot_start_fails_the_engine_at_once(tiny_model, monkeypatch):
    """Not after the process group's timeout: rank 0 watches the others' processes while they join."""
    import torch.distributed as dist

    from loraserve.worker.tensor_parallel import group

    monkeypatch.setattr(group.sys, "executable", "false")  # the other rank's process exits at once
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited while starting"):
        Engine(tiny_model, EngineConfig(device="cpu", pool_pages=16, tensor_parallel=2))
    assert time.monotonic() - started < 30 and not dist.is_initialized()


def test_a_model_that_cannot_be_split_is_refused_naming_why(tiny_model):
    with pytest.raises(InvalidConfigError, match="tensor_parallel 3 does not divide the model's num_attention_heads"):
        Engine(tiny_model, EngineConfig(device="cpu", pool_pages=16, tensor_parallel=3))
