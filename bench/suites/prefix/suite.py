"""`loraserve bench --suite prefix`: prefix caching on multi-turn chat, with the cache on and off.

    loraserve bench --suite prefix --quick --out /tmp/prefix     # about a minute on 2 CPU cores
    loraserve bench --suite prefix --out results/prefix          # 20 adapters, 2 tenants: several minutes

In the offline engine on the ~25M-parameter random Llama of the overhead suite (`bench/suites/overhead/suite.py`;
the demo model's 512 positions hold no 512-token system prompt and a conversation after it):

- multi-turn: each adapter has a system prompt of `system_tokens` random tokens; each tenant holds
  `conversations` conversations per adapter, of `turns` turns: a turn sends the system prompt, the
  conversation so far (user messages and the answers the engine gave) and a new user message of
  `user_tokens`, and waits for an answer of `answer_tokens`. `concurrency` conversations are under
  way at once (closed loop: a conversation's next turn starts when its answer ends). Requests carry
  their tenant as the cache salt, so tenants share nothing;
- unique: the same number of requests, each a never-repeated prompt of the turns' mean length.

Each workload runs with the cache on and off, alternately, keeping each side's fastest run of
`repeats`. DIR/results.json is {"machine", "records"}; a record has `workload, cache` ("on"/"off"),
`requests, ttft_p50_s, ttft_p99_s, tokens_per_s` (prompt and answer tokens per second, the work
the requests asked for), `output_tokens_per_s, hit_rate` (prompt tokens found cached ÷ prompt
tokens) and `seconds`. The report adds the on/off ratios.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.results import write_results
from loraserve.bench.common.settings import add_settings
from loraserve.config_cli import setting

log = logging.getLogger(__name__)
MODEL = "random-25m"


@dataclass(frozen=True)
class Preset:
    adapters: int
    tenants: int
    conversations: int  # per adapter and tenant
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    concurrency: int
    repeats: int
    model: str = MODEL  # `bench/suites/overhead/suite.py`'s models: "demo" or a random Llama


FULL = Preset(adapters=20, tenants=2, conversations=1, turns=4, system_tokens=512, user_tokens=32,
              answer_tokens=32, concurrency=16, repeats=1)  # fmt: skip
QUICK = Preset(adapters=4, tenants=2, conversations=1, turns=4, system_tokens=512, user_tokens=32,
               answer_tokens=16, concurrency=8, repeats=1)  # fmt: skip


@dataclass(frozen=True)
class PrefixSettings:
    """The prefix suite's own flag (it also reads the shared --quick, --out, --threads, ...)."""

    prefix_adapters: int | None = setting(None, "prefix suite: adapters (each with its own system prompt)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The prefix suite's flags (`PrefixSettings`)."""
    add_settings(p, PrefixSettings)


@dataclass
class _Conversation:
    adapter: str
    tenant: str
    history: list[int]  # system prompt, then every user message and answer so far
    turns_left: int


def _conversations(preset: Preset, vocab: int, rng: random.Random) -> list[_Conversation]:
    systems = {
        f"a{i}": [1] + [rng.randrange(3, vocab) for _ in range(preset.system_tokens - 1)]
        for i in range(preset.adapters)
    }
    conversations = [
        _Conversation(adapter, f"t{t}", list(system), preset.turns)
        for adapter, system in systems.items()
        for t in range(preset.tenants)
        for _ in range(preset.conversations)
    ]
    rng.shuffle(conversations)
    return conversations


def _multi_turn(engine, preset: Preset, seed: int) -> dict:
    """Every conversation to its end, `concurrency` at a time; per-request TTFT, tokens, cached tokens."""
    from loraserve.worker.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    queue = deque(_conversations(preset, vocab, rng))
    active: dict[str, tuple[_Conversation, object, float]] = {}
    ttfts, prompt_tokens, cached, output = [], 0, 0, 0
    sampling = SamplingParams(max_new_tokens=preset.answer_tokens, temperature=1.0, ignore_eos=True)
    started = time.perf_counter()
    counter = 0

    def begin(conversation: _Conversation) -> None:
        nonlocal counter
        conversation.history += [rng.randrange(3, vocab) for _ in range(preset.user_tokens)]
        counter += 1
        request = engine.add_request(
            list(conversation.history), sampling, conversation.adapter, f"r{counter}", cache_salt=conversation.tenant
        )
        active[request.request_id] = (conversation, request, time.monotonic())

    while queue or active:
        while queue and len(active) < preset.concurrency:
            begin(queue.popleft())
        for out in engine.step():
            if not out.finished or out.request_id not in active:
                continue
            conversation, request, submitted = active.pop(out.request_id)
            ttfts.append(request.first_token - submitted)
            prompt_tokens += len(request.prompt_ids)
            cached += request.cached_tokens
            output += len(request.output_ids)
            conversation.history += request.output_ids
            conversation.turns_left -= 1
            if conversation.turns_left:
                begin(conversation)
    return _summary(ttfts, prompt_tokens, cached, output, time.perf_counter() - started)


def _unique(engine, preset: Preset, seed: int) -> dict:
    """As many never-repeated prompts, of the multi-turn prompts' mean length, `concurrency` at a time."""
    from loraserve.worker.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    count = preset.adapters * preset.tenants * preset.conversations * preset.turns
    mean_turn = (
        preset.system_tokens
        + (preset.turns + 1) / 2 * preset.user_tokens
        + (preset.turns - 1) / 2 * preset.answer_tokens
    )
    sampling = SamplingParams(max_new_tokens=preset.answer_tokens, temperature=1.0, ignore_eos=True)
    pending = deque(range(count))
    active: dict[str, tuple[object, float]] = {}
    ttfts, prompt_tokens, cached, output = [], 0, 0, 0
    started = time.perf_counter()
    while pending or active:
        while pending and len(active) < preset.concurrency:
            i = pending.popleft()
            prompt = [1] + [rng.randrange(3, vocab) for _ in range(int(mean_turn) - 1)]
            request = engine.add_request(prompt, sampling, f"a{i % preset.adapters}", f"u{i}", cache_salt=f"t{i % 2}")
            active[request.request_id] = (request, time.monotonic())
        for out in engine.step():
            if out.finished and out.request_id in active:
                request, submitted = active.pop(out.request_id)
                ttfts.append(request.first_token - submitted)
                prompt_tokens += len(request.prompt_ids)
                cached += request.cached_tokens
                output += len(request.output_ids)
    return _summary(ttfts, prompt_tokens, cached, output, time.perf_counter() - started)


def _summary(ttfts: list[float], prompt_tokens: int, cached: int, output: int, seconds: float) -> dict:
    ordered = sorted(ttfts)
    return {
        "requests": len(ordered),
        "ttft_p50_s": ordered[len(ordered) // 2],
        "ttft_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "tokens_per_s": (prompt_tokens + output) / seconds,
        "output_tokens_per_s": output / seconds,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "seconds": seconds,
    }


def _engine(path: Path, preset: Preset, cache: bool, seed: int):
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.model_config import ModelConfig
    from loraserve.worker.adapters import load_adapter_bytes
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine

    longest = preset.system_tokens + preset.turns * (preset.user_tokens + preset.answer_tokens)
    pages = preset.concurrency * (-(-longest // 16)) * 3 + preset.adapters * 8  # room to keep what was computed
    config = EngineConfig(device="cpu", prefix_cache=cache, pool_pages=pages, max_batch_size=preset.concurrency)
    engine = Engine(path, config)
    synthetic = SyntheticAdapters(path, seed=seed)
    model = ModelConfig.from_dir(path)
    for i in range(preset.adapters):
        engine.add_adapter(f"a{i}", load_adapter_bytes(*synthetic.files(f"a{i}", (8, 16, 32)[i % 3]), model, 128))
    return engine


def measure(path: Path, preset: Preset, seed: int) -> list[dict]:
    records = []
    for workload, run in (("multi-turn", _multi_turn), ("unique", _unique)):
        best: dict[bool, dict] = {}
        for _ in range(preset.repeats):
            for cache in (True, False):  # alternately: both sides see the same conditions
                engine = _engine(path, preset, cache, seed)
                result = run(engine, preset, seed)
                engine.close()
                if cache not in best or result["seconds"] < best[cache]["seconds"]:
                    best[cache] = result
                log.info("prefix %s cache=%s: %s", workload, cache, result)
        records += [{"workload": workload, "cache": "on" if cache else "off", **best[cache]} for cache in (True, False)]
    return records


def ratios(records: list[dict]) -> dict[str, float]:
    """On/off ratios: TTFT p50 (off ÷ on), throughput (on ÷ off) per workload."""
    by = {(r["workload"], r["cache"]): r for r in records}
    out = {}
    for workload in ("multi-turn", "unique"):
        on, off = by[workload, "on"], by[workload, "off"]
        out[f"{workload}_ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
        out[f"{workload}_throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from loraserve.bench.suites.overhead.suite import model_dir

    preset = QUICK if args.quick else FULL
    if args.prefix_adapters:
        preset = Preset(**{**vars(preset), "adapters": args.prefix_adapters})
    torch.set_num_threads(args.threads)
    for noisy in ("loraserve.worker", "loraserve.kernels"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cache = args.adapter_cache or Path.home() / ".cache" / "loraserve-bench"
    records = measure(model_dir(preset.model, cache), preset, args.seed)
    for r in records:
        print(
            f"{r['workload']:>10} cache {r['cache']:>3}: TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, p99 "
            f"{r['ttft_p99_s'] * 1e3:.0f} ms, {r['tokens_per_s']:.0f} tokens/s, hit rate {r['hit_rate']:.2f}"
        )
    summary = ratios(records)
    for name, value in summary.items():
        print(f"{name}: {value:.2f}")
    if args.out:
        path = write_results(
            args.out, "prefix", records, threads=args.threads, model=preset.model, preset=vars(preset), ratios=summary
        )
        print(f"results: {path}")
    return 0
