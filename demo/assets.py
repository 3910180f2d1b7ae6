"""Where the embedded demo lives: a small Llama trained on a made-up language, and LoRA adapters that restyle it.

`model/` is a Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json);
`adapters/<style>/` are PEFT adapters. `build.py` regenerates all of it; `styles.py` checks
mechanically which style a text is written in.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_ADAPTERS_DIR = DEMO_DIR / "adapters"


def demo_adapters() -> dict[str, Path]:
    """Adapter name -> directory, for every demo adapter."""
    if not DEMO_ADAPTERS_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(DEMO_ADAPTERS_DIR.iterdir()) if (p / "adapter_config.json").is_file()}
