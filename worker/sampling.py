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
) -> list[int]:
    """One token per row. logits: float32 [N, vocab]; history[i] = (prompt ids, output ids so far)."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        logits = logits.clone()
        _apply_penalties(logits, penalized, params, history)
    tokens = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        filtered = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(filtered, -1)
        gen = generators[row]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
