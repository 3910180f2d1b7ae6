"""Per-request sampling: parameters (validated) and a batched sampler.

Penalties follow the usual definitions: repetition_penalty as in Hugging Face (positive logits of
tokens already in the prompt or output are divided by it, negative ones multiplied); presence and
frequency penalties as in OpenAI's API (subtracted, counting output tokens only). Then greedy
(temperature 0) or temperature → top-k → top-p → a draw from the request's own generator, so the
same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import math

import torch

from loraserve.params import SamplingParams

__all__ = ["SamplingParams", "sample"]


def _apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    history: list[tuple[list[int], list[int]]],
) -> None:
    vocab = logits.shape[1]
    for row in rows:
        p, (prompt, output) = params[row], history[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted({t for t in prompt + output if t < vocab}), dtype=torch.long, device=logits.device
            )
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, device=logits.device).clamp(max=vocab - 1), minlength=vocab)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], list[int]]],
) -> list[int | None]:
    """One token per row; None for a row whose numbers broke down, which raises nothing, so the
    other rows are sampled as if it were not there.

    A row breaks down when its logits are not all finite (NaN or ±inf: e.g. under a corrupt
    adapter) or when its probabilities are not a distribution (finite logits so large that
    logits / temperature overflows). Validation keeps sampling values where that cannot happen
    for sane logits; this is the guard for everything else, because torch.multinomial raises on
    such a row and would take the whole batch, and the worker, down with it.

    logits: float32 [N, vocab]; history[i] = (prompt ids, output ids so far).
    """
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        logits = logits.clone()
        _apply_penalties(logits, penalized, params, history)
    finite = torch.isfinite(logits).all(-1).tolist()
    tokens: list[int | None] = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if not finite[row]:
            tokens[row] = None
        elif not p.greedy:
            tokens[row] = _draw(logits[row], p, generators[row])
    return tokens


def _draw(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int | None:
    """A token drawn from one row's filtered distribution; None if it is not a distribution."""
    probs = torch.softmax(_filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p), -1)
    if not (torch.isfinite(probs).all() and probs.sum() > 0):
        return None
    if gen is not None and gen.device != probs.device:
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen).item())
