"""Per-request sampling: parameters (validated) and a batched sampler.

Penalties follow the usual definitions: repetition_penalty as in Hugging Face (positive logits of
tokens already in the prompt or output are divided by it, negative ones multiplied); presence and
frequency penalties as in OpenAI's API (subtracted, counting output tokens only). Then greedy
(temperature 0) or temperature → top-k → top-p → min-p → a draw. Min-p (as vLLM) drops the tokens
whose probability is below min_p times the most likely token's.

A guided row (structured output, `worker/grammar.py`) comes with the tokens its grammar allows
(`TokenMask`): the others get -inf after the penalties, before greedy or the draw, so both choose
among allowed tokens only.

Each draw is keyed by (the request's seed, the position of the token drawn): its random number
comes from a generator seeded with a mix of the two, not from a stream the request carries. So
the same seed gives the same tokens whatever else shares the batch, and a request continued
elsewhere from a prefix of its output (a failover, a preemption) draws exactly what it would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraserve.params import SamplingParams

__all__ = ["SamplingParams", "TokenMask", "sample"]


@dataclass(frozen=True)
class TokenMask:
    """The tokens allowed at some rows: allowed[i] (bool [vocab]) is row rows[i]'s."""

    rows: list[int]
    allowed: torch.Tensor


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


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    if min_p > 0.0:  # p / p_max < min_p  <=>  logit < max logit + ln(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), -math.inf)
    return logits


def draw_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for the token at `position` of a request seeded `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


_MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    history: list[tuple[list[int], list[int]]],
    mask: TokenMask | None = None,
) -> list[int | None]:
    """One token per row; None for a row whose numbers broke down, which raises nothing, so the
    other rows are sampled as if it were not there. `mask`: the tokens guided rows may take.

    A row breaks down when its logits are not all finite (NaN or ±inf: e.g. under a corrupt
    adapter) or when its probabilities are not a distribution (finite logits so large that
    logits / temperature overflows). Validation keeps sampling values where that cannot happen
    for sane logits; this is the guard for everything else, because torch.multinomial raises on
    such a row and would take the whole batch, and the worker, down with it.

    logits: float32 [N, vocab]; seeds[i]: row i's request seed; history[i] = (prompt ids, output
    ids so far), whose total length is the position of the token drawn.
    """
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized or mask is not None:
        logits = logits.clone()
    if penalized:
        _apply_penalties(logits, penalized, params, history)
    finite = torch.isfinite(logits).all(-1)
    if mask is not None:
        rows = torch.tensor(mask.rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~mask.allowed, -math.inf)
        finite[rows] &= mask.allowed.any(-1)  # a grammar that allows nothing: no token can be chosen
    finite = finite.tolist()
    tokens: list[int | None] = logits.argmax(-1).tolist()
    for row, p in enumerate(params):
        if not finite[row]:
            tokens[row] = None
        elif not p.greedy:
            position = len(history[row][0]) + len(history[row][1])
            tokens[row] = _draw(logits[row], p, draw_seed(seeds[row], position))
    return tokens


def _draw(logits: torch.Tensor, p: SamplingParams, seed: int) -> int | None:
    """A token drawn from one row's filtered distribution; None if it is not a distribution."""
    probs = torch.softmax(_filter(logits / p.temperature, p.top_k, p.top_p, p.min_p), -1)
    if not (torch.isfinite(probs).all() and probs.sum() > 0):
        return None
    generator = torch.Generator(device="cpu").manual_seed(seed)  # on the CPU: the same draw on any device
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
