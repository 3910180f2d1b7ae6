"""Every flag has an environment twin; bad values give a clear message."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from loraserve.cli import COMMANDS, build_parser
from loraserve.flags import EnvArgumentParser, env_name


def _parser() -> EnvArgumentParser:
    parser = EnvArgumentParser()
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return parser


def test_env_twin_sets_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("LORASERVE_MAX_BATCH_SIZE", "32")
    monkeypatch.setenv("LORASERVE_PREFETCH", "false")
    assert _parser().parse_args([]).max_batch_size == 32
    assert _parser().parse_args([]).prefetch is False
    assert _parser().parse_args(["--max-batch-size", "4"]).max_batch_size == 4
    assert "LORASERVE_MAX_BATCH_SIZE" in _parser().format_help()


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("LORASERVE_MAX_BATCH_SIZE", "lots", "invalid literal"),
        ("LORASERVE_DEVICE", "tpu", "choose one of"),
        ("LORASERVE_PREFETCH", "maybe", "expected one of"),
    ],
)
def test_bad_env_values_are_explained(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit, match=message):
        _parser()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_subcommand_builds_and_every_flag_has_a_twin(command):
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert flags, command
    text = sub.format_help()
    for flag in flags:
        if not flag.startswith("--no-"):
            assert env_name(flag) in " ".join(text.split()), flag


def test_help_runs_as_a_console_script():
    out = subprocess.run([sys.executable, "-m", "loraserve.cli", "--help"], capture_output=True, text=True, check=True)
    for command in COMMANDS:
        assert command in out.stdout


def test_repeatable_flags_read_comma_separated_env(monkeypatch):
    monkeypatch.setenv("LORASERVE_PRELOAD", "a=/x,b=/y")
    parser = EnvArgumentParser()
    parser.add_argument("--preload", action="append", default=[])
    assert parser.parse_args([]).preload == ["a=/x", "b=/y"]
    assert parser.parse_args(["--preload", "c=/z"]).preload == ["a=/x", "b=/y", "c=/z"]


def test_list_values_from_env_are_checked_against_choices(monkeypatch):
    parser = EnvArgumentParser()
    monkeypatch.setenv("LORASERVE_SYSTEMS", "a,b")
    parser.add_argument("--systems", nargs="+", choices=["a", "b", "c"])
    assert parser.parse_args([]).systems == ["a", "b"]
    monkeypatch.setenv("LORASERVE_SYSTEMS", "a,zzz")
    with pytest.raises(SystemExit, match="choose one of"):
        EnvArgumentParser().add_argument("--systems", nargs="+", choices=["a", "b", "c"])
