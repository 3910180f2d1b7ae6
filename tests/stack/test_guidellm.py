"""guidellm against a real stack, as its users run it: the `guidellm run` CLI with its defaults (chat
completions, streamed, `stream_options: {"include_usage": true, "continuous_usage_stats": true}` on
every request), offline (the demo model's tokenizer, synthetic prompts), and its OpenAI HTTP backend
and response parser sending one streamed request. guidellm counts tokens from the usage the gateway
reports, so the report's token counts are the gateway's: checked here against the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from stack import http_stack

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
pytest.importorskip("guidellm")

REQUESTS = 4
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8
PROMPT = "the quiet king"
ADAPTER = "upper"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def stack():
    with http_stack() as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_guidellm_run_benchmarks_the_stack_with_no_errors_and_the_gateways_token_counts(stack, tokenizer, tmp_path):
    """`guidellm run` (synchronous, REQUESTS synthetic requests) completes every request: none errored or
    incomplete, each with OUTPUT_TOKENS output tokens (guidellm sends `ignore_eos`) and as many prompt
    tokens as the tokenizer counts in its prompt, all read from the gateway's streamed usage."""
    report = tmp_path / "benchmarks.json"
    command = [str(Path(sys.executable).with_name("guidellm")), "run"]
    command += ["--backend", f"kind=openai_http,target=http://127.0.0.1:{stack.http_port}"]
    command += ["--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}"]
    command += ["--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"]
    command += ["--tokenizer", f"kind=huggingface_auto,model={DEMO_MODEL_DIR}"]  # the served model's: no download
    command += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, **OFFLINE, "GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp_path)}
    ran = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    successful = benchmark["requests"]["successful"]
    assert len(successful) == REQUESTS
    for request in successful:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] is True and body["stream_options"]["continuous_usage_stats"] is True
        [message] = body["messages"]
        prompt = " ".join(part["text"] for part in message["content"])
        assert request["input_metrics"]["text_tokens"] == len(tokenizer(prompt).input_ids)  # BOS and the text
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["output"] and request["info"]["error"] is None
    tokens = benchmark["metrics"]["text"]["tokens"]
    assert tokens["output"]["successful"]["total_sum"] == REQUESTS * OUTPUT_TOKENS
    assert tokens["input"]["successful"]["total_sum"] == sum(r["input_metrics"]["text_tokens"] for r in successful)


def test_guidellms_http_backend_reads_one_streamed_requests_usage(stack, tokenizer):
    """guidellm's OpenAIHTTPBackend, started and validated (`/health`) as its benchmarks do, resolves one
    streamed completion: the text and the gateway's usage (prompt and output tokens) come back."""
    from guidellm.backends.openai.http import OpenAIHTTPBackend
    from guidellm.schemas import GenerationRequest, RequestInfo, UsageMetrics
    from guidellm.schemas.backends import OpenAIHTTPBackendArgs

    async def resolve() -> tuple:
        args = OpenAIHTTPBackendArgs(
            target=f"http://127.0.0.1:{stack.http_port}", model=ADAPTER, request_format="/v1/completions"
        )
        backend = OpenAIHTTPBackend(args)
        await backend.process_startup()
        try:
            await backend.validate()
            request = GenerationRequest(
                columns={"text_column": [PROMPT]}, output_metrics=UsageMetrics(text_tokens=OUTPUT_TOKENS)
            )
            return [item async for item in backend.resolve(request, RequestInfo())][-1]
        finally:
            await backend.process_shutdown()

    response, info = asyncio.run(asyncio.wait_for(resolve(), timeout=60))
    assert response.text and info.error is None
    assert response.input_metrics.text_tokens == len(tokenizer(PROMPT).input_ids)
    assert response.output_metrics.text_tokens == OUTPUT_TOKENS
    assert info.timings.first_token_iteration is not None and info.timings.token_iterations >= 1


def test_guidellms_parser_finds_the_usage_so_far_in_every_streamed_chunk(stack, tokenizer):
    """The request body guidellm's own handler makes (`continuous_usage_stats`), sent streamed; fed line by
    line to that handler, every chunk with text carries the usage so far: the prompt's tokens, and the
    output tokens counted up to that chunk, ending at OUTPUT_TOKENS."""
    from guidellm.backends.openai.request_handlers import OpenAIRequestHandlerFactory
    from guidellm.schemas import GenerationRequest, UsageMetrics

    handler = OpenAIRequestHandlerFactory.create("/v1/completions")
    request = GenerationRequest(
        columns={"text_column": [PROMPT]}, output_metrics=UsageMetrics(text_tokens=OUTPUT_TOKENS)
    )
    arguments = handler.format(data=request, model=ADAPTER, stream=True)
    assert arguments.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    usages = []
    url = f"http://127.0.0.1:{stack.http_port}/v1/completions"
    with httpx.stream("POST", url, json=arguments.body, timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if (got := handler.add_streaming_line(line)) is None:
                break  # data: [DONE]
            if got:  # a chunk with text: it carries a usage, and the handler holds it now
                usage = json.loads(line.removeprefix("data:"))["usage"]
                assert usage is not None and usage == handler.streaming_usage, line
                usages.append(usage)
    prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert usages and all(u.get("prompt_tokens") == prompt_tokens for u in usages), usages
    counted = [u["completion_tokens"] for u in usages]
    assert counted == sorted(counted) and counted[0] >= 1 and counted[-1] == OUTPUT_TOKENS, counted
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages), usages
    compiled = handler.compile_streaming(request, arguments)
    assert compiled.output_metrics.text_tokens == OUTPUT_TOKENS and compiled.input_metrics.text_tokens == prompt_tokens
