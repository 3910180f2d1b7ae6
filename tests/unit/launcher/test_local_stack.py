"""The test stack's options are `up`'s flags, given as the values parsing them would give."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loraserve.launcher.commands import add_arguments
from loraserve.launcher.local_stack import _as_parsed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_options_given_as_text_take_their_flags_types():
    parsed = _as_parsed(_parser(), {"adapter_root": "/tmp", "max_batch_size": 4, "enforce_eager": True})
    assert parsed["adapter_root"] == Path("/tmp") and isinstance(parsed["adapter_root"], Path)  # as --adapter-root
    assert parsed["max_batch_size"] == 4
    assert parsed["cuda_graphs"] == "off"  # a switch sets its setting


def test_an_option_that_is_no_flag_of_up_is_refused():
    with pytest.raises(TypeError, match="no_such_option"):
        _as_parsed(_parser(), {"no_such_option": 1})


def test_settings_a_stack_leaves_unset_take_their_defaults(tmp_path):
    from loraserve.launcher.commands import role_commands

    parser = _parser()
    args = parser.parse_args(["--model", str(tmp_path)])
    vars(args).update(_as_parsed(parser, {"policy": None, "max_queue_length": None, "worker_timeout": None}))
    scheduler = role_commands(args)["scheduler"]
    assert "--policy" not in scheduler and "--max-queue-length" not in scheduler  # the scheduler's defaults apply
