"""The emulated runner: `ModelRunner`'s interface with the forward pass replaced by a wait.

A benchmark and test tool (`--runner emulated`), never the default. The engine around it is the
real one — step scheduler, unified pool, adapter fetch and load, prefix cache, the worker service
and the wire — but no weights are loaded and nothing is computed: each step sleeps the time the
runner profile predicts for its composition (`worker/runner_profile.py`, measured on the real
engine), less what this runner spent on the step itself, and returns deterministic tokens
(`worker/emulated/tokens.py`). A sleeping process takes no CPU, so one machine runs a stack of
dozens of emulated workers whose steps take as long as real ones.

Everything a step's chunks ask for is honoured: sampling (greedy, seeded draws, penalties; through
the real sampler, on the pseudo-model's logits), structured-output masks (computed by the real
mask computer while the step waits), log-probabilities of the sampled tokens and of a scored
prompt. Shared prefill's KV page copies are skipped: the emulated pool's KV holds nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import torch

from loraserve.model_config import ModelConfig
from loraserve.tokenizer import Tokenizer
from loraserve.wire import AdapterKey, TokenLogprob
from loraserve.worker.emulated.tokens import PseudoModel, adapter_seed
from loraserve.worker.grammar import MaskComputer, unpack
from loraserve.worker.logprobs import logprobs_from_logits, score_rows
from loraserve.worker.runner_profile import RunnerProfile, load_profile
from loraserve.worker.sampling import TokenMask, sample
from loraserve.worker.step_costs import StepFeatures, step_features
from loraserve.worker.step_runner import RunnerOutput
from loraserve.worker.step_scheduler import SampleSpec, SeqChunk


def batch_features(batch: list[SeqChunk]) -> StepFeatures:
    """The cost model's features of a step (`worker/step_costs.py`)."""
    return step_features(
        [
            (len(c.token_ids), c.start + len(c.token_ids), 0 if c.adapter is None else c.adapter.rank, _key(c))
            for c in batch
        ]
    )


def _key(chunk: SeqChunk) -> AdapterKey | None:
    return None if chunk.adapter is None else chunk.adapter.key


class EmulatedRunner:
    """Waits each step's predicted time and emits deterministic tokens (see the module docstring); a
    `step_runner.Runner`."""

    waits_per_layer = False  # reads no adapter rows: the engine waits for a whole copy before the step

    def __init__(self, profile: RunnerProfile, model: PseudoModel):
        self.profile, self.model = profile, model
        self.masks = MaskComputer(model.vocab_size)  # structured output's, while the step waits
        self.graphs = None  # no CUDA graphs (the engine reads this for its reports)
        self.host_seconds = 0.0  # cumulative: this runner's own work in its steps (tokens, masks, scores)
        self.emulated_seconds = 0.0  # cumulative: the predicted step times it waited out
        self._seeds: dict[AdapterKey | None, int] = {}

    @classmethod
    def from_profile(cls, path: Path, model: ModelConfig, tokenizer: Tokenizer) -> EmulatedRunner:
        """The runner for `model` from the profile at `path` (InvalidConfigError if missing, malformed or
        measured on another model). Ids past the tokenizer's vocabulary count as special: never emitted."""
        profile = load_profile(path, model)
        special = tokenizer.special_ids() | frozenset(range(tokenizer.vocab_size, model.vocab_size))
        return cls(profile, PseudoModel(model.vocab_size, special))

    def execute(self, batch: list[SeqChunk], kv_copies: list[tuple[int, int]] = ()) -> RunnerOutput:
        """One step over `batch`: tokens at once, then a sleep until the predicted step time has passed.
        `kv_copies` are skipped (no KV content)."""
        started = time.perf_counter()
        predicted = self.profile.runner_s(batch_features(batch))
        sampling = [c for c in batch if c.sample is not None]
        guided = [i for i, c in enumerate(sampling) if c.sample.guide is not None]
        pending = self.masks.start([sampling[i].sample.guide for i in guided]) if guided else None
        prompt_logprobs = {c.request_id: self._score(c) for c in batch if c.scoring is not None}
        output = self._sample(sampling, guided, pending, prompt_logprobs)
        spent = time.perf_counter() - started
        self.host_seconds += spent
        self.emulated_seconds += predicted
        if predicted > spent:
            time.sleep(predicted - spent)
        return output

    def _seed(self, chunk: SeqChunk) -> int:
        key = _key(chunk)
        if key not in self._seeds:
            self._seeds[key] = adapter_seed("" if key is None else f"{key[0]}\0{key[1]}")
        return self._seeds[key]

    def _digest(self, chunk: SeqChunk, row: int) -> int:
        """The digest of the sequence up to and including the chunk's token `row`."""
        return self.model.digest(self._seed(chunk), chunk.start + row + 1, chunk.token_ids[row])

    def _sample(
        self,
        sampling: list[SeqChunk],
        guided: list[int],
        pending: Future[torch.Tensor] | None,
        scored: dict[str, list[TokenLogprob]],
    ) -> RunnerOutput:
        """The next token of each sampling chunk (`guided`: those with a grammar, whose masks are `pending`),
        with its log-probabilities when asked for, beside the prompts' `scored` ones."""
        digests = [self._digest(c, len(c.token_ids) - 1) for c in sampling]
        tokens: list[int | None] = [self.model.greedy(d) for d in digests]  # argmax, for the plain greedy rows
        full = [i for i, c in enumerate(sampling) if _needs_logits(c.sample)]
        logprobs: dict[str, TokenLogprob] = {}
        if full:
            logits = self.model.logits([digests[i] for i in full])  # [len(full), vocab]
            specs = [sampling[i].sample for i in full]
            mask = None
            if pending is not None:  # guided rows always have full logits
                allowed = unpack(self.masks.wait(pending), self.model.vocab_size, logits.device)
                row_of = {i: row for row, i in enumerate(full)}
                mask = TokenMask([row_of[i] for i in guided], allowed)
            drawn = sample(
                logits,
                [s.params for s in specs],
                [s.seed for s in specs],
                [(s.prompt_ids, s.output_ids) for s in specs],
                mask,
            )
            for i, token in zip(full, drawn, strict=True):
                tokens[i] = token
            rows = [j for j, s in enumerate(specs) if s.params.logprobs is not None and drawn[j] is not None]
            if rows:
                entries = logprobs_from_logits(
                    logits[rows], [drawn[j] for j in rows], [specs[j].params.logprobs for j in rows]
                )
                logprobs = {sampling[full[j]].request_id: e for j, e in zip(rows, entries, strict=True)}
        return RunnerOutput({c.request_id: t for c, t in zip(sampling, tokens, strict=True)}, logprobs, scored)

    def _score(self, chunk: SeqChunk) -> list[TokenLogprob]:
        """The log-probabilities of the prompt tokens this chunk predicts (row j predicts targets[j])."""
        targets = chunk.scoring.targets
        digests = torch.tensor([self._digest(chunk, j) for j in range(len(targets))], dtype=torch.long)
        return score_rows(lambda rows: self.model.logits(rows.tolist()), digests, targets, chunk.scoring.top)


def _needs_logits(spec: SampleSpec) -> bool:
    """Whether a row needs its full logits: anything but plain greedy (a draw, penalties, a mask, logprobs)."""
    p = spec.params
    return spec.guide is not None or not p.greedy or p.penalized or p.logprobs is not None
