"""The suites' flags: `loraserve.config_cli` over each suite's settings dataclass, plus two forms of flag
the benchmark's command lines had before that module existed.

A field's metadata may say, besides what `config_cli` reads:

- "nargs": the flag takes several values at once (`--ranks 8 16`, "+", or exactly 2 for a range), its
  value a list; given again, the last one wins. The field is a `tuple[X, ...]` (or `tuple[X, ...] | None`,
  None meaning "the preset's"). "metavars" names each of a fixed number of values (`LOW HIGH`).
- "required": the flag must be given (a field with no default).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from loraserve.config_cli import add_config_arguments, config_from_args

__all__ = ["add_settings", "config_from_args"]


def add_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, **kwargs: Any) -> None:
    """A flag for every setting of `cls` (`config_cli.add_config_arguments`), with "nargs" and "required"."""
    add_config_arguments(parser, cls, **kwargs)
    extra = {f.name: f for f in dataclasses.fields(cls) if {"nargs", "required"} & set(f.metadata)}
    for action in parser._actions:
        field = extra.get(action.dest)
        if field is None or not action.option_strings:
            continue
        if field.metadata.get("required"):
            action.required = action.default is None  # an environment twin gives it
        if "nargs" in field.metadata:  # one flag, several values: stored, not appended
            action.__class__ = argparse._StoreAction
            action.nargs = field.metadata["nargs"]
            action.metavar = field.metadata.get("metavars", action.metavar)
            if field.default is None and action.default == []:  # None: "the preset's", as the field says
                action.default = None
                action.help = (action.help or "").replace("; default []]", "]")  # the help showed the []
            elif action.default is None and field.default is not dataclasses.MISSING:
                action.default = list(field.default)
