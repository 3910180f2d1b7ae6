"""Builders for tiny real checkpoints and adapters (saved with transformers / peft) used as oracles."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loraserve.demo.assets import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Where tests that run Triton kernels put their tensors (the `kernel_device` fixture's params).
# conftest sets TRITON_INTERPRET=1 before triton is imported on machines without CUDA, so the
# kernels run in the interpreter on CPU tensors; with CUDA they are compiled for the GPU, which
# cannot read CPU tensors, and run on cuda. `pytest -m gpu` on a GPU machine is then the whole
# kernel suite on the GPU; `pytest` on CPU runs the cpu variants and skips the cuda ones.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not TRITON_INTERPRETED,
            reason="Triton compiles the kernels for the GPU here (CUDA present, TRITON_INTERPRET not 1) "
            "and compiled kernels cannot read CPU tensors; the cuda variant runs instead",
        ),
        id="cpu",
    ),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
]


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # llama | mistral | qwen2
    hidden: int = 64
    intermediate: int = 88  # not a multiple of the KV width: exercises padded row chunks
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    tie: bool = False
    rope_scaling: dict | None = None
    max_positions: int = 256
    seed: int = 0


def make_model(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """A random-weight HF checkpoint of `spec`'s architecture, with the demo tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[spec.arch]
    extra = {}
    if spec.rope_scaling is not None:
        extra["rope_scaling"] = spec.rope_scaling
    if spec.arch == "mistral":
        extra["sliding_window"] = None
    config = config_cls(
        vocab_size=1024,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **extra,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initializes with small std; larger weights give peakier, more distinct tokens
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL_DIR / name, path / name)
    return path


def make_adapter(
    model_path: Path,
    out: Path,
    r: int,
    target_modules: list[str] | str,
    lora_alpha: float = 16,
    use_rslora: bool = False,
    layers_to_transform: list[int] | None = None,
    seed: int = 1,
    std: float = 0.1,
) -> Path:
    """A PEFT adapter with random (non-zero) A and B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        layers_to_transform=layers_to_transform,
        init_lora_weights=False,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_greedy(model_path: Path, adapter_path: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (+ peft), the oracle for token-exact parity."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logits(model_path: Path, adapter_path: Path | None, prompt_ids: list[int]) -> torch.Tensor:
    """Last-position logits of the prompt (float32 [vocab])."""
    return hf_sequence_logits(model_path, adapter_path, prompt_ids)[-1]


def hf_sequence_logits(model_path: Path, adapter_path: Path | None, token_ids: list[int]) -> torch.Tensor:
    """The logits at every position of `token_ids` (float32 [len, vocab]): row i predicts token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def mixed_requests(count: int, adapters: list[str], new_tokens: int, seed_base: int):
    """`count` gRPC requests over `adapters` ("": the base model) and the held-out prompts: every other
    one greedy, the rest seeded sampling (seed `seed_base + i`), all ignoring EOS."""
    from loraserve.demo.corpus import HELD_OUT_PROMPTS
    from loraserve.v1 import common_pb2, gateway_pb2

    requests = []
    for i in range(count):
        sampling = common_pb2.SamplingParameters(ignore_eos=True)
        if i % 2:
            sampling.temperature, sampling.top_p, sampling.seed = 0.9, 0.95, seed_base + i
        requests.append(
            gateway_pb2.GenerateRequest(
                adapter=adapters[i % len(adapters)],
                text=HELD_OUT_PROMPTS[i % len(HELD_OUT_PROMPTS)],
                max_new_tokens=new_tokens,
                sampling=sampling,
            )
        )
    return requests
