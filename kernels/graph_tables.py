"""The step tables a captured decode step reads: fixed views of the step buffers, at fixed widths.

A CUDA graph replays the kernel launches it recorded, with the same grids, scalar arguments and
pointers; only the contents of memory may change between replays. A decode step of B sequences is
therefore captured over these views (built once per batch-size bucket B), and every step of that
size stages its real tables into the same storage at the same widths
(`build_lora_plan(..., fixed_width=True)`, `build_attention_batch(..., fixed_width=True)`) before
the graph is replayed.

What the launches may depend on is what these views fix: B, the capacity's table widths (the page
tables' row strides), the largest rank the engine accepts, and the longest context. The host values
of the returned objects describe that worst case, never a particular step, so that a backend's
per-step choices (block sizes, splits, grids) made from them hold for every step of the bucket.
"""

from __future__ import annotations

from loraserve.kernels.batch import LoraGeometry
from loraserve.kernels.metadata import AttentionBatch, LoraPlan, LoraTables
from loraserve.kernels.step_buffers import StepBuffers
from loraserve.model_config import LORA_GROUPS, LORA_MODULES


def graph_lora_plan(
    geometry: LoraGeometry, buffers: StepBuffers, num_tokens: int, groups: tuple[tuple[int, ...], ...] = LORA_GROUPS
) -> LoraPlan:
    """The LoRA plan a decode step of `num_tokens` one-token sequences is captured with. Its tables
    span the whole capacity: the kernels find each token's adapter through `token_adapter`, and the
    per-adapter rows they reach are the ones the step staged. It has no host values of its own (no
    segments, ranks or pages)."""
    c = buffers.capacity
    adapters, modules = c.max_adapters, len(LORA_MODULES)
    tables = LoraTables(
        seg_start=buffers.view("seg_start", (c.max_seqs,)),
        seg_len=buffers.view("seg_len", (c.max_seqs,)),
        seg_adapter=buffers.view("seg_adapter", (c.max_seqs,)),
        token_adapter=buffers.view("token_adapter", (num_tokens,)),
        rank=buffers.view("rank", (adapters,)),
        scale=buffers.view("scale", (adapters,)),
        page_table=buffers.view("lora_page_table", (adapters, c.max_adapter_pages)),
        a_offset=buffers.view("a_offset", (adapters, modules)),
        b_offset=buffers.view("b_offset", (adapters, modules)),
        layer_active=buffers.view("layer_active", (adapters, c.num_layers)),
        shrink_rank=buffers.view("shrink_rank", (adapters, modules)),
        shrink_a_offset=buffers.view("shrink_a_offset", (adapters, modules)),
        v_col=buffers.view("v_col", (adapters, modules)),
    )
    return LoraPlan(
        tables=tables,
        groups=groups,
        **geometry.plan_fields(),
        num_tokens=num_tokens,
        max_seg_len=1,
        segments=[],
        ranks=[],
        scales=[],
        a_offsets=[],
        b_offsets=[],
        layers_active=[],
        pages=[],
        shrinks=tuple((m,) for group in groups for m in group),  # as staged with fuse_shrinks=False
    )


def graph_attention_batch(
    buffers: StepBuffers, num_seqs: int, tokens_per_page: int, sliding_window: int | None
) -> AttentionBatch:
    """The attention batch a decode step of `num_seqs` one-token sequences is captured with: each
    sequence as long as the page table's capacity allows (what the decode split count is chosen
    for), its real length read from `context_len` when the graph replays."""
    c = buffers.capacity
    longest = c.max_seq_pages * tokens_per_page
    return AttentionBatch(
        query_start=buffers.view("query_start", (num_seqs + 1,)),
        context_len=buffers.view("context_len", (num_seqs,)),
        page_table=buffers.view("kv_page_table", (num_seqs, c.max_seq_pages)),
        new_rows=buffers.view("new_rows", (num_seqs,)),
        tokens_per_page=tokens_per_page,
        max_query_len=1,
        max_context_len=longest,
        sliding_window=sliding_window,
        query_starts=list(range(num_seqs + 1)),
        query_lens=[1] * num_seqs,
        context_lens=[longest] * num_seqs,
    )
