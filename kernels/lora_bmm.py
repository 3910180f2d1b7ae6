"""Batched LoRA by gather-then-bmm, padded to the batch's largest rank (S-LoRA-bmm, Punica's baseline).

    A_pad[a] = A of adapter a, zero-padded to [r_max, d_in];  B_pad[a] likewise [r_max, d_out]
    for each token t with adapter a = token_adapter[t] >= 0:
        y[t] += ((x[t] @ A_pad[a]^T) @ B_pad[a]) * scale[a]          (one bmm over all tokens)

Same result as `lora_apply_torch`; kept only so the benchmark can measure what padding and
per-token weight gathering cost against the segmented path. Shapes as in lora_torch.py.
"""

from __future__ import annotations

import torch

from loraserve.kernels.lora_torch import gather_lora_weights
from loraserve.kernels.metadata import LoraBatch


def lora_apply_bmm(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, batch: LoraBatch, layer: int, module: int
) -> None:
    active = [a for a in range(len(batch.ranks)) if batch.a_offsets[a][module] >= 0 and batch.layers_active[a][layer]]
    if not active:
        return
    r_max = max(batch.ranks[a] for a in active)
    d_in, d_out = batch.d_in[module], batch.d_out[module]
    a_pad = x.new_zeros(len(batch.ranks), r_max, d_in)
    b_pad = x.new_zeros(len(batch.ranks), r_max, d_out)
    scale = x.new_zeros(len(batch.ranks))
    for a in active:
        weights_a, weights_b = gather_lora_weights(pool_layer, batch, a, module)
        a_pad[a, : batch.ranks[a]], b_pad[a, : batch.ranks[a]] = weights_a, weights_b
        scale[a] = batch.scales[a]
    tokens = torch.nonzero(batch.token_adapter >= 0).squeeze(1)
    adapter = batch.token_adapter[tokens].long()
    shrunk = torch.bmm(x[tokens].unsqueeze(1), a_pad[adapter].transpose(1, 2))  # [n, 1, r_max]
    expanded = torch.bmm(shrunk, b_pad[adapter]).squeeze(1)  # [n, d_out]
    y.index_add_(0, tokens, expanded * scale[adapter, None])
