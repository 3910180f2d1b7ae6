"""What the engine needs of a runner: the `Runner` protocol, and what a step returns (`RunnerOutput`).

Two runners satisfy it: the model runner (`worker/runner.py`: kernels, one forward pass, sampling) and the
emulated runner (`worker/emulated/runner.py`: a benchmark and test tool that waits each step's predicted
time and emits deterministic tokens). The engine is typed against `Runner` alone and never asks which one
it holds: where they differ, the runner says so (`waits_per_layer`, `graphs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loraserve.wire import TokenLogprob

if TYPE_CHECKING:
    from loraserve.worker.decode_graphs import DecodeGraphs
    from loraserve.worker.grammar import MaskComputer
    from loraserve.worker.step_scheduler import SeqChunk


@dataclass(frozen=True)
class RunnerOutput:
    """The token sampled for each sequence whose chunk asked for one (None: non-finite logits, see `sample`),
    with its log-probabilities when its sampling asked for them, and the log-probabilities of the prompt
    tokens each scoring chunk predicts (`worker/logprobs.py`)."""

    sampled: dict[str, int | None]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class Runner(Protocol):
    """Runs one step over the plan's plain data (`SeqChunk`s); changes no engine state."""

    # True: an adapter still being copied in is waited for layer by layer inside the step; False: the engine
    # waits for the whole copy before the step
    waits_per_layer: bool
    masks: MaskComputer  # structured output's token masks, computed while the step runs
    graphs: DecodeGraphs | None  # captured decode graphs (None: every step runs eagerly)
    host_seconds: float  # cumulative: the runner's own host work in its steps

    def execute(self, batch: list[SeqChunk], kv_copies: Sequence[tuple[int, int]] = ()) -> RunnerOutput:
        """One step over `batch`, after copying the KV pages `kv_copies` names ((source, destination))."""
        ...
