"""Tensor parallelism's partition of the model and of every adapter over N ranks (S-LoRA, section 6).

The base model is split as Megatron-LM splits it: q/k/v and gate/up are *column*-parallel (each rank
computes a slice of their outputs: its attention heads, its share of the MLP width), o and down are
*row*-parallel (each rank reads its slice of their input and produces a partial sum of the whole output,
summed by one all-reduce per block). Embeddings, norms and the output layer are replicated. KV heads
are split like the query heads; where there are fewer KV heads than ranks, each is replicated on the
ranks whose query heads read it.

The LoRA terms follow the base model's partition so that they communicate only small tensors:

    column module (q, k, v, gate, up): A split along the rank (rank i: rank vectors [i·r/N, (i+1)·r/N)),
        B split along its output like the base weight; the shrink's [T, r/N] is all-gathered to [T, r].
    row module (o, down): A split along its input like the base weight, B along its output (the hidden
        size); the shrink's partial [T, r] is all-reduced, and each rank's [T, h/N] slice of the LoRA
        output is added to its partial sum before the base model's all-reduce, which sums them.

A rank that is not a multiple of N is padded with zero rank vectors to one (`padded_rank`): they add
nothing. This module is the contract, torch-free: the worker's weights loader, its pool layout
(`loraserve/pool_rows.py`) and adapter packing read their slices from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraserve.errors import InvalidConfigError
from loraserve.model_config import LORA_GROUPS, LORA_MODULES, ModelConfig

ROW_MODULES = frozenset({"o_proj", "down_proj"})  # input split, output a partial sum; the rest: output split
# Indices into LORA_GROUPS of the groups whose LoRA shrink output is all-gathered (q/k/v, gate/up).
COLUMN_GROUPS = frozenset(i for i, g in enumerate(LORA_GROUPS) if LORA_MODULES[g[0]] not in ROW_MODULES)


@dataclass(frozen=True)
class Shard:
    """One rank's place: rank `index` of `size`. `Shard()` is the whole model on one rank."""

    size: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"rank {self.index} of {self.size} is not a rank")

    def part(self, width: int) -> range:
        """This rank's equal share of `width` elements (a multiple of `size`)."""
        step = width // self.size
        return range(self.index * step, (self.index + 1) * step)


ONE_RANK = Shard()  # the whole model on one rank: the default everywhere


@dataclass(frozen=True)
class LoraSlice:
    """A module's adapter weights on one rank, as ranges of PEFT's lora_A [r, d_in] and lora_B [d_out, r]
    after padding r to `rank` (`padded_rank`): A[a_ranks, a_inputs] and B[b_outputs, :]."""

    rank: int  # the padded rank: B's columns, and the shrink's output width once exchanged
    a_ranks: range
    a_inputs: range
    b_outputs: range


def check_partition(model: ModelConfig, size: int) -> None:
    """InvalidConfigError naming what cannot be split over `size` ranks."""
    if size < 1:
        raise InvalidConfigError(f"tensor_parallel must be at least 1, got {size}")
    kv = model.num_kv_heads
    for name, value in (
        ("num_attention_heads", model.num_heads),
        ("hidden_size", model.hidden_size),
        ("intermediate_size", model.intermediate_size),
    ):
        if value % size:
            raise InvalidConfigError(f"tensor_parallel {size} does not divide the model's {name} ({value})")
    if kv % size and size % kv:
        raise InvalidConfigError(
            f"tensor_parallel {size}: the model's {kv} KV heads can be neither split nor replicated evenly "
            "(one must be a multiple of the other)"
        )


def padded_rank(rank: int, size: int) -> int:
    return -(-rank // size) * size


def kv_heads(model: ModelConfig, shard: Shard) -> range:
    """The KV heads a rank holds: its share, or the one its query heads read when there are fewer than ranks."""
    kv, n = model.num_kv_heads, shard.size
    if kv >= n:
        return shard.part(kv)
    first = shard.index * kv // n
    return range(first, first + 1)


def local_model(model: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape of one rank's part of the network: its heads and its share of the MLP width."""
    if shard.size == 1:
        return model
    return dataclasses.replace(
        model,
        num_heads=model.num_heads // shard.size,
        num_kv_heads=len(kv_heads(model, shard)),
        intermediate_size=model.intermediate_size // shard.size,
    )


def output_part(model: ModelConfig, module: str, shard: Shard) -> range:
    """The output features of `module` that a rank computes (all of them for o and down: a partial sum)."""
    d_out = model.module_shape(module)[1]
    if module in ROW_MODULES or shard.size == 1:
        return range(d_out)
    if module in ("k_proj", "v_proj"):
        heads = kv_heads(model, shard)
        return range(heads.start * model.head_dim, heads.stop * model.head_dim)
    return shard.part(d_out)


def input_part(model: ModelConfig, module: str, shard: Shard) -> range:
    """The input features of `module` that a rank reads (its heads' or MLP share for o and down)."""
    d_in = model.module_shape(module)[0]
    return shard.part(d_in) if module in ROW_MODULES else range(d_in)


def lora_slice(model: ModelConfig, module: str, rank: int, shard: Shard) -> LoraSlice:
    """Which part of a rank-`rank` adapter's weights on `module` a rank holds (see the module docstring)."""
    r = padded_rank(rank, shard.size)
    if module in ROW_MODULES:
        hidden = model.module_shape(module)[1]
        return LoraSlice(r, range(r), input_part(model, module, shard), shard.part(hidden))
    return LoraSlice(r, shard.part(r), input_part(model, module, shard), output_part(model, module, shard))


def a_rank_divisor(module: str, shard: Shard) -> int:
    """A rank holds rank / this many of `module`'s A rank vectors (the shrink's share before its exchange)."""
    return 1 if module in ROW_MODULES else shard.size
