"""A model directory's files that are not what they should be (not UTF-8, not JSON, not an object, a field
of the wrong type) are refused with an InvalidModelError naming the file and the field, by every reader
(the model's config, the tokenizer's special ids, the chat template, the checkpoint's index), and so is a
checkpoint that is not a safetensors file: never a traceback at a role's start. The CLI's half: a gateway
started on such a directory exits 1 with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidModelError
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.model_config import ModelConfig
from loraserve.tokenizer import Tokenizer
from loraserve.worker.weights import checkpoint_files, iter_tensors, tensor_sizes

CONFIG = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
NOT_OBJECTS = [(b"\xff\xfe{}", "is not UTF-8 text"), (b"{", "is not valid JSON"), (b"[]", "got an array"),
               (b"null", "got null"), (b'"llama"', "got a string"), (b"7", "got a number")]  # fmt: skip


@pytest.fixture
def model(tmp_path) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, directory)
    return directory


@pytest.mark.parametrize(("content", "problem"), NOT_OBJECTS)
@pytest.mark.parametrize(
    ("file", "read"),
    [
        ("config.json", ModelConfig.from_dir),
        ("generation_config.json", Tokenizer.from_model_dir),
        ("tokenizer_config.json", ChatTemplate.from_model_dir),
        ("chat_template.json", ChatTemplate.from_model_dir),
        ("model.safetensors.index.json", checkpoint_files),
    ],
)
def test_a_json_file_that_is_not_an_object_is_refused_naming_it(model, file, read, content, problem):
    if file.endswith("index.json"):
        (model / "model.safetensors").unlink()  # a sharded checkpoint: its index is read
    (model / file).write_bytes(content)
    with pytest.raises(InvalidModelError, match=rf"^{model / file} .*{problem}"):
        read(model)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rms_norm_eps", "1e-6", "rms_norm_eps: expected `float | null`, got `str`"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings: expected `bool | null`, got `str`"),
        ("max_position_embeddings", 2048.5, "max_position_embeddings: expected `int | null`, got `float`"),
        ("eos_token_id", "</s>", "eos_token_id: expected `int | array | null`, got `str`"),
        ("eos_token_id", [2, True], r"eos_token_id\[1\]: expected `int`, got `bool`"),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "rope_scaling: factor: expected `float | null`"),
        ("rope_parameters", [10000.0], "rope_parameters: expected `object | null`, got `array`"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_refused_naming_it(model, field, value, message):
    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}  # read before rope_scaling
    (model / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(InvalidModelError, match=rf"^{model / 'config.json'}: {message}"):
        ModelConfig.from_dir(model)


@pytest.mark.parametrize("value", ["</s>", [1, -2], 1.5])
def test_special_token_ids_of_the_wrong_type_are_refused(model, value):
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(InvalidModelError, match=r"generation_config.json: eos_token_id must be a token id"):
        Tokenizer.from_model_dir(model)


def test_a_chat_template_that_is_not_utf8_is_refused(model):
    (model / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    with pytest.raises(InvalidModelError, match=r"chat_template.jinja is not UTF-8 text"):
        ChatTemplate.from_model_dir(model)


def test_a_role_started_on_a_broken_model_directory_exits_with_one_line(model):
    (model / "config.json").write_bytes(b"[]")
    run = subprocess.run(
        [sys.executable, "-m", "loraserve.cli", "gateway", "--model", str(model), "--bind", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert f"{model / 'config.json'} must hold a JSON object, got an array" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.parametrize("content", [b"garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", b""])
def test_a_checkpoint_that_is_not_safetensors_is_refused_naming_it(model, content):
    (model / "model.safetensors").write_bytes(content)
    for read in (tensor_sizes, iter_tensors):
        with pytest.raises(InvalidModelError, match=rf"^{model / 'model.safetensors'} is not a readable safetensors"):
            list(read(model))
