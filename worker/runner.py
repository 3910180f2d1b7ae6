"""Execute one step: kernel metadata from the plan's plain data, one forward pass, sampling.

The runner sees only `SeqChunk`s (token ids, positions, page tables, adapter slots, sampling
specs): never a `Request`, never the page allocator, and it changes no state but the pool tensor's
KV rows the forward pass writes. The metadata is built by `kernels.batch`, the same builder the
kernel tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.kernels.backend import KernelBackend
from loraserve.kernels.batch import LoraGeometry, build_attention_batch, build_lora_batch
from loraserve.kernels.metadata import MODULES
from loraserve.worker.model import CausalLM, ForwardBatch
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.sampling import sample
from loraserve.worker.step_scheduler import SeqChunk


@dataclass(frozen=True)
class RunnerOutput:
    """The token sampled for each sequence whose chunk asked for one (None: non-finite logits, see `sample`)."""

    sampled: dict[str, int | None]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: torch.Tensor, layout: PoolLayout, backend: KernelBackend):
        self.model, self.pool, self.layout, self.backend = model, pool, layout, backend
        self.device = pool.device
        shapes = [model.config.module_shape(m) for m in MODULES]
        self.geometry = LoraGeometry(
            tuple(d_in for d_in, _ in shapes),
            tuple(d_out for _, d_out in shapes),
            layout.row_width,
            layout.rows_per_page,
            layout.num_layers,
        )

    @torch.inference_mode()
    def execute(self, batch: list[SeqChunk]) -> RunnerOutput:
        ids = [t for chunk in batch for t in chunk.token_ids]
        positions = [p for c in batch for p in range(c.start, c.start + len(c.token_ids))]
        attention = build_attention_batch(
            [(c.kv_pages, c.start, len(c.token_ids)) for c in batch],
            self.layout.tokens_per_page,
            self.model.config.sliding_window,
            self.device,
        )
        forward = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attention=attention,
            lora=build_lora_batch(self.geometry, [(c.adapter, len(c.token_ids)) for c in batch], self.device),
            pool=self.pool,
            backend=self.backend,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device), forward)
        sampling = [(i, c) for i, c in enumerate(batch) if c.sample is not None]
        if not sampling:
            return RunnerOutput({})
        last = torch.tensor([attention.query_starts[i + 1] - 1 for i, _ in sampling], device=self.device)
        logits = self.model.logits(hidden[last])
        specs = [c.sample for _, c in sampling]
        tokens = sample(
            logits,
            [s.params for s in specs],
            [s.seed for s in specs],
            [(s.prompt_ids, s.output_ids) for s in specs],
        )
        return RunnerOutput({c.request_id: t for (_, c), t in zip(sampling, tokens, strict=True)})
