"""Synthetic PEFT adapters for a base model, in any number, without training.

Each adapter is a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) with random
small weights, a deterministic function of (seed, name, rank): the same adapter whatever system
loads it and however it is loaded — from bytes in memory (the engine), from a directory written
once to a cache (peft's load_adapter), or as raw tensors (merging).

    A = lora_A.weight [r, d_in] ~ N(0, std²)      B = lora_B.weight [d_out, r] ~ N(0, std²)
    scale = lora_alpha / r = 2
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from loraserve.adapter_config import PARENT
from loraserve.model_config import ModelConfig

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class SyntheticAdapters:
    model_dir: Path
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0
    std: float = 0.05
    dtype: torch.dtype = torch.float32  # of the saved tensors (float16 for GPU-sized benchmarks)

    @cached_property
    def model(self) -> ModelConfig:
        return ModelConfig.from_dir(self.model_dir)

    @cached_property
    def fingerprint(self) -> str:
        """Names the cache folder: changes with the base model's shape, the targets, the std, the seed."""
        key = f"{(Path(self.model_dir) / 'config.json').read_text()}/{self.target_modules}/{self.std}/{self.seed}"
        if self.dtype != torch.float32:
            key += f"/{self.dtype}"
        return f"{zlib.crc32(key.encode()):08x}"

    def config(self, rank: int) -> dict:
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": "loraserve-bench",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(self.target_modules),
            "use_rslora": False,
            "fan_in_fan_out": False,
            "inference_mode": True,
        }

    def tensors(self, name: str, rank: int) -> dict[str, torch.Tensor]:
        """PEFT-named tensors ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")."""
        model = self.model
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}/{rank}".encode()))
        out = {}
        for layer in range(model.num_layers):
            for module in self.target_modules:
                d_in, d_out = model.module_shape(module)
                prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
                out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) * self.std).to(self.dtype)
                out[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * self.std).to(self.dtype)
        return out

    def files(self, name: str, rank: int) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors) as bytes."""
        config = json.dumps(self.config(rank), indent=2, sort_keys=True).encode()
        return config, save_safetensors(self.tensors(name, rank))

    def write(self, name: str, rank: int, root: Path) -> Path:
        """The adapter as a directory under `root` (written once: an existing one is reused)."""
        path = Path(root) / self.fingerprint / f"{name}-r{rank}"
        if (path / "adapter_model.safetensors").is_file():
            return path
        config, weights = self.files(name, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))  # private to this writer
        (tmp / "adapter_config.json").write_bytes(config)
        (tmp / "adapter_model.safetensors").write_bytes(weights)
        if path.exists():  # a partial directory from an interrupted writer (complete ones returned above)
            shutil.rmtree(path, ignore_errors=True)
        try:
            tmp.replace(path)
        except OSError:  # another writer finished first: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
        return path
