"""Merge-and-swap (S-LoRA §7.5's ablation): one adapter merged into the base weights at a time.

A plain transformers model, no peft at run time. For every projection the active adapter targets,
W = W_base + scale · B A (lora_B [d_out, r] @ lora_A [r, d_in]), computed from the adapter's
tensors when it is switched in. Switching restores W_base in the old adapter's projections, then
merges the new one; the time it takes is measured. The model serves the merged adapter's queue in
static batches and switches when its queue is empty or another adapter's queue is longer (to the
adapter with the longest queue). No LoRA compute at run time: with one adapter it is the fastest
possible design, with many the switches and the small per-adapter batches cost it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.base import LastRunStats, Replay, ReplayLimits, RequestRecord
from loraserve.bench.systems.hf_batching import AdapterQueues, load_base_model, serve_one_adapter_at_a_time, warm_up
from loraserve.bench.workloads.slora import Trace

_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight$")


class MergedModel:
    """A transformers model whose weights hold base + at most one merged adapter."""

    def __init__(self, model):
        self.model = model
        self.modules = dict(model.named_modules())
        self.base: dict[str, torch.Tensor] = {}  # projection -> its base weight (saved on first merge)
        self.merged: tuple[str, ...] = ()  # projections the active adapter changed
        self.active: str | None = None

    @torch.no_grad()
    def switch(self, name: str, tensors: dict[str, torch.Tensor], scale: float) -> None:
        """Unmerge the active adapter, merge `tensors` (PEFT names) with `scale` = lora_alpha / r."""
        for module in self.merged:  # unmerge: back to the base weight
            self.modules[module].weight.copy_(self.base[module])
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, which = _TENSOR.match(key).groups()
            pairs.setdefault(module, {})[which] = tensor
        for module, ab in pairs.items():
            weight = self.modules[module].weight
            self.base.setdefault(module, weight.detach().clone())
            weight.add_(ab["B"].to(weight) @ ab["A"].to(weight), alpha=scale)
        self.merged, self.active = tuple(pairs), name


@dataclass
class MergeSwapSystem(LastRunStats):
    adapters: SyntheticAdapters
    max_batch_size: int = 32
    limits: ReplayLimits = field(default_factory=ReplayLimits)
    name: str = "merge-and-swap"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def run(self, trace: Trace) -> list[RequestRecord]:
        model = load_base_model(self.adapters.model_dir, self.device, self.dtype)
        warm_up(model)
        merged = MergedModel(model)
        # Adapters wait in host memory, as in S-LoRA; a switch only computes and adds B·A.
        host = {name: self.adapters.tensors(name, rank) for name, rank in trace.used_adapters().items()}
        scales = {name: self.adapters.config(rank)["lora_alpha"] / rank for name, rank in trace.adapters.items()}
        replay = Replay(trace, self.name, self.limits)

        def pick(queues: AdapterQueues, active: str | None) -> str:
            """Stay while the active adapter has work and no queue is longer; else the longest."""
            longest = queues.longest()
            return active if queues.length(active) and queues.length(longest) <= queues.length(active) else longest

        def switch(adapter: str) -> None:
            merged.switch(adapter, host[adapter], scales[adapter])

        self._stats = serve_one_adapter_at_a_time(model, replay, self.max_batch_size, pick, switch)
        return replay.results()
