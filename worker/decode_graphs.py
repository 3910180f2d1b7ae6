"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at warm-up.

At small batches a decode step's host work (Python and hundreds of kernel launches: a 7B model with
LoRA makes 224 LoRA launches alone) takes longer than its GPU work. A CUDA graph records a step's
launches once and replays them in one call. Replay repeats the recorded grids, scalar arguments and
pointers exactly, so a captured step reads every per-step value from memory: the step buffers'
fixed views at fixed widths (`kernels.graph_tables`), which each step of the bucket's size fills
before the replay (the runner stages them with `fixed_width=True`), and the Triton backend's
step-independent LoRA launches (`KernelBackend.prepare_lora_graph`). Decode steps are padded to the
buckets (`runner.DecodePadding`), so every decode step has a graph; steps with a prefill chunk run
eagerly.

Modes:
    "capture"     CUDA: each bucket's forward pass is run once eagerly (which compiles its kernel
                  variants), then captured; each step replays its bucket's graph.
    "uncaptured"  any device: each step calls its bucket's forward pass over the same fixed views,
                  with the same launches, instead of replaying it. This is what a machine without a
                  GPU can check of the captured path (tests compare it token for token with the
                  eager one under the Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.kernels.backend import KernelBackend
from loraserve.kernels.batch import LoraGeometry
from loraserve.kernels.graph_tables import graph_attention_batch, graph_lora_plan
from loraserve.kernels.step_buffers import StepBuffers
from loraserve.worker.model import CausalLM, ForwardBatch

MODES = ("capture", "uncaptured")


@dataclass
class _Bucket:
    forward: Callable[[], torch.Tensor]  # the model over the bucket's fixed views -> hidden [B, hidden]
    graph: torch.cuda.CUDAGraph | None  # None when uncaptured
    hidden: torch.Tensor  # the captured forward's output, which each replay overwrites


class DecodeGraphs:
    """The decode forward pass of each batch-size bucket, over the runner's step buffers."""

    def __init__(
        self,
        model: CausalLM,
        pool_tensor: torch.Tensor,
        backend: KernelBackend,
        buffers: StepBuffers,
        geometry: LoraGeometry,
        tokens_per_page: int,
        max_rank: int,
        mode: str,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown decode graph mode {mode!r}; choose one of {', '.join(MODES)}")
        if backend.prepare_lora_graph is None:
            raise ValueError(f"the {backend.name} kernel backend cannot be captured in a graph (use triton)")
        if mode == "capture" and pool_tensor.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool_tensor.device}")
        self.model, self.pool_tensor, self.backend, self.buffers = model, pool_tensor, backend, buffers
        self.geometry, self.tokens_per_page, self.max_rank, self.mode = geometry, tokens_per_page, max_rank, mode
        self._buckets: dict[int, _Bucket] = {}
        self._memory_pool = None  # shared by every bucket's graph (captured largest first)

    def sizes(self) -> list[int]:
        return sorted(self._buckets)

    def covers(self, num_seqs: int) -> bool:
        return num_seqs in self._buckets

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        buffers = self.buffers
        ids = buffers.view("input_ids", (size,))
        attention = graph_attention_batch(buffers, size, self.tokens_per_page, self.model.config.sliding_window)
        lora = graph_lora_plan(self.geometry, buffers, size)
        lora.prepared = self.backend.prepare_lora_graph(lora, self.pool_tensor.dtype, self.max_rank)
        batch = ForwardBatch(buffers.view("positions", (size,)), attention, lora, self.pool_tensor, self.backend)
        return lambda: self.model(ids, batch)

    @torch.inference_mode()
    def add(self, size: int) -> None:
        """Make bucket `size` ready. The step buffers must hold a valid decode step of `size`
        sequences (staged and uploaded), which the forward pass computes once eagerly: that compiles
        its kernel variants and settles its host-side choices before any capture."""
        forward = self._forward(size)
        hidden = forward()
        graph = None
        if self.mode == "capture":
            torch.cuda.synchronize(self.pool_tensor.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool):
                hidden = forward()
            self._memory_pool = graph.pool()
            torch.cuda.synchronize(self.pool_tensor.device)
        self._buckets[size] = _Bucket(forward, graph, hidden)

    def run(self, size: int) -> torch.Tensor:
        """hidden [size, hidden] of the decode step staged in the step buffers."""
        bucket = self._buckets[size]
        if bucket.graph is None:
            return bucket.forward()
        bucket.graph.replay()
        return bucket.hidden
