"""Read a Hugging Face checkpoint's tensors with safetensors (never unpickled)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraserve.errors import InvalidModelError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards its index names."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidModelError(f"{index} is not a safetensors index (needs a 'weight_map'): {e}") from None
        shards = sorted({model_dir / name for name in weight_map.values()})
        for shard in shards:
            if shard.parent != model_dir or not shard.is_file():
                raise InvalidModelError(f"{index} names shard {shard.name!r}, which is not in {model_dir}")
        return shards
    if any(model_dir.glob("*.bin")):
        raise InvalidModelError(
            f"{model_dir} holds only PyTorch .bin weights; loraserve reads safetensors "
            "(convert with `model.save_pretrained(dir, safe_serialization=True)`)"
        )
    raise InvalidModelError(f"{model_dir} has no model.safetensors or {INDEX_FILE}")


def tensor_sizes(model_dir: str | Path) -> Iterator[tuple[str, int]]:
    """(name, element count) for every tensor of the checkpoint, from the files' headers: nothing is loaded."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, math.prod(f.get_slice(name).get_shape())


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on CPU, in the file's dtype."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
