"""Execute one step: build the flattened batch and its metadata, run the model, sample.

The runner is the only place that turns scheduler decisions (requests, token counts, page
tables) into device tensors.
"""

from __future__ import annotations

import torch

from loraserve.kernels.backend import KernelBackend
from loraserve.kernels.metadata import MODULES, AttentionBatch, LoraBatch
from loraserve.worker.adapter_cache import Resident
from loraserve.worker.model import CausalLM, ForwardBatch
from loraserve.worker.page_pool import PagePool
from loraserve.worker.pool_layout import PoolLayout, ceil_div
from loraserve.worker.request import Request
from loraserve.worker.sampling import sample


class ModelRunner:
    def __init__(self, model: CausalLM, pool: torch.Tensor, layout: PoolLayout, backend: KernelBackend):
        self.model, self.pool, self.layout, self.backend = model, pool, layout, backend
        self.device = pool.device
        config = model.config
        shapes = [config.module_shape(m) for m in MODULES]
        w = layout.row_width
        self._d_in = tuple(s[0] for s in shapes)
        self._d_out = tuple(s[1] for s in shapes)
        self._c_in = tuple(ceil_div(d, w) for d in self._d_in)
        self._c_out = tuple(ceil_div(d, w) for d in self._d_out)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], page_pool: PagePool, residents: dict
    ) -> dict[str, int | None]:
        """Run the step; returns the sampled token of every request whose known tokens are now all
        computed (None where its logits were not finite: see `sample`)."""
        ids: list[int] = []
        positions: list[int] = []
        for request, n in scheduled:
            ids += request.token_ids(request.num_computed, request.num_computed + n)
            positions += range(request.num_computed, request.num_computed + n)
        attention = self._attention_batch(scheduled, page_pool)
        lora = self._lora_batch(scheduled, residents, len(ids))
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attention=attention,
            lora=lora,
            pool=self.pool,
            backend=self.backend,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device), batch)
        for request, n in scheduled:
            request.num_computed += n
        sampling = [(i, r) for i, (r, _) in enumerate(scheduled) if r.num_computed == r.num_tokens]
        if not sampling:
            return {}
        last = torch.tensor([attention.query_starts[i + 1] - 1 for i, _ in sampling], device=self.device)
        logits = self.model.logits(hidden[last])
        requests = [r for _, r in sampling]
        tokens = sample(
            logits,
            [r.sampling for r in requests],
            [r.generator for r in requests],
            [(r.prompt_ids, r.output_ids) for r in requests],
        )
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def _attention_batch(self, scheduled: list[tuple[Request, int]], page_pool: PagePool) -> AttentionBatch:
        tp, rpp = self.layout.tokens_per_page, self.layout.rows_per_page
        query_start, context, tables, new_rows = [0], [], [], []
        for request, n in scheduled:
            table = page_pool.kv_page_table(request.request_id)
            start = request.num_computed
            query_start.append(query_start[-1] + n)
            context.append(start + n)
            tables.append(table)
            new_rows += [table[p // tp] * rpp + p % tp for p in range(start, start + n)]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        return AttentionBatch(
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_len=torch.tensor(context, dtype=torch.int32, device=device),
            page_table=torch.tensor(padded, dtype=torch.int32, device=device),
            new_rows=torch.tensor(new_rows, dtype=torch.int64, device=device),
            tokens_per_page=tp,
            max_query_len=max(n for _, n in scheduled),
            max_context_len=max(context),
            sliding_window=self.model.config.sliding_window,
            query_starts=query_start,
            query_lens=[n for _, n in scheduled],
            context_lens=context,
        )

    def _lora_batch(self, scheduled: list[tuple[Request, int]], residents: dict, num_tokens: int) -> LoraBatch | None:
        adapters: list[Resident] = []
        index: dict = {}
        segments: list[tuple[int, int, int]] = []
        token_adapter = [-1] * num_tokens
        start = 0
        for request, n in scheduled:
            if request.adapter is not None:
                a = index.get(request.adapter)
                if a is None:
                    a = index[request.adapter] = len(adapters)
                    adapters.append(residents[request.adapter])
                if segments and segments[-1][2] == a and segments[-1][0] + segments[-1][1] == start:
                    segments[-1] = (segments[-1][0], segments[-1][1] + n, a)
                else:
                    segments.append((start, n, a))
                token_adapter[start : start + n] = [a] * n
            start += n
        if not segments:
            return None
        a_offsets = [r.layout.a_offsets for r in adapters]
        b_offsets = [r.layout.b_offsets for r in adapters]
        layers = [r.layer_flags for r in adapters]
        max_pages = max(len(r.pages) for r in adapters)
        device = self.device

        def i32(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        page_table = torch.zeros(len(adapters), max_pages, dtype=torch.int32, device=device)
        for a, r in enumerate(adapters):
            page_table[a, : len(r.pages)] = r.pages
        return LoraBatch(
            seg_start=i32([s for s, _, _ in segments]),
            seg_len=i32([n for _, n, _ in segments]),
            seg_adapter=i32([a for _, _, a in segments]),
            token_adapter=i32(token_adapter),
            rank=i32([r.layout.rank for r in adapters]),
            scale=torch.tensor([r.scale for r in adapters], dtype=torch.float32, device=device),
            page_table=page_table,
            a_offset=i32(a_offsets),
            b_offset=i32(b_offsets),
            layer_active=i32(layers),
            c_in=self._c_in,
            c_out=self._c_out,
            d_in=self._d_in,
            d_out=self._d_out,
            rows_per_page=self.layout.rows_per_page,
            row_width=self.layout.row_width,
            max_rank=max(r.layout.rank for r in adapters),
            max_seg_len=max(n for _, n, _ in segments),
            segments=segments,
            ranks=[r.layout.rank for r in adapters],
            scales=[r.scale for r in adapters],
            a_offsets=a_offsets,
            b_offsets=b_offsets,
            layers_active=layers,
            row_index=[r.row_index for r in adapters],
        )
