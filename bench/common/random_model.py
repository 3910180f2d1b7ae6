"""Write a randomly initialised Llama checkpoint of a chosen size, for benchmarks only.

The embedded demo model (hidden 128, 4 layers) is so small that per-call overhead, not bytes,
bounds every step. Benchmarks that need a step dominated by weight traffic use a larger
model built here: Hugging Face format (config.json, safetensors shards and their index) with the demo
tokenizer, so every system in `loraserve bench` loads it as-is. The weights are random
(seeded, N(0, 0.02²) as transformers initialises a Llama, norms 1), so its text is noise; only its
shapes and speed matter.

    python -m loraserve.bench.common.random_model /tmp/medium-llama          # ~92M parameters
    loraserve bench --model /tmp/medium-llama --n-adapters 100 --rates 30 --duration 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.config_cli import add_config_arguments, config_from_args, setting
from loraserve.demo.assets import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEMO_VOCAB = 1024  # the demo tokenizer's
RANDOM_POSITIONS = 1024  # the engine suites' random Llamas: prompts and outputs are short


@dataclass(frozen=True)
class LlamaShape:
    """The shapes of a Llama checkpoint (LLAMA_7B: Llama-2-7B's)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


LLAMA_7B = LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000)
RANDOM_MODELS = {  # the engine suites' random Llamas, by name
    "random-25m": LlamaShape(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=DEMO_VOCAB),
    "random-100m": LlamaShape(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab=DEMO_VOCAB),
}


def model_dir(name: str, cache: Path) -> Path:
    """The directory of model `name`: "demo", or one of RANDOM_MODELS, written under `cache` the first time."""
    if name == "demo":
        return DEMO_MODEL_DIR
    shape = RANDOM_MODELS[name]
    return write_once(cache / f"{name}-h{shape.hidden}-l{shape.layers}", shape, positions=RANDOM_POSITIONS)


def write_once(path: Path, shape: LlamaShape, **options) -> Path:
    """`path`, holding a random Llama of `shape` (`write_llama_checkpoint`'s `options`; float32 unless
    `dtype` says otherwise) written there unless it already is. Concurrent writers each write their own
    copy aside and move it into place: the first one's stays (the same model)."""
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        write_llama_checkpoint(aside / "model", shape, **{"dtype": torch.float32, **options})
        with contextlib.suppress(OSError):  # another writer finished first
            (aside / "model").replace(path)
        shutil.rmtree(aside, ignore_errors=True)
    return path


def write_llama_checkpoint(
    out: Path,
    shape: LlamaShape,
    *,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    std: float = 0.02,
    positions: int = 4096,
) -> int:
    """A random Llama checkpoint of `shape` written tensor by tensor (no transformers model is built,
    so a 7B checkpoint takes seconds, drawn on `device`): one safetensors shard per layer plus one
    for embeddings and head, an index, config.json and the demo tokenizer. Returns the bytes written.

    Weights ~ N(0, std²), norms 1. Token ids past the tokenizer's 1024 exist in the model (vocab
    `shape.vocab`) and decode to nothing; only shapes and speed matter here.
    """
    out.mkdir(parents=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * std).to(dtype).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(shape.hidden, dtype=dtype)

    weight_map: dict[str, str] = {}
    written = 0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal written
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        written += sum(t.numel() * t.element_size() for t in tensors.values())

    shard(
        "model-embed.safetensors",
        {
            "model.embed_tokens.weight": normal(shape.vocab, shape.hidden),
            "lm_head.weight": normal(shape.vocab, shape.hidden),
            "model.norm.weight": ones(),
        },
    )
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}"
        shard(
            f"model-layer-{layer:03d}.safetensors",
            {
                f"{prefix}.self_attn.q_proj.weight": normal(shape.hidden, shape.hidden),
                f"{prefix}.self_attn.k_proj.weight": normal(kv, shape.hidden),
                f"{prefix}.self_attn.v_proj.weight": normal(kv, shape.hidden),
                f"{prefix}.self_attn.o_proj.weight": normal(shape.hidden, shape.hidden),
                f"{prefix}.mlp.gate_proj.weight": normal(shape.intermediate, shape.hidden),
                f"{prefix}.mlp.up_proj.weight": normal(shape.intermediate, shape.hidden),
                f"{prefix}.mlp.down_proj.weight": normal(shape.hidden, shape.intermediate),
                f"{prefix}.input_layernorm.weight": ones(),
                f"{prefix}.post_attention_layernorm.weight": ones(),
            },
        )
    index = {"metadata": {"total_size": written}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    demo = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": demo.get("bos_token_id"),
        "eos_token_id": demo.get("eos_token_id"),
        "pad_token_id": demo.get("pad_token_id"),
        "loraserve_random_shape": asdict(shape),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return written


@dataclass(frozen=True)
class RandomModelSettings:
    """`python -m loraserve.bench.common.random_model`'s flags: where, and the model's shape."""

    out: Path = setting(help="directory to create (refused if it exists)", flag="out", parse=Path)
    hidden: int = setting(1024, "hidden size")
    layers: int = setting(8, "decoder layers")
    heads: int = setting(16, "attention heads")
    kv_heads: int = setting(4, "key/value heads")
    intermediate: int = setting(2816, "MLP intermediate size")
    seed: int = setting(0, "the weights' seed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loraserve.bench.common.random_model", description=__doc__.splitlines()[0]
    )
    add_config_arguments(p, RandomModelSettings)
    args = config_from_args(RandomModelSettings, p.parse_args(argv))
    if args.out.exists():
        p.error(f"{args.out} exists; choose a new directory")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    shape = LlamaShape(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, DEMO_VOCAB)
    write_llama_checkpoint(args.out, shape, dtype=torch.float32, seed=args.seed, positions=RANDOM_POSITIONS)
    print(f"wrote {args.out}: {shape.parameters / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
