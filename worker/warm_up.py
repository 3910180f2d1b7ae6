"""Warm-up before a worker reports ready: every kernel variant compiled, then the decode graphs captured.

Triton compiles a kernel the first time it is launched with a new set of constexprs (block sizes);
on a GPU that is about a second per variant, which the first request of each rank or shape would
otherwise pay in its latency. The LoRA kernels' variants come from the rank block (a power of two
from 16 up to the largest rank the engine accepts), the path (token or segment) and the segment
path's tile height; attention's from decode or prefill, and split or not.

The warm-up runs dummy steps through the runner that cover them all: for each rank block, a decode
step (with a long context, so attention splits its keys) and prefill chunks of 2 and 33 tokens,
each with a *warm-up adapter* of that rank, and a prefill chunk with no adapter (a compiled forward
pass, `worker/compiled_forward.py`, has a graph with adapters and one without). Every page of that
adapter, and of those sequences, is the engine's scratch page (the one padded decode steps write to),
so the steps read whatever is there and write only there: they compute nothing anybody reads, touch
no real KV or adapter page, and sample nothing. Then the decode graphs are captured
(`ModelRunner.capture_decode_graphs`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from loraserve.kernels.batch import ceil_div
from loraserve.model_config import LORA_MODULES
from loraserve.worker.runner import ModelRunner
from loraserve.worker.step_scheduler import SeqChunk

log = logging.getLogger(__name__)

PREFILL_TOKENS = (2, 33)  # a segment of at most 16 tokens, and one of more (the two segment tile heights)


@dataclass(frozen=True)
class WarmUpAdapter:
    """A rank-`rank` adapter of every module as the kernels index it (`kernels.batch.PooledAdapter`),
    every one of its pages the scratch page."""

    rank: int
    pages: tuple[int, ...]
    a_offsets: tuple[int, ...]
    b_offsets: tuple[int, ...]
    layers: tuple[bool, ...]
    scale: float = 0.0
    row_dtype: None = None  # at the pool's dtype (the kernels' variants do not depend on it)


def rank_blocks(max_rank: int) -> list[int]:
    """The LoRA kernels' rank blocks up to `max_rank`: 16, 32, ... (powers of two)."""
    blocks = [16]
    while blocks[-1] < max_rank:
        blocks.append(2 * blocks[-1])
    return blocks


def warm_up(runner: ModelRunner, scratch_page: int, max_rank: int, graphs: str | None) -> float:
    """Run the dummy steps, then capture decode graphs in mode `graphs` (None: none); seconds taken."""
    started = time.perf_counter()
    layout, config, capacity = runner.layout, runner.model.full_config, runner.buffers.capacity
    tp = layout.tokens_per_page
    longest = min(capacity.max_seq_pages * tp, config.max_position_embeddings)

    def chunk(tokens: int, start: int, adapter: WarmUpAdapter | None) -> SeqChunk:
        return SeqChunk("", [0] * tokens, start, [scratch_page] * ceil_div(start + tokens, tp), adapter, None)

    for block in rank_blocks(max_rank):
        rank = min(block, max_rank)
        shape = layout.adapter_layout(config, rank, LORA_MODULES)
        if shape.num_pages > capacity.max_adapter_pages:  # on every module, this rank (and any larger) outgrows
            break  # the pool: an adapter of it on fewer modules compiles its kernel variants when first served
        adapter = WarmUpAdapter(
            rank,
            (scratch_page,) * shape.num_pages,
            tuple(shape.a_offsets),
            tuple(shape.b_offsets),
            (True,) * layout.num_layers,
        )
        runner.execute([chunk(1, longest - 1, adapter)])
        for tokens in PREFILL_TOKENS:
            if tokens <= capacity.max_tokens and ceil_div(tokens, tp) <= capacity.max_seq_pages:
                runner.execute([chunk(tokens, 0, adapter)])
    runner.execute([chunk(PREFILL_TOKENS[0], 0, None)])  # and none: a compiled forward pass has a graph without
    if graphs is not None:
        runner.capture_decode_graphs(graphs, max_rank)
    seconds = time.perf_counter() - started
    log.info(
        "warm-up: %s forward pass, kernels for rank blocks %s, decode graphs %s (%s), %.1f s",
        "compiled" if runner.compiled else "eager",
        rank_blocks(max_rank),
        runner.graphs.sizes() if runner.graphs else "none",
        graphs or "eager",
        seconds,
    )
    return seconds
