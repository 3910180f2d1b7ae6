"""A constraint compiler whose gateway closed its end of the socket exits 0, quietly: a gateway that stops,
or gives up on a child, must not leave a traceback per child in its log."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.gateway.constraint_process import CHILD_MODULE
from loraserve.gateway.constraint_wire import LENGTH, PARENT_DECODER, Compile, Ready, Start, frame
from loraserve.model_config import ModelConfig


def _start_frame() -> bytes:
    model = ModelConfig.from_dir(DEMO_MODEL_DIR)
    tokenizer = (DEMO_MODEL_DIR / "tokenizer.json").read_text()
    return frame(Start(tokenizer, model.vocab_size, list(model.eos_token_ids), 0))


def _reply(sock: socket.socket):
    """The child's next message, read blocking (the gateway reads it with asyncio)."""
    reader = sock.makefile("rb")
    (length,) = LENGTH.unpack(reader.read(LENGTH.size))
    return PARENT_DECODER.decode(reader.read(length))


@pytest.mark.parametrize("when", ["before Ready", "with a Compile in flight"])
def test_a_child_whose_gateway_closed_its_end_exits_quietly(when):
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=theirs, stderr=subprocess.PIPE)
    theirs.close()
    ours.sendall(_start_frame())
    if when == "with a Compile in flight":
        assert isinstance(_reply(ours), Ready)
        ours.sendall(frame(Compile("json_schema", '{"type": "object"}', encoded=True)))
    ours.close()
    _, stderr = child.communicate(timeout=60)
    assert (child.returncode, stderr.decode()) == (0, "")
