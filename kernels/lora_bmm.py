"""Batched LoRA by gather-then-bmm, padded to the batch's largest rank (S-LoRA-bmm, Punica's baseline).

    A_pad[a] = A of adapter a, zero-padded to [r_max, d_in];  B_pad[a] likewise [r_max, d_out]
    for each token t with adapter a = token_adapter[t] >= 0:
        y[t] += ((x[t] @ A_pad[a]^T) @ B_pad[a]) * scale[a]          (one bmm over all tokens)

Same result as `lora_apply_torch`; kept only so the benchmark can measure what padding and
per-token weight gathering cost against the planned path. Shapes as in lora_torch.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraserve.kernels.batch import page_rows
from loraserve.kernels.metadata import LoraPlan


def prepare_lora_bmm(plan: LoraPlan, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per adapter: int64 physical row of each logical row, on the plan's device."""
    plan.check_pool_dtype_rows("torch-bmm")
    return [page_rows(pages, plan.rows_per_page).to(plan.tables.rank.device) for pages in plan.pages]


def _apply_module(
    y: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, plan: LoraPlan, layer: int, module: int
) -> None:
    active = [a for a in range(len(plan.ranks)) if plan.a_offsets[a][module] >= 0 and plan.layers_active[a][layer]]
    if not active:
        return
    r_max = max(plan.ranks[a] for a in active)
    d_in, d_out, w = plan.d_in[module], plan.d_out[module], plan.row_width
    c_in, c_out = plan.c_in[module], plan.c_out[module]
    a_pad = x.new_zeros(len(plan.ranks), r_max, d_in)
    b_pad = x.new_zeros(len(plan.ranks), r_max, d_out)
    scale = x.new_zeros(len(plan.ranks))
    for a in active:
        r, rows = plan.ranks[a], plan.prepared[a]
        a_off, b_off = plan.a_offsets[a][module], plan.b_offsets[a][module]
        a_pad[a, :r] = pool_layer.index_select(0, rows[a_off : a_off + r * c_in]).view(r, c_in * w)[:, :d_in]
        b_pad[a, :r] = pool_layer.index_select(0, rows[b_off : b_off + r * c_out]).view(r, c_out * w)[:, :d_out]
        scale[a] = plan.scales[a]
    tokens = torch.nonzero(plan.tables.token_adapter >= 0).squeeze(1)
    adapter = plan.tables.token_adapter[tokens].long()
    shrunk = torch.bmm(x[tokens].unsqueeze(1), a_pad[adapter].transpose(1, 2))  # [n, 1, r_max]
    expanded = torch.bmm(shrunk, b_pad[adapter]).squeeze(1)  # [n, d_out]
    y.index_add_(0, tokens, expanded * scale[adapter, None])


def lora_apply_bmm(
    outputs: Sequence[torch.Tensor], x: torch.Tensor, pool_layer: torch.Tensor, plan: LoraPlan, layer: int, group: int
) -> None:
    """The group's modules one after another (the baseline has no grouped path)."""
    for y, module in zip(outputs, plan.groups[group], strict=True):
        _apply_module(y, x, pool_layer, plan, layer, module)
