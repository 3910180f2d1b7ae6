"""Engine flags (shared by every command that builds an engine) and `loraserve generate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import LoraserveError
from loraserve.tokenizer import IncrementalDetokenizer
from loraserve.worker.config import RUNNERS, EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.sampling import SamplingParams

WORKER_ADAPTER_CACHE_GB = 4.0  # a worker's default: thousands of typical adapters, bounded all the same


def add_engine_arguments(
    parser: argparse.ArgumentParser, adapter_cache_gb: float | None = WORKER_ADAPTER_CACHE_GB
) -> None:
    """The engine's flags. `adapter_cache_gb=None` leaves out --adapter-cache-gb: an engine without an
    adapter store to fetch evicted adapters back from (`loraserve generate`) must keep them all."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        type=Path,
        default=DEMO_MODEL_DIR,
        help="Hugging Face model directory (default: the embedded demo model)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton", "torch-bmm"], help="kernel backend")
    g.add_argument("--max-batch-size", type=int, default=64)
    g.add_argument("--max-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-lora-rank", type=int, default=128)
    g.add_argument("--rows-per-page", type=int, default=32)
    g.add_argument("--pool-pages", type=int, default=None, help="size of the unified pool in pages")
    g.add_argument("--pool-memory-gb", type=float, default=None, help="size of the unified pool in GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--cpu-pool-memory-gb", type=float, default=0.5)
    g.add_argument(
        "--prefetch", action=argparse.BooleanOptionalAction, default=True, help="prefetch predicted adapters"
    )
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep full KV pages for later requests with the same prefix, adapter and tenant "
        "(--no-prefix-cache: compute every prompt from its first token)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run every decode step eagerly (by default, on CUDA with the triton backend, "
        "decode steps replay a graph captured per batch-size bucket at start-up)",
    )
    g.add_argument(
        "--runner",
        choices=RUNNERS,
        default="real",
        help="real: run the model; emulated: a benchmark and test tool, never for serving: no weights loaded, "
        "each step waits the time --runner-profile predicts (on the CPU, taking almost none of it) and emits "
        "deterministic tokens",
    )
    g.add_argument(
        "--runner-profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --runner emulated: the step-cost profile measured on the real engine "
        "(`loraserve bench --suite runner-profile --out DIR` writes DIR/runner_profile.json)",
    )
    if adapter_cache_gb is not None:
        g.add_argument(
            "--adapter-cache-gb",
            type=float,
            default=adapter_cache_gb,
            help="host RAM for fetched adapters, GiB; least recently used ones no request holds are evicted past it "
            "and fetched from the adapter store again when needed",
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        max_batch_size=args.max_batch_size,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        max_lora_rank=args.max_lora_rank,
        rows_per_page=args.rows_per_page,
        pool_pages=args.pool_pages,
        pool_memory_gb=args.pool_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_pool_memory_gb=args.cpu_pool_memory_gb,
        prefetch=args.prefetch,
        prefix_cache=args.prefix_cache,
        cuda_graphs="off" if args.enforce_eager else "auto",
        adapter_cache_bytes=_gib_to_bytes(getattr(args, "adapter_cache_gb", None)),
        runner=args.runner,
        runner_profile=args.runner_profile,
    )


def _gib_to_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def parse_adapter_specs(specs: list[str]) -> dict[str, Path]:
    """["name=path", ...] -> {name: path}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter-dir {spec!r}: expected NAME=PATH")
        out[name] = Path(path)
    return out


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, adapter_cache_gb=None)
    parser.add_argument("prompt", help="prompt text ('-' reads standard input)")
    parser.add_argument("--adapter", default=None, help="adapter name (default: the base model)")
    parser.add_argument(
        "--adapter-dir",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register a PEFT adapter directory (repeatable; the demo adapters are registered with the demo model)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def generate_main(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        engine = Engine(args.model, engine_config_from_args(args))
        adapters = parse_adapter_specs(args.adapter_dir)
        if Path(args.model).resolve() == DEMO_MODEL_DIR.resolve():
            adapters = {**demo_adapters(), **adapters}
        for name, path in adapters.items():
            engine.register_adapter(name, path)
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        prompt_ids = engine.tokenizer.encode(prompt)
        request = engine.add_request(prompt_ids, sampling, args.adapter)
    except LoraserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids)
    sys.stdout.write(prompt)
    while not request.finished:
        for out in engine.step():
            for token in out.new_token_ids:
                if token not in engine.tokenizer.eos_token_ids:
                    sys.stdout.write(detok.push(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    print(f"[{request.finish_reason}: {len(request.output_ids)} tokens]", file=sys.stderr)
    return 0 if request.error is None else 1
