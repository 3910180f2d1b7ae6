"""`loraserve bench --suite runner-profile --roofline h100-7b --out DIR`: a runner profile computed from a
GPU's roofline for a model's shapes, not measured.

    profile = roofline_profile(PRESETS["h100-7b"])
    profile.runner_s(step_features([(1, 1024, 0, None)] * 32))   # 32 decoding sequences at context 1024

Per step (`worker/step_roofline.py`): overhead + max(bytes / HBM bandwidth, flops / dense peak), where

    bytes = every weight but the embedding table, once (a lookup reads only the batch's rows)
          + Σ_sequences context_i · (K and V: 2 · layers · kv_heads · head_dim · dtype bytes)
          + Σ_distinct adapters rank · Σ_modules (in + out) · layers · dtype bytes      (LoRA A and B)
    flops = 2 · (the layers' matmul weights) · tokens
          + 2 · hidden · vocab · sequences                     (the LM head: one row per sequence)
          + 4 · heads · head_dim · layers · Σ attended keys    (QKᵀ and PV; causal: Q·s + Q(Q+1)/2 a chunk)
          + 2 · Σ_modules (in + out) · layers · Σ tokens_i · rank_i                           (LoRA)

The peaks are the spec sheet's (`GpuSpec`), the model's shapes its config.json's; activations'
bytes, norms' and activations' flops, KV writes and sampling are left out (small beside the weights'
bytes and the matmuls' flops at these shapes). A roofline is a lower bound: real kernels reach a fraction of both
peaks, and nothing here was run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from loraserve.bench.common.llama7b_files import LLAMA_7B
from loraserve.bench.common.synthetic_adapters import DEFAULT_TARGETS
from loraserve.model_config import ModelConfig
from loraserve.worker.runner_profile import RunnerProfile, model_shape
from loraserve.worker.step_costs import FEATURES, CostModel, step_features
from loraserve.worker.step_roofline import Roofline

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's peaks as its spec sheet gives them."""

    name: str
    bandwidth_bytes_s: float  # HBM bandwidth, bytes/s (decimal: 3.35 TB/s = 3.35e12)
    peak_flops_s: float  # dense (no 2:4 sparsity) tensor-core flop/s at the weights' dtype
    source: str  # where both peaks come from


H100_SXM = GpuSpec(
    "NVIDIA H100 SXM5 80 GB",
    3.35e12,
    989e12,
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: GPU memory bandwidth 3.35 TB/s; FP16 and "
    "BF16 Tensor Core 1,979 TFLOPS, a figure given with 2:4 sparsity, so 989 TFLOPS dense",
)


@dataclass(frozen=True)
class RooflineConfig:
    """What a roofline profile is computed from."""

    name: str
    model: ModelConfig
    gpu: GpuSpec
    model_name: str = ""
    dtype_bytes: int = 2  # fp16 weights, KV cache and adapters
    lora_modules: tuple[str, ...] = DEFAULT_TARGETS  # the modules the benchmarks' adapters adapt
    overhead_s: float = 0.0  # a fixed per-step cost: none assumed (see `ASSUMPTIONS`)
    assumptions: tuple[str, ...] = field(default_factory=tuple)


ASSUMPTIONS = (
    "fp16 weights, KV cache and LoRA A/B; one GPU, no tensor parallelism",
    "a step reads every weight but the embedding table once, every sequence's whole context of K and V, "
    "and the A and B of every distinct adapter in the batch once",
    "flops: 2 per weight per token through the layers, the LM head once per sequence, attention's QKᵀ "
    "and PV over the keys each token attends (causal), LoRA's A and B per token",
    "no per-step overhead (kernel launches, synchronisation): a CUDA-graph-captured step's are small "
    "beside a 7B model's 4 ms weight read, and the engine's own host work runs for real around the wait",
    "the spec sheet's peaks, reached: a lower bound on a real step",
    "LoRA on q_proj, k_proj, v_proj and o_proj (the benchmarks' synthetic adapters)",
)
PRESETS = {
    "h100-7b": RooflineConfig(
        "gpu-roofline-7b-h100",
        ModelConfig.from_hf(LLAMA_7B, source="Llama-2-7B shapes"),
        H100_SXM,
        model_name="Llama-2-7B (shapes: hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000)",
        assumptions=ASSUMPTIONS,
    ),
}
EXAMPLES = {  # steps whose computed times the profile records: name -> chunks (tokens, context, rank, adapter)
    "decode, 1 sequence at context 1024": [(1, 1024, 0, None)],
    "decode, 32 sequences at context 1024, 8 adapters of rank 16": [(1, 1024, 16, i % 8) for i in range(32)],
    "decode, 128 sequences at context 1024": [(1, 1024, 0, None)] * 128,
    "prefill, one 512-token prompt": [(512, 512, 0, None)],
    "prefill, four 512-token prompts, rank 64": [(512, 512, 64, i) for i in range(4)],
}


def weight_bytes(model: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of every weight a step reads: the layers' projections and norms, the final norm, the LM
    head (the embedding table's rows are looked up, not read whole)."""
    per_layer = sum(_params(model, m) for m in MODULES) + 2 * model.hidden_size
    return (model.num_layers * per_layer + model.hidden_size + model.hidden_size * model.vocab_size) * dtype_bytes


def roofline(config: RooflineConfig) -> Roofline:
    """The roofline of `config`'s model on its GPU (see the module docstring)."""
    m, b = config.model, config.dtype_bytes
    layer_matmul = sum(_params(m, name) for name in MODULES)
    lora_per_rank = sum(sum(m.module_shape(name)) for name in config.lora_modules) * m.num_layers
    return Roofline(
        bandwidth_bytes_s=config.gpu.bandwidth_bytes_s,
        peak_flops_s=config.gpu.peak_flops_s,
        bytes_per={
            "const": float(weight_bytes(m, b)),
            "context": float(2 * m.num_layers * m.kv_width * b),
            "adapter_rank": float(lora_per_rank * b),
        },
        flops_per={
            "tokens": float(2 * m.num_layers * layer_matmul),
            "seqs": float(2 * m.hidden_size * m.vocab_size),
            "attended": float(4 * m.q_width * m.num_layers),
            "token_rank": float(2 * lora_per_rank),
        },
        overhead_s=config.overhead_s,
        about={
            "kind": "roofline: computed from spec-sheet peaks, not measured",
            "name": config.name,
            "model": config.model_name,
            "device": config.gpu.name,
            "peaks_source": config.gpu.source,  # was "bandwidth_source" (Roofline.from_dict still reads it)
            "dtype_bytes": b,
            "lora_modules": list(config.lora_modules),
            "assumptions": list(config.assumptions),
        },
    )


def roofline_profile(config: RooflineConfig) -> RunnerProfile:
    """A runner profile whose steps take `config`'s roofline time; its whole-step costs are zeros (not
    modelled), and it records a few steps' computed times (`EXAMPLES`)."""
    line = roofline(config)
    zeros = tuple(0.0 for _ in FEATURES)
    costs = CostModel(zeros, (0.0, 0.0), (0.0, 0.0), {"source": "roofline: whole-step and adapter costs not modelled"})
    examples = {}
    for name, chunks in EXAMPLES.items():
        f = step_features(chunks)
        examples[name] = {
            "ms": round(line.step_s(f) * 1e3, 3),
            "memory_ms": round(line.bytes(f) / line.bandwidth_bytes_s * 1e3, 3),
            "compute_ms": round(line.flops(f) / line.peak_flops_s * 1e3, 3),
        }
    line = replace(line, about={**line.about, "examples": examples})
    return RunnerProfile(model_shape(config.model), zeros, costs, roofline=line)


def write_roofline_profile(preset: str, path: Path) -> RunnerProfile:
    """Compute `PRESETS[preset]`'s profile and write it to `path`."""
    profile = roofline_profile(PRESETS[preset])
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.write(path)
    return profile


def _params(model: ModelConfig, module: str) -> int:
    fan_in, fan_out = model.module_shape(module)
    return fan_in * fan_out
