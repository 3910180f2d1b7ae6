"""`loraserve bench --suite NAME`: every benchmark suite behind one command.

    loraserve bench --quick --out /tmp/bench-quick                  # serving, the default suite
    loraserve bench --suite prefix --quick --out /tmp/prefix
    loraserve bench --suite logprobs --quick --out /tmp/logprobs
    loraserve bench --suite kernels --dry-run --out /tmp/kernels     # own flags: see --help with it

Each suite lives in `bench/suites/<name>/`; its `suite.py` (or the module named below) has
`main(args) -> int` and, unless it reads only the shared flags, `SETTINGS`, its settings dataclass
(`bench/common/settings.py`; under a heading of its own for the suites in `GROUPED`), or
`add_arguments(parser)`, which adds its flags itself. Most suites share one set of flags
(--quick, --out, --threads, --model, ...: every such suite's flags are accepted together, as they
always were); a suite whose flags clash with that set (`OWN_FLAGS`) is given its own flags alone.
Which set a command line gets is read from the command line itself: `--suite` is parsed first (or
LORASERVE_SUITE), then that suite's flags are added and the whole line parsed. Every suite writes
`--out DIR/results.json` through `bench/common/results.py`.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from loraserve.bench.common.settings import add_settings, config_from_args
from loraserve.config_cli import setting
from loraserve.flags import EnvArgumentParser

# name -> (module with main and its flags, one line on what it measures)
SUITES: dict[str, tuple[str, str]] = {
    "serving": ("suites.serving.suite", "the systems on S-LoRA's synthetic trace (the default)"),
    "chaos": ("suites.chaos.suite", "failover under killed, stopped and drained workers"),
    "scheduling": ("suites.scheduling.suite", "the default scheduling policy against fcfs, on the real stack"),
    "abuse": ("suites.abuse.suite", "the stack under connection floods, huge bodies, idle connections and a soak"),
    "overhead": ("suites.overhead.suite", "LoRA's cost over the base model in the offline engine"),
    "structured": ("suites.structured.suite", "what a constrained (structured output) request costs per token"),
    "choices": ("suites.choices.suite", "n choices of one prompt, with shared prefill and without"),
    "prefix": ("suites.prefix.suite", "prefix caching on multi-turn chat, cache on and off"),
    "runner-profile": (
        "suites.runner_profile.suite",
        "calibrate the emulated runner on the real engine, check it out of sample; --roofline: a GPU's, computed",
    ),
    "cold": ("suites.cold.suite", "what a request whose adapter is resident nowhere pays, and loading's cost"),
    "control-plane": ("suites.control_plane.suite", "one scheduler at 64 emulated workers and 10,000 adapters"),
    "logprobs": ("suites.logprobs.suite", "what asking for log-probabilities costs a step"),
    "engine-scaling": ("suites.engine_scaling.suite", "the offline engine's throughput against the adapter count"),
    "adapter-fetch": ("suites.adapter_fetch.suite", "adapter fetch latency, store to worker, at 7B shapes"),
    "gateway": ("suites.gateway.suite", "the gateway's CPU per token streamed, gRPC and HTTP, at 64 streams"),
    "tensor-parallel": ("suites.tensor_parallel.suite", "one engine split over N ranks: speed, LoRA overhead, bytes"),
    "peer": ("suites.peer.suite", "loraserve against vLLM's CPU build, same model, adapters and HTTP client"),
    "kernels": ("suites.kernels.suite", "the batched LoRA kernels against torch baselines and the roofline (GPU)"),
    "attention": ("suites.kernels.attention", "the paged-attention kernel against dense SDPA (GPU)"),
    "gpu-check": ("suites.gpu_check.suite", "the GPU suite: tests, kernels, a 7B-shaped engine, the stack"),
}
# Suites whose flags clash with the shared set: they get theirs alone.
OWN_FLAGS = frozenset({"logprobs", "engine-scaling", "adapter-fetch", "peer", "kernels", "attention", "gpu-check"})
# Suites whose flags `--help` shows under a heading of their own.
GROUPED = frozenset({"scheduling", "chaos", "runner-profile", "control-plane"})
DEFAULT = "serving"


def suite_module(name: str) -> ModuleType:
    """The module that runs suite `name`."""
    return importlib.import_module(f"loraserve.bench.{SUITES[name][0]}")


@dataclass(frozen=True)
class BenchSettings:
    """`loraserve bench`'s own setting: the suite it runs."""

    suite: str = setting(
        DEFAULT, "; ".join(f"{name}: {line}" for name, (_, line) in SUITES.items()), choices=tuple(SUITES)
    )


def requested_suite(argv: Sequence[str]) -> str:
    """The suite `argv` asks for (`--suite NAME`, else LORASERVE_SUITE's, else serving), read by a parser of
    `--suite` alone. An unknown name gives the default here; the whole parser then refuses it with the list."""
    pre = EnvArgumentParser(add_help=False, exit_on_error=False)
    add_settings(pre, BenchSettings)
    try:
        return config_from_args(BenchSettings, pre.parse_known_args(list(argv))[0]).suite
    except argparse.ArgumentError:
        return DEFAULT


def add_suite_arguments(parser: argparse.ArgumentParser, suite: str) -> None:
    """The flags suite `suite` reads: its own alone (`OWN_FLAGS`), else every shared-flag suite's."""
    names = [suite] if suite in OWN_FLAGS else [n for n in SUITES if n not in OWN_FLAGS]
    for name in names:  # serving first: it defines the flags the other shared-flag suites read
        module = suite_module(name)
        if hasattr(module, "add_arguments"):
            module.add_arguments(parser)
        elif hasattr(module, "SETTINGS"):  # a suite may read only the shared flags
            group = parser.add_argument_group(f"{name} suite (--suite {name})") if name in GROUPED else parser
            add_settings(group, module.SETTINGS)


def add_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] = ()) -> None:
    """--suite, and the flags of the suite `argv` (the bench command's own arguments) asks for."""
    add_settings(parser, BenchSettings)
    add_suite_arguments(parser, requested_suite(argv))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`loraserve bench ARGV`'s flags, parsed (for tests and scripts that run a suite in-process)."""
    parser = EnvArgumentParser(prog="loraserve bench", description=__doc__.splitlines()[0])
    add_arguments(parser, argv)
    return parser.parse_args(list(argv))


def main(args: argparse.Namespace) -> int:
    """Run the suite `args.suite` names."""
    return int(suite_module(args.suite).main(args) or 0)


def run(argv: Sequence[str]) -> int:
    """`loraserve bench ARGV` in this process."""
    return main(parse_args(argv))
