"""The compiled forward pass (`--compile`, `worker/compiled_forward.py`) against transformers + peft.

Tolerance: as the eager engine's (tests/numerics/test_engine_parity.py): first-step logits within
atol = rtol = 1e-4 of PEFT's in float32 (inductor sums the norms in its own order), greedy tokens identical.
The warm-up compiles both graphs (with adapters, without); serving then compiles nothing more.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import pytest
import torch
from helpers import hf_greedy
from test_engine_parity import GREEDY, NEW_TOKENS, PROMPTS, _engine, _mixed_requests, check_first_step_logits

from loraserve.errors import InvalidConfigError
from loraserve.kernels import attention_cpu
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import GenerateRequest


@pytest.fixture(scope="module")
def compiled(tiny_model, tiny_adapters):
    """An engine with a compiled forward pass, and the graphs it calls: each call's (tokens, with adapters)."""
    engine = _engine(tiny_model, tiny_adapters, compile_model=True)
    graph, calls = engine.runner.forward.graph, []

    def observed(input_ids, positions, batch, lora):  # observe, don't alter
        calls.append((input_ids.shape[0], lora))
        return graph(input_ids, positions, batch, lora)

    engine.runner.forward.graph = observed
    return engine, calls


@pytest.fixture(scope="module")
def oracle(tiny_model, tiny_adapters):
    """Greedy continuation of (prompt, adapter) by transformers/peft, memoized."""
    run = functools.cache(lambda prompt, adapter: hf_greedy(tiny_model, tiny_adapters.get(adapter), prompt, NEW_TOKENS))
    return lambda prompt, adapter: run(tuple(prompt), adapter)


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_warm_up_compiles_both_graphs_and_serving_compiles_none(compiled, tiny_adapters, oracle):
    engine, calls = compiled
    assert engine.warm_up_seconds is not None  # --compile warms up on the CPU
    before, calls[:] = _graphs_compiled(), []
    requests = _mixed_requests(tiny_adapters)
    results = engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == oracle(request.prompt_ids, request.adapter), request.adapter
    assert _graphs_compiled() == before  # no recompilation: shapes are dynamic in the step's tokens
    assert len(calls) == engine.steps and {lora for _, lora in calls} == {True}  # adapters in every step


def test_steps_without_adapters_take_the_other_graph(compiled, oracle):
    engine, calls = compiled
    calls[:] = []
    requests = [GenerateRequest(prompt_ids=p, sampling=GREEDY) for p in PROMPTS[:3]]
    for request, result in zip(requests, engine.generate(requests), strict=True):
        assert result.token_ids == oracle(request.prompt_ids, None)
    assert calls and {lora for _, lora in calls} == {False}


def test_a_step_of_one_token_runs_eagerly(compiled, oracle):
    engine, calls = compiled
    calls[:] = []
    (result,) = engine.generate([GenerateRequest(prompt_ids=PROMPTS[0], adapter="r4-qv", sampling=GREEDY)])
    assert result.token_ids == oracle(PROMPTS[0], "r4-qv")
    assert calls == [(len(PROMPTS[0]), True)]  # the prefill; each decode step (one token) ran eagerly


def test_chunked_prefill_and_arrivals_mid_generation(compiled, tiny_adapters, oracle):
    engine, _ = compiled
    requests = _mixed_requests(tiny_adapters)
    added = {}
    for i, r in enumerate(requests):
        added[i] = engine.add_request(r.prompt_ids, r.sampling, r.adapter)
        for _ in range(2):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    for i, r in enumerate(requests):
        assert added[i].output_ids == oracle(r.prompt_ids, r.adapter), r.adapter


def test_on_one_thread_decode_attention_runs_in_c(compiled, tiny_adapters, oracle, monkeypatch):
    """The peer suite's set-up: one torch thread, so decode steps attend in C (`kernels/attention_cpu.py`)."""
    engine, _ = compiled
    threads, used = torch.get_num_threads(), []
    kernel = attention_cpu.decode_kernel()
    monkeypatch.setattr(attention_cpu, "decode_kernel", lambda: lambda *args: used.append(1) or kernel(*args))
    torch.set_num_threads(1)
    try:
        requests = _mixed_requests(tiny_adapters)
        for request, result in zip(requests, engine.generate(requests), strict=True):
            assert result.token_ids == oracle(request.prompt_ids, request.adapter), request.adapter
    finally:
        torch.set_num_threads(threads)
    assert len(used) >= (NEW_TOKENS - 1) * engine.model.config.num_layers  # every decode step's every layer


def test_first_step_logits_match_peft(compiled, tiny_model, tiny_adapters):
    check_first_step_logits(compiled[0], tiny_model, tiny_adapters)


def test_warm_up_on_a_pool_smaller_than_the_largest_adapter(tiny_model, tiny_adapters, oracle):
    """The warm-up's dummy adapters stop at the largest rank the pool can hold (one of rank 64 on every
    module needs more pages than these 96; its truncated page list once broke the torch backend's plan)."""
    engine = _engine(tiny_model, tiny_adapters, warm_up="on")
    assert engine.warm_up_seconds is not None
    requests = _mixed_requests(tiny_adapters)
    for request, result in zip(requests, engine.generate(requests), strict=True):
        assert result.token_ids == oracle(request.prompt_ids, request.adapter), request.adapter


def test_a_worker_started_with_compile_compiles_before_it_is_ready(compiled, tiny_model, tmp_path):
    """A real worker process (the graphs of the same model as `compiled`'s: inductor's disk cache holds them)."""
    argv = [sys.executable, "-m", "loraserve.cli", "worker", "--model", str(tiny_model), "--compile"]
    argv += ["--torch-threads", "1", "--scheduler-address", "tcp://127.0.0.1:9"]  # no scheduler: it warms up alone
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240  # compiling with a cold inductor cache takes about half a minute here
        while "ready" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        text = log.read_text()
        assert "warm-up: compiled forward pass" in text, text[-2000:]
        assert text.index("warm-up: compiled forward pass") < text.index("ready")
    finally:
        worker.terminate()
        worker.wait(30)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"tensor_parallel": 2}, "needs one rank"),
        ({"runner": "emulated", "runner_profile": "profile.json"}, "no model to compile"),
        ({"device": "cuda"}, "for the CPU"),
    ],
    ids=["split-model", "emulated", "cuda"],
)
def test_compile_where_it_cannot_apply_is_refused(overrides, says):
    with pytest.raises(InvalidConfigError, match=says):
        EngineConfig(compile_model=True, **overrides)
