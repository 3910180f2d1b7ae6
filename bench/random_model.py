"""Write a randomly initialised Llama checkpoint of a chosen size, for benchmarks only.

The embedded demo model (hidden 128, 4 layers) is so small that per-call overhead, not bytes,
bounds every step. Benchmarks that need a step dominated by weight traffic use a larger
model built here: Hugging Face format (config.json + model.safetensors) with the demo
tokenizer, so every system in `loraserve bench` loads it as-is. The weights are random
(seeded), so its text is noise; only its shapes and speed matter.

    python -m loraserve.bench.random_model /tmp/medium-llama          # ~92M parameters
    loraserve bench --model /tmp/medium-llama --n-adapters 100 --rates 30 --duration 15
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from loraserve.demo.assets import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_random_llama(
    out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int
) -> int:
    """Save the model to `out` (which must not exist yet); returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    demo = LlamaConfig.from_pretrained(DEMO_MODEL_DIR)
    config = LlamaConfig(
        vocab_size=demo.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=1024,
        bos_token_id=demo.bos_token_id,
        eos_token_id=demo.eos_token_id,
        pad_token_id=demo.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraserve.bench.random_model", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory to create (refused if it exists)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists; choose a new directory")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    n = write_random_llama(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        seed=args.seed,
    )
    print(f"wrote {args.out}: {n / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
