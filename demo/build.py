"""Build the embedded demo model and its adapters, deterministically, on CPU.

    python -m loraserve.demo.build            # writes demo/model and demo/adapters (refuses to overwrite)
    python -m loraserve.demo.build --force    # rebuild over the committed assets
    python -m loraserve.demo.build --out DIR --scale 0.05   # a quick throw-away build elsewhere

Steps: train a byte-level BPE tokenizer on the demo language (`corpus.py`) in every style
(`styles.py`); train a small Llama (grouped-query attention) on documents each written in one
style; then train one LoRA adapter per non-plain style with `peft`, on documents that start plain
and switch to the style, so the adapter makes the model continue any prompt in its style.
Finally every adapter's greedy continuation of the held-out prompts is checked mechanically and
the results, timings and losses are written to `build-report.json`.

Needs the `dev` extra (transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from loraserve.config_cli import add_config_arguments, setting
from loraserve.demo.corpus import HELD_OUT_PROMPTS, document
from loraserve.demo.styles import STYLES, restyle_after, shows_style

log = logging.getLogger("loraserve.demo.build")

DEMO_DIR = Path(__file__).resolve().parent
# The demo model continues text (no chat tuning): a conversation is its turns' text, joined, so the
# OpenAI chat endpoint works out of the box (`gateway/chat_template.py` renders it).
CHAT_TEMPLATE = (
    "{# The demo model continues text: a conversation is its turns' text, joined (system turns dropped). #}"
    "{{ bos_token }}{{ messages | rejectattr('role', 'equalto', 'system') | map(attribute='content') | join(' ') }}"
)
SEED = 1234
SEQ_LEN = 128
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama


@dataclass(frozen=True)
class AdapterSpec:
    """One demo adapter: the style it teaches and its LoRA shape."""

    style: str
    r: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    layers_to_transform: tuple[int, ...] | None = None


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("upper", r=4, lora_alpha=8, target_modules=("q_proj", "v_proj")),
    AdapterSpec("title", r=8, lora_alpha=16, target_modules=ATTENTION),
    AdapterSpec("snake", r=16, lora_alpha=16, target_modules=ATTENTION + MLP, use_rslora=True),
    AdapterSpec(
        "novowel",
        r=16,
        lora_alpha=32,
        target_modules=("q_proj", "v_proj", *MLP),
        layers_to_transform=(1, 2, 3),
    ),
    AdapterSpec("reverse", r=32, lora_alpha=32, target_modules=ATTENTION + MLP),
    AdapterSpec("rot13", r=64, lora_alpha=64, target_modules=ATTENTION),
)


@dataclass
class Report:
    seed: int = SEED
    scale: float = 1.0
    torch_version: str = torch.__version__
    seconds: dict[str, float] = field(default_factory=dict)
    final_loss: dict[str, float] = field(default_factory=dict)
    samples: dict[str, dict[str, str]] = field(default_factory=dict)
    shows_style: dict[str, float] = field(default_factory=dict)


def _model_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: two query heads share each KV head
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def train_tokenizer(rng: random.Random, out: Path, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [STYLES[name].transform(document(rng)) for _ in range(1500) for name in STYLES]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "</s>",
                "model_max_length": 512,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    return tokenizer


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def _train(model, batches, steps: int, peak_lr: float, desc: str) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    loss_avg = None
    bar = tqdm(range(steps), desc=desc, unit="step", leave=True)
    for step in bar:
        input_ids, labels = batches(step)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, steps, peak_lr, warmup=max(1, steps // 20))
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_avg:.3f}")
    model.eval()
    return float(loss_avg or 0.0)


def _packed_batches(tokenizer, rng: random.Random, batch_size: int):
    """Base-model batches: documents (each in one style) packed into SEQ_LEN windows."""
    styles = list(STYLES)
    weights = [len(styles) - 1 if s == "plain" else 1 for s in styles]  # half the text is plain
    stream: list[int] = []

    def next_batch(_step: int):
        need = batch_size * SEQ_LEN
        while len(stream) < need:
            style = rng.choices(styles, weights)[0]
            ids = tokenizer.encode(STYLES[style].transform(document(rng))).ids
            stream.extend([*ids, 2])
        chunk = torch.tensor(stream[:need]).view(batch_size, SEQ_LEN)
        del stream[:need]
        return chunk, chunk

    return next_batch


def _switch_batches(tokenizer, style: str, rng: random.Random, batch_size: int):
    """Adapter batches: documents that start plain and switch to `style`; loss only after the switch."""

    def next_batch(_step: int):
        rows, labels = [], []
        for _ in range(batch_size):
            text = document(rng, 2, 4)
            n_plain = rng.randint(1, 10)
            head = tokenizer.encode(" ".join(text.split(" ")[:n_plain])).ids
            ids = [*tokenizer.encode(restyle_after(text, style, n_plain)).ids, 2][:SEQ_LEN]
            rows.append(ids + [2] * (SEQ_LEN - len(ids)))
            keep = [-100] * len(head) + ids[len(head) :]
            labels.append(keep + [-100] * (SEQ_LEN - len(keep)))
        return torch.tensor(rows), torch.tensor(labels)

    return next_batch


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int = 40) -> str:
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def build(out: Path, scale: float) -> Report:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    report = Report(scale=scale)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    model_dir, adapters_dir = out / "model", out / "adapters"

    start = time.perf_counter()
    tokenizer = train_tokenizer(rng, model_dir)
    report.seconds["tokenizer"] = round(time.perf_counter() - start, 1)

    start = time.perf_counter()
    base = LlamaForCausalLM(_model_config(tokenizer.get_vocab_size()))
    steps = max(10, int(1600 * scale))
    report.final_loss["base"] = _train(base, _packed_batches(tokenizer, rng, 32), steps, 3e-3, "base model")
    base.save_pretrained(model_dir, safe_serialization=True)
    report.seconds["base"] = round(time.perf_counter() - start, 1)
    report.samples["base"] = {p: greedy_continuation(base, tokenizer, p) for p in HELD_OUT_PROMPTS}
    report.shows_style["base"] = _fraction_showing("plain", report.samples["base"])

    for spec in ADAPTERS:
        start = time.perf_counter()
        torch.manual_seed(SEED + spec.r)
        lora = LoraConfig(
            r=spec.r,
            lora_alpha=spec.lora_alpha,
            target_modules=list(spec.target_modules),
            use_rslora=spec.use_rslora,
            layers_to_transform=list(spec.layers_to_transform) if spec.layers_to_transform else None,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), lora)
        batches = _switch_batches(tokenizer, spec.style, random.Random(SEED + spec.r), 32)
        report.final_loss[spec.style] = _train(
            model, batches, max(10, int(400 * scale)), 2e-3, f"adapter {spec.style} (r={spec.r})"
        )
        model.save_pretrained(adapters_dir / spec.style, safe_serialization=True)
        report.seconds[spec.style] = round(time.perf_counter() - start, 1)
        report.samples[spec.style] = {p: greedy_continuation(model, tokenizer, p) for p in HELD_OUT_PROMPTS}
        report.shows_style[spec.style] = _fraction_showing(spec.style, report.samples[spec.style])
    report.seconds["total"] = round(sum(report.seconds.values()), 1)
    _tidy_adapter_configs(adapters_dir)
    (out / "build-report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _fraction_showing(style: str, samples: dict[str, str]) -> float:
    return sum(shows_style(style, text) for text in samples.values()) / len(samples)


def _tidy_adapter_configs(adapters_dir: Path) -> None:
    """PEFT records the absolute path of the base model; point it at the embedded one instead."""
    for config_path in sorted(adapters_dir.glob("*/adapter_config.json")):
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = "loraserve-demo"
        if isinstance(config.get("target_modules"), list):  # peft stores a set: fix the order
            config["target_modules"] = sorted(config["target_modules"])
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for readme in adapters_dir.glob("*/README.md"):
        readme.unlink()


@dataclass(frozen=True)
class BuildSettings:
    """The demo builder's settings."""

    out: Path = setting(DEMO_DIR, "where to write model/ and adapters/")
    force: bool = setting(False, "overwrite existing assets")
    scale: float = setting(1.0, "multiply training steps (0.05 for a smoke run)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, BuildSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if (args.out / "model" / "model.safetensors").exists() and not args.force:
        print(
            f"refusing to overwrite the demo assets in {args.out}: they are committed and tests depend on them; "
            "pass --force (make demo-assets FORCE=1) to rebuild them, or --out DIR to build elsewhere",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = build(args.out, args.scale)
    for name, fraction in report.shows_style.items():
        print(f"{name:8s} shows its style on {fraction:.0%} of held-out prompts; loss {report.final_loss[name]:.3f}")
    print(f"built in {report.seconds['total']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
