"""What asking for log-probabilities costs: `loraserve bench --suite logprobs`.

    loraserve bench --suite logprobs --quick --out /tmp/logprobs    # about half a minute on 2 CPU cores
    loraserve bench --suite logprobs --out results/logprobs

Two measurements, run alternately so that each variant sees the same conditions, each keeping its
fastest of `repeats` runs:

- decode: in the offline engine on the demo model with its adapters (mixed, greedy, one prompt), a
  batch of 1 or 32 requests decodes `new_tokens` tokens side by side with log-probabilities off,
  with each token's own (`logprobs: 0`) and with its 20 likeliest alternatives (`logprobs: 20`,
  OpenAI's maximum); the step time is the mean over the decode steps of the whole batch. Prompt
  scoring (completions' `echo`, `prompt_logprobs`) is measured the same way on the prefill of a
  batch of prompts: the step that computes them, with and without scoring every prompt row.
- logits: `worker/logprobs.py`'s `logprobs_from_logits` alone, on random float32 logits of a
  real vocabulary (32,000: Llama 2, Mistral; 128,256: Llama 3) for 1 and 32 rows, top 0 and 20,
  beside the log-softmax that any sampler computes anyway: the demo model's vocabulary (1,024) is
  too small to show what a real one costs.

results.json's records are the decode ones, beside "prefill" and "logits".
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import demo_engine, full_batch_steps, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.config_cli import setting

PROMPT = "the quiet king"
VARIANTS = {"off": None, "logprobs 0": 0, "logprobs 20": 20}  # SamplingParams.logprobs
VOCABULARIES = (32_000, 128_256)


@dataclass(frozen=True)
class LogprobsPreset(Preset):
    batches: tuple[int, ...]
    new_tokens: int
    prompt_tokens: int  # of each prompt scored in the prefill measurement
    repeats: int


FULL = LogprobsPreset(batches=(1, 32), new_tokens=64, prompt_tokens=256, repeats=5)
QUICK = LogprobsPreset(batches=(1, 32), new_tokens=24, prompt_tokens=128, repeats=2)


def _decode(engine, batch: int, logprobs: int | None, new_tokens: int) -> float:
    """Mean seconds of a whole-batch decode step, with `logprobs` asked for by every request."""
    from loraserve.worker.sampling import SamplingParams

    names = [None, *engine.registry.names()]
    ids = engine.tokenizer.encode(PROMPT)
    for i in range(batch):
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
        engine.add_request(ids, sampling, names[i % len(names)])
    steps = full_batch_steps(engine, batch)
    return sum(steps) / max(1, len(steps))


def _prefill(engine, batch: int, scored: int | None, prompt_tokens: int) -> float:
    """Seconds of the step that computes `batch` prompts of `prompt_tokens` tokens (every row scored
    with `scored` alternatives, or none), and samples their first tokens."""
    from loraserve.worker.sampling import SamplingParams

    names = [None, *engine.registry.names()]
    for i in range(batch):
        ids = [1] + [3 + (7 * i + 13 * j) % 1000 for j in range(prompt_tokens - 1)]  # no two alike: no cache hit
        sampling = SamplingParams(max_new_tokens=1, prompt_logprobs=scored, logprobs=scored)
        engine.add_request(ids, sampling, names[i % len(names)])
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return seconds


def _logits(vocab: int, rows: int, top: int | None, repeats: int) -> float:
    """Fastest seconds of `logprobs_from_logits` (or, for top None, of the log-softmax alone)."""
    import torch

    from loraserve.worker.logprobs import logprobs_from_logits

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows))
    tokens = torch.randint(0, vocab, (rows,)).tolist()
    best = float("inf")
    for _ in range(repeats * 5):
        started = time.perf_counter()
        if top is None:
            torch.log_softmax(logits, -1)
        else:
            logprobs_from_logits(logits, tokens, [top] * rows)
        best = min(best, time.perf_counter() - started)
    return best


def measure(engine, preset: LogprobsPreset) -> dict[str, list[dict]]:
    decode: dict[tuple[int, str], float] = {}
    prefill: dict[tuple[int, str], float] = {}
    for _ in range(preset.repeats):
        for batch in preset.batches:
            for name, k in VARIANTS.items():  # alternately: each variant sees the same conditions
                step = _decode(engine, batch, k, preset.new_tokens)
                decode[batch, name] = min(decode.get((batch, name), float("inf")), step)
                step = _prefill(engine, min(batch, 8), k, preset.prompt_tokens)
                prefill[batch, name] = min(prefill.get((batch, name), float("inf")), step)
    records: dict[str, list[dict]] = {"decode": [], "prefill": [], "logits": []}
    for batch in preset.batches:
        for kind, table in (("decode", decode), ("prefill", prefill)):
            off = table[batch, "off"]
            records[kind] += [
                {
                    "batch": batch if kind == "decode" else min(batch, 8),
                    "variant": name,
                    "step_ms": 1e3 * table[batch, name],
                    "off_step_ms": 1e3 * off,
                    "overhead": table[batch, name] / off - 1,
                }
                for name in VARIANTS
            ]
    for vocab in VOCABULARIES:
        for rows in preset.batches:
            softmax = _logits(vocab, rows, None, preset.repeats)
            for top in (0, 20):
                seconds = _logits(vocab, rows, top, preset.repeats)
                records["logits"].append(
                    {"vocab": vocab, "rows": rows, "top": top, "ms": 1e3 * seconds, "log_softmax_ms": 1e3 * softmax}
                )
    return records


@dataclass(frozen=True)
class LogprobsSettings:
    """The logprobs suite's flags (its own alone)."""

    quick: bool = setting(False, "fewer tokens and repeats")
    threads: int = setting(1, "torch CPU threads")
    out: Path | None = setting(None, "write DIR/results.json")


SETTINGS = LogprobsSettings


def main(args: argparse.Namespace) -> int:
    from loraserve.worker.config import EngineConfig

    preset = QUICK if args.quick else FULL
    quiet(args.threads)
    engine = demo_engine(EngineConfig(device="cpu", max_batch_size=max(preset.batches), prefix_cache=False))
    _decode(engine, max(preset.batches), 20, 4)  # warm-up, unmeasured
    records = measure(engine, preset)
    engine.close()
    for r in records["decode"] + records["prefill"]:
        kind = "decode" if r in records["decode"] else "prefill"
        print(
            f"{kind:>7} batch {r['batch']:>2} {r['variant']:>11}: step {r['step_ms']:.3f} ms "
            f"(off {r['off_step_ms']:.3f} ms, {100 * r['overhead']:+.1f} %)"
        )
    for r in records["logits"]:
        print(
            f" logits vocab {r['vocab']:>6} rows {r['rows']:>2} top {r['top']:>2}: {r['ms']:.3f} ms "
            f"(log-softmax alone {r['log_softmax_ms']:.3f} ms)"
        )
    publish(args.out, "logprobs", records["decode"], args.threads, prefill=records["prefill"], logits=records["logits"])
    return 0
