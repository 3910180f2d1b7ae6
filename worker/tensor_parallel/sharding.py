"""One rank's part of each checkpoint tensor, as `loraserve/partition.py` splits the network.

Column-parallel projections (q, k, v, gate, up) keep their rows of the rank's output features (and of
their bias); row-parallel ones (o, down) their columns of the rank's input features, and their bias on
rank 0 only (the all-reduce adds it once). Everything else is replicated.
"""

from __future__ import annotations

import torch

from loraserve.model_config import LORA_MODULES, ModelConfig
from loraserve.partition import ROW_MODULES, Shard, input_part, output_part


def shard_tensor(name: str, tensor: torch.Tensor, model: ModelConfig, shard: Shard) -> torch.Tensor:
    """`tensor` (named as in the checkpoint, at its full shape) as rank `shard` holds it."""
    if shard.size == 1:
        return tensor
    module = _projection(name)
    if module is None:
        return tensor
    if module in ROW_MODULES:
        if name.endswith(".bias"):
            return tensor if shard.index == 0 else torch.zeros_like(tensor)
        part = input_part(model, module, shard)
        return tensor[:, part.start : part.stop].contiguous()
    part = output_part(model, module, shard)
    return tensor[part.start : part.stop].contiguous()


def _projection(name: str) -> str | None:
    """The LoRA module a checkpoint tensor belongs to ("model.layers.0.mlp.down_proj.weight" -> down_proj)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-2] in LORA_MODULES and name.startswith("model.layers.") else None
