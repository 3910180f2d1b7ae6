"""Execute one step: kernel metadata from the plan's plain data, one forward pass, sampling.

The runner sees only `SeqChunk`s (token ids, positions, page tables, adapter slots, sampling
specs): never a `Request`, never the page allocator, and it changes no state but the pool tensor's
KV rows the forward pass writes. The metadata is built by `kernels.batch`, the same builder the
kernel tests use, into `StepBuffers` allocated once: every step refills the same storage, so each
metadata tensor the kernels read sits at the same address every step (what CUDA graphs need).

Each step, the runner first orders the sequences by adapter (`lora_order`, which the LoRA plan's
buckets rely on to be spans of the step), pads a decode-only step to its batch-size bucket when
asked (`DecodePadding`), then builds the step's tables and its one LoRA plan, which the backend
prepares once for every layer (`ReusePrepared` keeps a steady decode step from preparing again).
A decode step of a bucket with a captured graph (`capture_decode_graphs`, `worker.decode_graphs`)
stages its tables at the graph's fixed widths instead and replays the graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loraserve.kernels.backend import KernelBackend
from loraserve.kernels.batch import LoraGeometry, ReusePrepared, build_attention_batch, build_lora_plan, lora_order
from loraserve.kernels.metadata import AttentionBatch, LoraPlan
from loraserve.kernels.step_buffers import StepBuffers, StepCapacity
from loraserve.model_config import LORA_MODULES, ModelConfig
from loraserve.partition import a_rank_divisor, lora_slice
from loraserve.wire import TokenLogprob
from loraserve.worker.compiled_forward import CompiledForward
from loraserve.worker.config import EngineConfig
from loraserve.worker.decode_graphs import DecodeGraphs
from loraserve.worker.grammar import MaskComputer, unpack
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.logprobs import logprobs_from_logits, score_rows
from loraserve.worker.model import CausalLM, ForwardBatch
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.sampling import TokenMask, sample
from loraserve.worker.step_runner import RunnerOutput
from loraserve.worker.step_scheduler import SeqChunk
from loraserve.worker.tensor_parallel.collectives import Collectives


@dataclass(frozen=True)
class _Staged:
    """A step's tables, staged in the step buffers."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    last: torch.Tensor  # int64 [sampled sequences]: the token whose logits each uses
    attention: AttentionBatch
    lora: LoraPlan | None


def step_capacity(config: EngineConfig, layout: PoolLayout, model: ModelConfig, max_model_len: int) -> StepCapacity:
    """The step buffers' capacities, from the limits the engine enforces: the step scheduler's token
    budget and batch size, the context length every request is checked against, and the largest
    rank adapters are validated against."""
    largest_adapter = layout.adapter_layout(model, config.max_lora_rank, LORA_MODULES)
    return StepCapacity(
        max_tokens=config.max_batched_tokens,
        max_seqs=config.max_batch_size,
        max_seq_pages=min(layout.kv_pages_for(max_model_len), layout.num_pages),
        max_adapters=config.max_batch_size,
        max_adapter_pages=min(largest_adapter.num_pages, layout.num_pages),
        num_layers=layout.num_layers,
    )


@dataclass(frozen=True)
class DecodePadding:
    """Pads a decode-only step (every sequence one token) to the next of `buckets` sequences.

    A pad is a sequence of one token (id 0) at position 0 on `scratch_page`, a KV page the engine
    keeps aside: it writes and reads only that page, uses no adapter and is not sampled, so the
    real sequences compute what they would unpadded. Steps with a prefill chunk are not padded.
    """

    buckets: tuple[int, ...]  # ascending; the last is the largest step
    scratch_page: int

    def pad(self, batch: list[SeqChunk]) -> list[SeqChunk]:
        if not batch or any(len(c.token_ids) != 1 for c in batch):
            return batch
        target = next(b for b in self.buckets if b >= len(batch))
        return batch + [self.pad_sequence()] * (target - len(batch))

    def pad_sequence(self) -> SeqChunk:
        return SeqChunk("", [0], 0, [self.scratch_page], None, None)


def _copies_in_flight(batch: list[SeqChunk]) -> tuple[LayerProgress, ...]:
    """The background copies of the step's adapters that have not finished: the model waits per layer."""
    copies = {id(r): r for c in batch if (r := getattr(c.adapter, "ready", None)) is not None}  # AdapterSlot.ready
    return tuple(r for r in copies.values() if not r.done())


class ModelRunner:
    """The forward pass of one step over plain data, its metadata staged in buffers allocated once (a
    `step_runner.Runner`).

    `capacity` should come from `step_capacity(engine_config, ...)`; without it the buffers are
    sized for `EngineConfig()`'s defaults and the model's full context.
    """

    waits_per_layer = True  # an adapter still being copied in is waited for layer by layer, in the model

    def __init__(
        self,
        model: CausalLM,
        pool_tensor: torch.Tensor,
        layout: PoolLayout,
        backend: KernelBackend,
        capacity: StepCapacity | None = None,
        decode_padding: DecodePadding | None = None,
        tp: Collectives | None = None,
        compiled: bool = False,
    ):
        self.model, self.pool_tensor, self.layout, self.backend = model, pool_tensor, layout, backend
        # the forward pass: the model's, or its layers compiled (`worker/compiled_forward.py`)
        self.forward = CompiledForward(model) if compiled else model
        self.device = pool_tensor.device
        parts = [lora_slice(model.full_config, m, 1, layout.shard) for m in LORA_MODULES]  # this rank's widths
        self.geometry = LoraGeometry(
            tuple(len(p.a_inputs) for p in parts),
            tuple(len(p.b_outputs) for p in parts),
            layout.row_width,
            layout.rows_per_page,
            layout.num_layers,
            tuple(a_rank_divisor(m, layout.shard) for m in LORA_MODULES),
        )
        self.tp = tp
        if capacity is None:
            capacity = step_capacity(EngineConfig(), layout, model.full_config, model.config.max_position_embeddings)
        self.buffers = StepBuffers(capacity, self.device)
        self.decode_padding = decode_padding
        dtype = pool_tensor.dtype
        self._prepare = ReusePrepared(lambda plan: backend.prepare_lora(plan, dtype))
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        self.masks = MaskComputer(model.config.vocab_size)  # structured output's, during the forward pass
        self.host_seconds = 0.0  # cumulative: building each step's metadata and plan, before its forward pass

    @property
    def compiled(self) -> bool:
        return isinstance(self.forward, CompiledForward)

    @torch.inference_mode()
    def execute(self, batch: list[SeqChunk], kv_copies: list[tuple[int, int]] = ()) -> RunnerOutput:
        """One step over `batch`, after copying the KV pages `kv_copies` names ((source, destination):
        shared prefill, `step_scheduler`)."""
        started = time.perf_counter()
        if kv_copies:
            self._copy_kv_pages(kv_copies)
        order = lora_order(
            [None if c.adapter is None else id(c.adapter) for c in batch],
            [0 if c.adapter is None else c.adapter.rank for c in batch],
            [len(c.token_ids) for c in batch],
        )
        batch = [batch[i] for i in order]
        if self.decode_padding is not None:
            batch = self.decode_padding.pad(batch)
        graphed = (
            self.graphs is not None and self.graphs.covers(len(batch)) and all(len(c.token_ids) == 1 for c in batch)
        )
        step = self._stage(batch, graphed)
        self.host_seconds += time.perf_counter() - started
        sampling = [c for c in batch if c.sample is not None]
        guided = [i for i, c in enumerate(sampling) if c.sample.guide is not None]
        masks = self.masks.start([sampling[i].sample.guide for i in guided]) if guided else None
        copies = _copies_in_flight(batch)
        if graphed:
            for copy in copies:  # a graph replays every layer at once
                copy.wait_all()
            hidden = self.graphs.run(len(batch))
        else:
            forward = ForwardBatch(
                step.positions, step.attention, step.lora, self.pool_tensor, self.backend, copies, self.tp
            )
            hidden = self.forward(step.input_ids, forward)
        prompt_logprobs = self._score_prompts(batch, step, hidden)
        if not sampling:
            return RunnerOutput({}, prompt_logprobs=prompt_logprobs)
        logits = self.model.logits(hidden[step.last])
        specs = [c.sample for c in sampling]
        mask = None
        if masks is not None:
            mask = TokenMask(guided, unpack(self.masks.wait(masks), logits.shape[1], logits.device))
        tokens = sample(
            logits,
            [s.params for s in specs],
            [s.seed for s in specs],
            [(s.prompt_ids, s.output_ids) for s in specs],
            mask,
        )
        rows = [i for i, s in enumerate(specs) if s.params.logprobs is not None and tokens[i] is not None]
        entries = (
            logprobs_from_logits(logits[rows], [tokens[i] for i in rows], [specs[i].params.logprobs for i in rows])
            if rows
            else []
        )
        return RunnerOutput(
            {c.request_id: t for c, t in zip(sampling, tokens, strict=True)},
            {sampling[i].request_id: entry for i, entry in zip(rows, entries, strict=True)},
            prompt_logprobs,
        )

    def _copy_kv_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV pages, every layer: page p is rows [p·R, (p+1)·R) of the pool's second axis."""
        per_page = self.layout.rows_per_page
        offsets = torch.arange(per_page)
        sources = (torch.tensor([s for s, _ in copies]).unsqueeze(1) * per_page + offsets).flatten()
        targets = (torch.tensor([d for _, d in copies]).unsqueeze(1) * per_page + offsets).flatten()
        sources, targets = sources.to(self.device), targets.to(self.device)
        self.pool_tensor.index_copy_(1, targets, self.pool_tensor.index_select(1, sources))

    def _score_prompts(
        self, batch: list[SeqChunk], step: _Staged, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprob]]:
        """The log-probabilities of the prompt tokens each scoring chunk predicts."""
        scored = {}
        for i, chunk in enumerate(batch):
            if chunk.scoring is not None:
                first = step.attention.query_starts[i]
                rows = hidden[first : first + len(chunk.scoring.targets)]
                scored[chunk.request_id] = score_rows(self.model.logits, rows, chunk.scoring.targets, chunk.scoring.top)
        return scored

    def _stage(self, batch: list[SeqChunk], graphed: bool) -> _Staged:
        """Build the step's tables into the step buffers and upload them. `graphed`: at the widths a
        decode graph reads (`kernels.graph_tables`), with no LoRA preparation (a graph's launches
        were prepared at capture) and `token_adapter` written even when no token has an adapter."""
        buffers = self.buffers
        attention = build_attention_batch(
            [(c.kv_pages, c.start, len(c.token_ids)) for c in batch],
            self.layout.tokens_per_page,
            self.model.config.sliding_window,
            buffers,
            fixed_width=graphed,
        )
        lora = build_lora_plan(
            self.geometry,
            [(c.adapter, len(c.token_ids)) for c in batch],
            buffers,
            None if graphed else self._prepare,
            fixed_width=graphed,
            fuse_shrinks=not graphed,  # a graph's shrinks are one per module, for any adapter's rank
        )
        if lora is None and graphed:
            buffers.put("token_adapter", [-1] * len(batch))
        staged = _Staged(
            input_ids=buffers.put("input_ids", [t for c in batch for t in c.token_ids]),
            positions=buffers.put("positions", [p for c in batch for p in range(c.start, c.start + len(c.token_ids))]),
            last=buffers.put(
                "last", [attention.query_starts[i + 1] - 1 for i, c in enumerate(batch) if c.sample is not None]
            ),
            attention=attention,
            lora=lora,
        )
        buffers.upload()
        return staged

    def capture_decode_graphs(self, mode: str, max_rank: int) -> None:
        """Set up a decode graph for every padding bucket, largest first (`worker.decode_graphs`): each
        is first run on a step of that many pads, so its kernels are compiled before any capture."""
        if self.decode_padding is None:
            raise ValueError("decode graphs need decode steps padded to their buckets (DecodePadding)")
        self.graphs = None  # while capturing, every step runs eagerly
        graphs = DecodeGraphs(
            self.model,
            self.pool_tensor,
            self.backend,
            self.buffers,
            self.geometry,
            self.layout.tokens_per_page,
            max_rank,
            mode,
        )
        pad = self.decode_padding.pad_sequence()
        for size in sorted(self.decode_padding.buckets, reverse=True):
            self._stage([pad] * size, graphed=True)
            graphs.add(size)
        self.graphs = graphs
