"""`loraserve bench --suite structured`: what a constrained (structured output) request costs per token.

    loraserve bench --suite structured --quick --out /tmp/structured    # about a minute on 2 CPU cores
    loraserve bench --suite structured --out results/structured

In the offline engine on the demo model with its adapters, a batch of `batch` requests (adapters
mixed, greedy, the same prompt) decodes side by side, in three mixes run alternately in one process:
none constrained, a quarter constrained, all constrained, for each grammar kind (a list of JSON records
under a schema; a regular expression). Both are long enough that no request completes its grammar
within `new_tokens`, so every request decodes to the end, as unconstrained ones do (they ignore EOS).
The step time is the mean over the decode steps of the whole batch, and each mix keeps its fastest
of `repeats` runs.

Also measured, from the engine's mask computer: the host time to compute one request's mask (on the
mask thread, overlapped with the forward pass) and the time a step waited for its masks after the
forward pass (what the overlap did not hide).

A record is a grammar and a mix: `step_ms` against `free_step_ms` (the same batch unconstrained),
`overhead` (step_ms / free_step_ms - 1), and the mask times.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loraserve.bench.common.engine_run import alternate, demo_engine, full_batch_steps, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.config_cli import setting

RECORDS_SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}
# Grammars no request can complete within the token budget (at least 200 records; 2000 characters), so
# every request decodes to max_new_tokens and each step is the whole batch.
GRAMMARS = {"json_schema": ("json_schema", RECORDS_SCHEMA), "regex": ("regex", "[a-z .]{2000,4000}")}
PROMPT = "the quiet king"


@dataclass(frozen=True)
class StructuredPreset(Preset):
    batch: int
    new_tokens: int
    repeats: int


FULL = StructuredPreset(batch=32, new_tokens=96, repeats=3)
QUICK = StructuredPreset(batch=16, new_tokens=48, repeats=2)


@dataclass(frozen=True)
class StructuredSettings:
    """The structured suite's own flag (it also reads the shared --quick, --out, --threads, ...)."""

    structured_batch: int | None = setting(None, "structured suite: requests decoding side by side")


SETTINGS = StructuredSettings


def _run(engine, batch: int, constrained: int, grammar: str | None, new_tokens: int) -> dict:
    """One batch to its end: mean step seconds over full-batch decode steps, and the mask counters' growth."""
    from loraserve.worker.sampling import SamplingParams

    names = [None, *(n for n in engine.registry.names())]
    ids = engine.tokenizer.encode(PROMPT)
    for i in range(batch):
        guided = i < constrained
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=not guided, grammar=grammar if guided else None)
        engine.add_request(ids, sampling, names[i % len(names)])
    masks = engine.runner.masks
    before = (masks.compute_seconds, masks.wait_seconds, masks.rows, engine.steps)
    full_steps = full_batch_steps(engine, batch)
    after = (masks.compute_seconds, masks.wait_seconds, masks.rows, engine.steps)
    computed, waited, rows, steps = (now - then for now, then in zip(after, before, strict=True))
    return {
        "step_s": sum(full_steps) / max(1, len(full_steps)),
        "steps": len(full_steps),
        "mask_s_per_request": computed / rows if rows else 0.0,
        "wait_s_per_step": waited / max(1, steps),
    }


def measure(engine, kind: str, preset: StructuredPreset) -> list[dict]:
    from loraserve.structured import grammar_for

    grammar = grammar_for(*GRAMMARS[kind], field=kind)
    mixes = (0, preset.batch // 4, preset.batch)
    runs = alternate(preset.repeats, mixes, lambda c: _run(engine, preset.batch, c, grammar, preset.new_tokens))
    best = {
        c: min(done, key=lambda r: r["step_s"])
        for c, r_all in runs.items()
        if (done := [r for r in r_all if r["steps"]])
    }
    free = best[0]["step_s"]
    return [
        {
            "grammar": kind,
            "batch": preset.batch,
            "constrained": constrained,
            "step_ms": 1e3 * run["step_s"],
            "free_step_ms": 1e3 * free,
            "overhead": run["step_s"] / free - 1,
            "mask_ms_per_request": 1e3 * run["mask_s_per_request"],
            "mask_wait_ms_per_step": 1e3 * run["wait_s_per_step"],
            "full_batch_steps": run["steps"],
        }
        for constrained, run in sorted(best.items())
        if constrained
    ]


def main(args: argparse.Namespace) -> int:
    from loraserve.structured import grammar_for
    from loraserve.worker.config import EngineConfig

    preset = (QUICK if args.quick else FULL).but(batch=args.structured_batch or None)
    quiet(args.threads)
    engine = demo_engine(EngineConfig(device="cpu", max_batch_size=max(preset.batch, 8)))
    _run(engine, preset.batch, preset.batch, grammar_for("json_object", True, "warm_up"), 4)  # unmeasured
    records = [r for kind in GRAMMARS for r in measure(engine, kind, preset)]
    engine.close()
    for r in records:
        print(
            f"{r['grammar']:>11}  {r['constrained']:>3}/{r['batch']} constrained: step {r['step_ms']:.2f} ms "
            f"(unconstrained {r['free_step_ms']:.2f} ms, {100 * r['overhead']:+.1f} %), "
            f"mask {r['mask_ms_per_request']:.3f} ms per request, "
            f"{r['mask_wait_ms_per_step']:.3f} ms per step not hidden"
        )
    publish(args.out, "structured", records, threads=args.threads)
    return 0
