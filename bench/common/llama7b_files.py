"""Files at Llama-7B shapes without the weights: a config.json alone, and random fp16 PEFT adapters
for it (what fetch and load measurements, and the adapter validation tests, need)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.adapter_config import PARENT
from loraserve.model_config import ModelConfig

LLAMA_7B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "torch_dtype": "float16",
}


def write_model(directory: Path) -> ModelConfig:
    """`directory` with a Llama-7B-shaped config.json and nothing else; its ModelConfig."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA_7B, indent=1))
    return ModelConfig.from_dir(directory)


def write_adapter(directory: Path, model: ModelConfig, rank: int, modules: list[str], seed: int = 0) -> int:
    """A PEFT adapter with random fp16 weights; returns the size of its weights file."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module in modules:
            d_in, d_out = model.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=generator) * 0.01).half()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=generator) * 0.01).half()
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "adapter_model.safetensors")
    return (directory / "adapter_model.safetensors").stat().st_size
