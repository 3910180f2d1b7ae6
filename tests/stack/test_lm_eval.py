"""lm-evaluation-harness against a real stack: its `local-completions` model over the HTTP API, on
two small local tasks (no download) — a generate task, and a multiple-choice (loglikelihood) task
run with `--batch_size 4`, whose requests are batches of token-id prompts with `echo` and
`logprobs`.

The references are independent of loraserve: each choice's log-likelihood is transformers + peft's
log-softmax over the same tokens lm-eval sends (within 1e-4, float32), and the generate task's
target is the text the gRPC API generates greedily (itself token-exact with peft).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import hf_sequence_logits
from stack import LocalStack, free_port_block

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


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, http_bind=f"127.0.0.1:{port}")
    stack.http_port = port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


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


def test_lm_eval_scores_and_generates_through_the_http_api(stack, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # the stack is open; lm-eval sends a key all the same
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    generated = [
        stack.api.Generate(
            gateway_pb2.GenerateRequest(adapter=ADAPTER, text=p, max_new_tokens=NEW_TOKENS), timeout=60
        ).text
        for p in PROMPTS
    ]
    rows = _tasks(tmp_path, generated)
    results = simple_evaluate(
        model="local-completions",
        model_args={
            "model": ADAPTER,
            "base_url": f"http://127.0.0.1:{stack.http_port}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(DEMO_MODEL_DIR),
            "add_bos_token": True,
            "max_length": 512,
            "max_retries": 1,
        },
        tasks=["loraserve_choice", "loraserve_generate"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        batch_size=4,
        log_samples=True,
    )
    assert results["results"]["loraserve_choice"]["acc,none"] == 1.0
    assert results["results"]["loraserve_generate"]["exact_match,none"] == 1.0
    for sample in results["samples"]["loraserve_choice"]:
        scored = [loglikelihood for loglikelihood, _greedy in (r[0] for r in sample["resps"])]
        assert scored == pytest.approx(rows[sample["doc_id"]]["scores"], abs=1e-4)
