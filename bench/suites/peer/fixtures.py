"""The peer suite's model and adapters, written once under its cache directory.

The model is a random Llama of a given shape (`bench/common/random_model.py`, the demo tokenizer);
the adapters are synthetic PEFT directories (`bench/common/synthetic_adapters.py`) on all seven
projections, the same files for both systems: vLLM reads the directories, loraserve gets them
uploaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.bench.common.random_model import DEMO_VOCAB, RANDOM_POSITIONS, LlamaShape, write_once
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.peer.plan import adapter_ranks

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ensure_model(cache_dir: Path, shape: tuple[int, ...], seed: int) -> Path:
    """The random Llama of `shape` (hidden, layers, heads, kv heads, intermediate), written unless there."""
    hidden, layers, heads, kv_heads, intermediate = shape
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"shape {shape}: hidden must be a multiple of heads, and heads of kv heads")
    path = cache_dir / f"llama-{hidden}-{layers}-{heads}-{kv_heads}-{intermediate}-s{seed}"
    return write_once(path, LlamaShape(*shape, vocab=DEMO_VOCAB), seed=seed, positions=RANDOM_POSITIONS)


def adapter_dirs(model_dir: Path, count: int, ranks: tuple[int, ...], cache_dir: Path, seed: int, dtype: str):
    """{name: PEFT directory} of `count` adapters of `model_dir`, ranks round-robin, saved in `dtype`."""
    adapters = SyntheticAdapters(Path(model_dir), ALL_PROJECTIONS, seed, dtype=getattr(torch, dtype))
    return {
        name: adapters.write(name, rank, cache_dir / "adapters") for name, rank in adapter_ranks(count, ranks).items()
    }
