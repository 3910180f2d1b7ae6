"""Command-line flags with environment-variable twins.

Every `--some-flag` also reads `LORASERVE_SOME_FLAG` when not given on the command line (the flag
wins); help texts show the variable. Configuration dataclasses are built from the parsed flags in
each command's `main`, never at import time.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "LORASERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class EnvArgumentParser(argparse.ArgumentParser):
    def add_argument(self, *names: str, **kwargs: Any):
        return super().add_argument(*names, **_with_env(names, kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any):
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument
        group.add_argument = lambda *names, **kw: plain(*names, **_with_env(names, kw))
        return group


def _with_env(names: tuple[str, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs with the default taken from the flag's environment twin, and the twin named in the help."""
    flag = next((n for n in names if n.startswith("--")), None)
    if flag is None or kwargs.get("action") in ("help", "version"):
        return kwargs
    kwargs = dict(kwargs)
    var = env_name(flag)
    raw = os.environ.get(var)
    if raw is not None:
        kwargs["default"] = _from_env(var, raw, kwargs)
        kwargs["required"] = False
    help_text = kwargs.get("help", "")
    if help_text != argparse.SUPPRESS:
        shown = kwargs.get("default")  # a switch (store_const, default SUPPRESS) shows none: its setting's flag does
        hidden = shown in (None, False, "", argparse.SUPPRESS) or "%(default)" in help_text
        default = "" if hidden else f"; default {shown}"
        kwargs["help"] = f"{help_text} [env {var}{default}]".strip()
    return kwargs


def _from_env(var: str, raw: str, kwargs: dict) -> Any:
    action = kwargs.get("action")
    if action in ("store_true", "store_false", "store_const", argparse.BooleanOptionalAction):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise SystemExit(f"{var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        if action == "store_const":  # a switch: on sets its value, off leaves the setting's own default
            return kwargs["const"] if value in _TRUE else argparse.SUPPRESS
        return value in _TRUE
    kind = kwargs.get("type", str)
    many = kwargs.get("nargs") is not None or action in ("append", "extend")
    try:
        value = [kind(v) for v in raw.split(",") if v] if many else kind(raw)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{var}={raw!r}: {e}") from None
    choices = kwargs.get("choices")
    if choices is not None and any(v not in choices for v in (value if many else [value])):
        raise SystemExit(f"{var}={raw!r}: choose one of {', '.join(map(str, choices))}")
    return value
