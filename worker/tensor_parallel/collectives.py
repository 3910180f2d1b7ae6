"""The collectives one rank's forward pass makes, over `torch.distributed`, and the bytes they move.

The model calls `all_reduce` after each row-parallel projection (o, down: the partial sums of the base
model, with the LoRA terms' output slices added in) and `lora_apply` for every LoRA group, which
exchanges the shrink outputs between the ranks (`loraserve/partition.py`): the column groups' shares
are all-gathered, the row groups' partial sums all-reduced, each group in one collective for all of the
step's adapters.

Bytes are counted per rank as the ring algorithms move them (the S-LoRA paper's accounting): an
all-reduce of S bytes sends 2(N-1)S/N, an all-gather whose result is S bytes sends (N-1)S/N.

`LORASERVE_TP_LORA_COMM=off` (a benchmark's ablation, as in S-LoRA's figure 8; every rank must see it)
skips the LoRA exchanges: the shapes are kept, the outputs are wrong, the time is what the LoRA
communication costs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loraserve.kernels.lora_torch import lora_apply_torch_partitioned
from loraserve.kernels.metadata import LoraPlan
from loraserve.partition import Shard


@dataclass
class Traffic:
    """Bytes one rank sent, by whose computation needed them."""

    base: int = 0
    lora: int = 0
    collectives: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0})


class Collectives:
    """One rank's side of the forward pass's communication (see the module docstring)."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.traffic = Traffic()
        self.lora_comm = os.environ.get("LORASERVE_TP_LORA_COMM", "on") != "off"

    def hidden_part(self, hidden: int) -> slice:
        """The columns of a row-parallel output this rank adds its LoRA term to."""
        part = self.shard.part(hidden)
        return slice(part.start, part.stop)

    def all_reduce(self, t: torch.Tensor, lora: bool = False) -> torch.Tensor:
        """`t` summed over the ranks, in place."""
        dist.all_reduce(t)
        self._count(2 * (self.shard.size - 1) * t.numel() * t.element_size() // self.shard.size, lora, "all_reduce")
        return t

    def all_gather(self, t: torch.Tensor, lora: bool = True) -> torch.Tensor:
        """[N, *t.shape]: every rank's `t`, in rank order."""
        out = t.new_empty((self.shard.size, *t.shape))
        dist.all_gather(list(out.unbind(0)), t.contiguous())
        self._count((self.shard.size - 1) * t.numel() * t.element_size(), lora, "all_gather")
        return out

    def lora_apply(
        self,
        outputs: Sequence[torch.Tensor],
        x: torch.Tensor,
        pool_layer: torch.Tensor,
        plan: LoraPlan,
        layer: int,
        group: int,
    ) -> None:
        """The backend's `lora_apply` on this rank, its shrinks exchanged with the other ranks'."""
        lora_apply_torch_partitioned(outputs, x, pool_layer, plan, layer, group, self.exchange)

    def exchange(self, shrinks: list[torch.Tensor], column: bool) -> list[torch.Tensor]:
        """Each bucket's shrink [n, t, k, r'] (k modules) made whole as [n, t, k * r]: the ranks' shares of
        the rank vectors side by side, rank 0's first (column groups: r = N·r'), or the partial sums summed
        (row groups: r = r')."""
        if not self.lora_comm:
            return [v.repeat_interleave(self.shard.size if column else 1, dim=3).flatten(2) for v in shrinks]
        flat = torch.cat([v.reshape(-1) for v in shrinks])
        sizes = [v.numel() for v in shrinks]
        if not column:
            self.all_reduce(flat, lora=True)
            return [part.view(*v.shape[:2], -1) for part, v in zip(flat.split(sizes), shrinks, strict=True)]
        gathered = self.all_gather(flat)  # [N, total]
        whole = []
        for part, v in zip(gathered.split(sizes, dim=1), shrinks, strict=True):
            n, t, k, r = v.shape
            whole.append(part.view(-1, n, t, k, r).permute(1, 2, 3, 0, 4).reshape(n, t, -1))
        return whole

    def _count(self, nbytes: int, lora: bool, kind: str) -> None:
        if lora:
            self.traffic.lora += nbytes
        else:
            self.traffic.base += nbytes
        self.traffic.collectives[kind] += 1
