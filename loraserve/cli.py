"""`loraserve`: the whole stack (`up`), one subcommand per role, the benchmark, offline generation.

Only the chosen subcommand's module is imported, so e.g. the gateway never loads torch.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from loraserve.config_cli import add_config_arguments, setting
from loraserve.flags import EnvArgumentParser


@dataclass(frozen=True)
class CliSettings:
    """The settings of `loraserve` itself, before the command."""

    log_level: str = setting("INFO", "", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


# name -> (module, function adding its flags, function running it, one-line help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "up": (
        "loraserve.launcher.up",
        "add_arguments",
        "main",
        "start the whole stack as local processes (demo model and adapters by default)",
    ),
    "gateway": ("loraserve.gateway.main", "add_arguments", "main", "run the public gRPC gateway"),
    "scheduler": ("loraserve.scheduler.main", "add_arguments", "main", "run the scheduler (admission, placement)"),
    "adapter-store": (
        "loraserve.adapter_store.main",
        "add_arguments",
        "main",
        "run the adapter store (adapters in host RAM)",
    ),
    "worker": ("loraserve.worker.main", "add_arguments", "main", "run a GPU (or CPU) worker"),
    "keys": ("loraserve.gateway.keys", "add_arguments", "main", "make API keys for the gateway's auth file"),
    "bench": ("loraserve.bench.cli", "add_arguments", "main", "run a benchmark suite (--suite NAME)"),
    "generate": (
        "loraserve.worker.cli",
        "add_generate_arguments",
        "generate_main",
        "generate offline with the in-process engine (streams text)",
    ),
    "demo": (
        "loraserve.demo.show",
        "add_arguments",
        "main",
        "show the demo model and its adapters at work, in-process",
    ),
}


def build_parser(chosen: str | None, rest: Sequence[str] = ()) -> EnvArgumentParser:
    """The parser of `loraserve`, with the flags of command `chosen` (whose arguments are `rest`: a
    command whose flags depend on its arguments, as `bench --suite NAME`, takes them as `argv`)."""
    parser = EnvArgumentParser(prog="loraserve", description="Serve many LoRA adapters of one base model.")
    add_config_arguments(parser, CliSettings)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=EnvArgumentParser)
    for name, (module_name, add, run, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            adder = getattr(module, add)
            if "argv" in inspect.signature(adder).parameters:
                adder(command, argv=list(rest))
            else:
                adder(command)
            command.set_defaults(run=getattr(module, run))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(chosen, argv[argv.index(chosen) + 1 :] if chosen else ())
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
