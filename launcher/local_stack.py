"""A whole stack on free loopback ports, started in-process by tests and benchmarks."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from loraserve import internal_auth
from loraserve.launcher.commands import add_arguments, internal_keys_dir
from loraserve.launcher.ports import Ports, free_port_block
from loraserve.launcher.up import gateway_tls, supervisor, wait_healthy


class LocalStack:
    """A stack on free loopback ports, with handles to every process (tests and benchmarks use it)."""

    def __init__(self, model: Path, workers: int = 1, **options):
        base = free_port_block(6)  # one block, so the gateway's port cannot land among the others
        self.ports = Ports(base)
        self.address = f"127.0.0.1:{base + 5}"
        parser = argparse.ArgumentParser()  # plain: `up`'s defaults, without its environment twins
        add_arguments(parser)
        args = parser.parse_args(
            ["--model", str(model), "--workers", str(workers), "--bind", self.address, "--base-port", str(base)]
        )
        vars(args).update(_as_parsed(parser, options))
        self.stack = supervisor(args, gateway_tls(args))  # nothing calls its tick(): a test's killed role stays dead
        self.internal_keys = internal_keys_dir(args)
        self.internal_token = internal_auth.load(self.internal_keys, "gateway").token  # to call internal ports

    def start(self, timeout_s: float = 180.0) -> LocalStack:
        self.stack.start()
        try:
            wait_healthy([self.ports.store, self.ports.scheduler, self.address], self.stack, timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def process(self, name: str) -> subprocess.Popen:
        return self.stack.children[name]

    def stop(self) -> None:
        self.stack.stop(timeout_s=10.0)


def _as_parsed(parser: argparse.ArgumentParser, options: dict[str, object]) -> dict[str, object]:
    """Stack options named after `up`'s flags (`adapter_cache_gb=0.5` is --adapter-cache-gb 0.5), as the
    parsed values of those flags; TypeError naming any that is no flag of `up`."""
    actions = {a.option_strings[0][2:].replace("-", "_"): a for a in parser._actions if a.option_strings}
    unknown = sorted(set(options) - set(actions))
    if unknown:
        raise TypeError(f"unknown stack options {unknown}")
    parsed: dict[str, object] = {}
    for name, value in options.items():
        action = actions[name]
        if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction):
            if value:
                parsed[action.dest] = action.const  # a switch such as --enforce-eager
            continue
        parsed[action.dest] = _typed(action, value)
    return parsed


def _typed(action: argparse.Action, value: object) -> object:
    """`value` as parsing the flag would give it: text (alone, or in a list for a repeatable flag) goes
    through the flag's type, so a path given as a string is a Path like the flag's."""
    if action.type is None or not callable(action.type):
        return value
    if isinstance(value, str):
        return action.type(value)
    if isinstance(value, list | tuple):
        return [action.type(v) if isinstance(v, str) else v for v in value]
    return value
