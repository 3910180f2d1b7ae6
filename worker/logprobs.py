"""Log-probabilities of tokens from the logits a step computed: the top-k asked for, nothing more.

A token's log-probability is the log-softmax of the model's logits at its position — after the
adapter, before penalties, temperature and top-k/top-p: the distribution the model gave, which is
what scoring a text needs (vLLM's default, `raw_logprobs`). Alongside it come the `top` most
likely tokens at that position, most likely first. Everything stays on the device but one
log-probability and `top` (id, log-probability) pairs per token: no full-vocabulary copy reaches
the host. Prompt tokens are scored `ROWS_PER_SLICE` positions at a time, so a long prefill chunk
never holds more than that many rows of vocabulary-wide logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve.wire import TokenLogprob

ROWS_PER_SLICE = 256
# Every value sent is finite (the wire refuses others): -inf (a token the logits rule out) and NaN
# (logits that broke down, which end the request anyway) become the lowest float32.
_FLOOR = torch.finfo(torch.float32).min


def logprobs_from_logits(logits: torch.Tensor, token_ids: list[int], top: list[int]) -> list[TokenLogprob]:
    """Row i: token_ids[i]'s log-probability under logits[i] and the row's top[i] most likely tokens.

    logits: float32 [N, vocab] on any device.
    """
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), -1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    values, indices = torch.topk(logprobs, min(max(top), logprobs.shape[-1]), dim=-1)
    # column 0: each row's token, then its top: one copy of values and one of ids to the host
    values = _finite(torch.cat([logprobs.gather(1, ids[:, None]), values], 1)).tolist()
    indices = indices.tolist()
    return [TokenLogprob(v[0], indices[i][: top[i]], v[1 : 1 + top[i]]) for i, v in enumerate(values)]


def score_rows(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, token_ids: list[int], top: int
) -> list[TokenLogprob]:
    """`logprobs_from_logits` for hidden states whose logits are not computed yet (a prompt's rows):
    `logits_of` maps [n, hidden] to float32 [n, vocab], called `ROWS_PER_SLICE` rows at a time."""
    out: list[TokenLogprob] = []
    for begin in range(0, len(token_ids), ROWS_PER_SLICE):
        end = min(begin + ROWS_PER_SLICE, len(token_ids))
        out += logprobs_from_logits(logits_of(hidden[begin:end]), token_ids[begin:end], [top] * (end - begin))
    return out


def _finite(values: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(values, nan=_FLOOR, neginf=_FLOOR, posinf=0.0)
