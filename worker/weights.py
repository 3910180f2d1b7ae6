"""Read a Hugging Face checkpoint's tensors with safetensors (never unpickled)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraserve.errors import InvalidModelError
from loraserve.model_config import read_json_object

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: `model.safetensors`, or the shards its index names."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise InvalidModelError(f"{index} is not a safetensors index (needs a 'weight_map' of file names)")
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


@contextlib.contextmanager
def _opened(path: Path) -> Iterator:
    """One checkpoint file, open (`safe_open`); InvalidModelError naming it when it is not a safetensors file
    or cannot be read (its header, or a tensor's bytes, as they are read)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise InvalidModelError(f"{path} is not a readable safetensors file: {e}") from None


def tensor_sizes(model_dir: str | Path) -> Iterator[tuple[str, int]]:
    """(name, element count) for every tensor of the checkpoint, from the files' headers: nothing is loaded."""
    for path in checkpoint_files(model_dir):
        with _opened(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, math.prod(f.get_slice(name).get_shape())


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on CPU, in the file's dtype."""
    for path in checkpoint_files(model_dir):
        with _opened(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
