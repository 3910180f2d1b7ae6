"""lm-evaluation-harness against a real stack: the README's `lm_eval --model local-completions`
command line (its `lm_eval` CLI, `add_bos_token=True`) over the HTTP API, on two small local tasks
(no download) in place of the README's — a generate task, and a multiple-choice (loglikelihood)
task run with `--batch_size 4`, whose requests are batches of token-id prompts with `echo` and
`logprobs`.

The references are independent of loraserve: each choice's log-likelihood is transformers + peft's
log-softmax over the same tokens lm-eval sends (within 1e-4, float32), and the generate task's
target is the text the gRPC API generates greedily (itself token-exact with peft).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import hf_sequence_logits
from readme import README
from stack import http_stack

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.v1 import gateway_pb2

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

ADAPTER = "upper"
CHOICES = [  # (context, continuations): lm-eval scores each continuation after the context
    ("the quiet king", [" walked", " sang", " of the"]),
    ("a small river", [" runs", " is", " river"]),
    ("the old road", [" to the", " ends", " king"]),
    ("bright stars", [" shine", " fall", " and"]),
    ("once upon a time", [" there", " the", " a"]),
]
PROMPTS = ["the quiet king", "a small river", "the old road"]
NEW_TOKENS = 8
BASH_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
README_HTTP_ADDRESS = "127.0.0.1:8000"  # where the README's commands find the HTTP API (`loraserve up`'s)


@pytest.fixture(scope="module")
def stack():
    with http_stack() as stack:
        yield stack


def _loglikelihood(context: str, continuation: str) -> float:
    """transformers + peft: the continuation's log-likelihood after the context, tokenized as lm-eval
    does (the whole text with BOS, split where the context's tokens end)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    whole = tokenizer(context + continuation).input_ids
    start = len(tokenizer(context).input_ids)
    logprobs = torch.log_softmax(hf_sequence_logits(DEMO_MODEL_DIR, demo_adapters()[ADAPTER], whole), -1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


def _tasks(folder, generated: list[str]) -> None:
    """A multiple-choice task whose gold answer is the reference's most likely choice, and a generate
    task whose targets are the gRPC API's greedy texts."""
    rows = []
    for context, continuations in CHOICES:
        scores = [_loglikelihood(context, c) for c in continuations]
        rows.append({"context": context, "choices": continuations, "gold": scores.index(max(scores)), "scores": scores})
    (folder / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "generate.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in zip(PROMPTS, generated, strict=True))
    )
    dataset = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / "choice.yaml").write_text(
        "task: loraserve_choice\n"
        + dataset.format(folder / "choice.jsonl")
        + textwrap.dedent("""\
            output_type: multiple_choice
            doc_to_text: "{{context}}"
            doc_to_choice: "{{choices}}"
            doc_to_target: gold
            target_delimiter: ""
            metric_list:
              - metric: acc
            """)
    )
    (folder / "generate.yaml").write_text(
        "task: loraserve_generate\n"
        + dataset.format(folder / "generate.jsonl")
        + textwrap.dedent(f"""\
            output_type: generate_until
            doc_to_text: "{{{{prompt}}}}"
            doc_to_target: "{{{{target}}}}"
            target_delimiter: ""
            generation_kwargs:
              until: ["<never>"]
              max_gen_toks: {NEW_TOKENS}
              temperature: 0
            metric_list:
              - metric: exact_match
            """)
    )
    return rows


def _readme_command() -> list[str]:
    """The README's `lm_eval --model local-completions ...` command line, as a shell would split it."""
    blocks = [b for b in BASH_FENCE.findall(README.read_text()) if "--model local-completions" in b]
    assert len(blocks) == 1, f"expected one README bash block with lm_eval's local-completions, found {len(blocks)}"
    return shlex.split(blocks[0].replace("\\\n", ""))  # a shell drops each backslash-newline


def _flag(command: list[str], name: str) -> int:
    """Where `name`'s value is in `command`."""
    return command.index(name) + 1


def test_the_readmes_lm_eval_command_scores_and_generates_through_the_http_api(stack, tmp_path):
    """The README's command line, run as a user would (the `lm_eval` CLI, in a shell's argv), with the
    stack's port for 8000 and the test's two tasks for the README's: acc 1.0 on the choice task, every
    choice's log-likelihood the reference's, exact matches on the generate task."""
    generated = [
        stack.api.Generate(
            gateway_pb2.GenerateRequest(adapter=ADAPTER, text=p, max_new_tokens=NEW_TOKENS), timeout=60
        ).text
        for p in PROMPTS
    ]
    rows = _tasks(tmp_path, generated)
    command = _readme_command()
    assert command[:3] == ["lm_eval", "--model", "local-completions"], command
    model_args = dict(arg.split("=", 1) for arg in command[_flag(command, "--model_args")].split(","))
    assert model_args["add_bos_token"] == "True" and model_args["model"] == ADAPTER, model_args
    assert model_args["base_url"] == f"http://{README_HTTP_ADDRESS}/v1/completions", model_args
    command[0] = str(Path(sys.executable).with_name("lm_eval"))
    command[_flag(command, "--model_args")] = command[_flag(command, "--model_args")].replace(
        README_HTTP_ADDRESS, f"127.0.0.1:{stack.http_port}"
    )
    command[_flag(command, "--tasks")] = "loraserve_choice,loraserve_generate"
    command += ["--include_path", str(tmp_path), "--log_samples", "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # no download: local tasks, model
    # `tokenizer=demo/model`: the README's path, from the directory that holds demo/ (the checkout's root)
    ran = subprocess.run(
        command, cwd=DEMO_MODEL_DIR.parents[1], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert results["loraserve_choice"]["acc,none"] == 1.0
    assert results["loraserve_generate"]["exact_match,none"] == 1.0
    [samples_file] = (tmp_path / "out").rglob("samples_loraserve_choice_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(CHOICES)))
    for sample in samples:
        scored = [float(response[0][0]) for response in sample["resps"]]  # (log-likelihood, greedy) per choice
        assert scored == pytest.approx(rows[sample["doc_id"]]["scores"], abs=1e-4)
