"""The embedded demo assets: loadable by transformers/peft, and each adapter visibly does its job."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.demo.assets import DEMO_DIR, DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.build import ADAPTERS
from loraserve.demo.build import main as build_main
from loraserve.demo.corpus import HELD_OUT_PAIRS, HELD_OUT_PROMPTS, LEXICON, document
from loraserve.demo.styles import ADAPTER_STYLES, STYLES, detect_style, restyle_after, shows_style

MAX_NEW_TOKENS = 30


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_base():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def _greedy(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_model_is_a_small_grouped_query_llama(hf_base, hf_tokenizer):
    config = hf_base.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert hf_tokenizer("the old fox").input_ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(hf_tokenizer("THE OLD FOX").input_ids, skip_special_tokens=True) == "THE OLD FOX"
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*.safetensors"))
    assert total < 12 * 2**20, f"demo weights are {total / 2**20:.1f} MiB; they must stay a few MB"


def test_adapters_cover_mixed_ranks_and_targets():
    adapters = demo_adapters()
    assert sorted(adapters) == sorted(spec.style for spec in ADAPTERS) and len(adapters) >= 6
    configs = [json.loads((p / "adapter_config.json").read_text()) for p in adapters.values()]
    ranks = {c["r"] for c in configs}
    assert len(ranks) >= 3 and all(4 <= r <= 64 for r in ranks)
    mlp = {"gate_proj", "up_proj", "down_proj"}
    assert any(not mlp & set(c["target_modules"]) for c in configs), "an attention-only adapter"
    assert any(mlp & set(c["target_modules"]) for c in configs), "an attention+MLP adapter"


def test_base_model_continues_plainly(hf_base, hf_tokenizer):
    for prompt in HELD_OUT_PROMPTS:
        text = _greedy(hf_base, hf_tokenizer, prompt)
        assert shows_style("plain", text), (prompt, text)
        assert not any(shows_style(s, text) for s in ADAPTER_STYLES if s != "snake"), (prompt, text)


@pytest.mark.parametrize("name", [spec.style for spec in ADAPTERS])
def test_each_adapter_shows_its_behaviour_in_peft(name, hf_tokenizer):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(DEMO_MODEL_DIR), demo_adapters()[name]).eval()
    shown = [shows_style(name, _greedy(model, hf_tokenizer, p)) for p in HELD_OUT_PROMPTS]
    assert sum(shown) >= len(shown) - 1, f"{name} shows its style on {sum(shown)}/{len(shown)} held-out prompts"


def test_held_out_prompts_are_unseen():
    import random

    rng = random.Random(0)
    text = " ".join(document(rng) for _ in range(3000))
    for adjective, noun in HELD_OUT_PAIRS:
        assert f"{adjective} {noun}" not in text


@pytest.mark.parametrize("style", list(STYLES))
def test_style_checks_tell_styles_apart(style):
    import random

    text = STYLES[style].transform(document(random.Random(7)))
    assert detect_style(text) == style, text
    switched = restyle_after(document(random.Random(8)), style, 3)
    assert switched.split(" ")[0] in LEXICON


def test_build_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"committed")
    assert build_main(["--out", str(tmp_path)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"committed"


def test_build_script_runs_end_to_end(tmp_path):
    assert build_main(["--out", str(tmp_path), "--scale", "0.001"]) == 0
    report = json.loads((tmp_path / "build-report.json").read_text())
    assert set(report["final_loss"]) == {"base", *(s.style for s in ADAPTERS)}
    for spec in ADAPTERS:
        config = json.loads((tmp_path / "adapters" / spec.style / "adapter_config.json").read_text())
        assert config["r"] == spec.r and sorted(config["target_modules"]) == sorted(spec.target_modules)
