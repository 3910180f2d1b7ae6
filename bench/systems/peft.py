"""The Hugging Face PEFT baseline (S-LoRA §7.1): one PeftModel holding every adapter, one adapter per batch.

All the trace's adapters are loaded into one `PeftModel` (`load_adapter` with adapter names) before
the clock starts. Its best effort: the next batch is for the adapter whose oldest waiting request
arrived first, and takes as many of that adapter's queued requests as fit in `max_batch_size`;
`set_adapter` switches between batches. No continuous batching, no batching across adapters.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.base import LastRunStats, Replay, ReplayLimits, RequestRecord
from loraserve.bench.systems.hf_batching import load_base_model, serve_one_adapter_at_a_time, warm_up
from loraserve.bench.workloads.slora import Trace


@dataclass
class PeftSystem(LastRunStats):
    adapters: SyntheticAdapters
    adapter_dir: Path | None = None  # where adapter directories are written once (default: a temp dir)
    max_batch_size: int = 32
    limits: ReplayLimits = field(default_factory=ReplayLimits)
    name: str = "peft"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    _loaded: tuple = field(default=(), init=False, repr=False)  # (adapters, model) kept for the next trace

    def run(self, trace: Trace) -> list[RequestRecord]:
        """Loading many adapters into peft is slow (~0.2 s each at 100), so a model is reused by
        the next trace with the same adapters (the sweep over rates)."""
        if not self._loaded or self._loaded[0] != trace.adapters:
            self._loaded = ()
            with tempfile.TemporaryDirectory(prefix="loraserve-bench-") as tmp:
                self._loaded = (dict(trace.adapters), self._load(trace, self.adapter_dir or Path(tmp)))
        else:
            self._stats = {"setup_s": 0.0}
        return self._replay(self._loaded[1], trace)

    def _load(self, trace: Trace, root: Path):
        from peft import PeftModel

        start = time.perf_counter()
        model = None
        for name, rank in trace.adapters.items():
            path = self.adapters.write(name, rank, root)
            if model is None:
                model = PeftModel.from_pretrained(
                    load_base_model(self.adapters.model_dir, self.device, self.dtype), path, adapter_name=name
                )
            else:
                model.load_adapter(path, adapter_name=name)
        model.eval()
        warm_up(model)
        self._stats = {"setup_s": round(time.perf_counter() - start, 2)}
        return model

    def _replay(self, model, trace: Trace) -> list[RequestRecord]:
        replay = Replay(trace, self.name, self.limits)
        stats = serve_one_adapter_at_a_time(
            model, replay, self.max_batch_size, pick=lambda queues, _active: queues.oldest(), switch=model.set_adapter
        )
        self._stats |= stats
        return replay.results()
