"""The wire between the gateway and its constraint compilers (`constraints.py`, `constraint_child.py`).

A socket pair, one message per frame: a 4-byte big-endian length, then a msgspec Struct as msgpack,
tagged with its class name. Never pickle: the child decodes only these Structs, and the parent only
the replies. The conversation:

    parent → child   Start      once: the tokenizer the child builds its LLTokenizer from
    child → parent   Ready      the tokenizer is built (or the child exits, saying why on stderr)
    parent → child   Compile    one constraint
    child → parent   Compiled   its grammar
                     Refused    why it is not one (no field named: the parent names it)
"""

from __future__ import annotations

import asyncio
import socket
import struct

import msgspec

LENGTH = struct.Struct(">I")
MAX_REPLY_BYTES = 8 << 20  # a grammar (at most MAX_GRAMMAR_BYTES) or a reason, with room to spare
MAX_REQUEST_BYTES = 1 << 30  # a Start carries a tokenizer.json (tens of MB for the largest vocabularies)


class Start(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    tokenizer_json: str  # the model's tokenizer.json text
    vocab_size: int  # the model's (the logits' width), which may exceed the tokenizer's
    eos_token_ids: list[int]
    memory_bytes: int  # the child's address-space limit (RLIMIT_AS); 0: none


class Ready(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pid: int


class Compile(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    kind: str
    text: str  # the value as given when it is text, else its JSON (`encoded`)
    encoded: bool = False


class Compiled(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    grammar: str


class Refused(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    reason: str


ChildMessage = Start | Compile
ParentMessage = Ready | Compiled | Refused
_ENCODER = msgspec.msgpack.Encoder()
CHILD_DECODER = msgspec.msgpack.Decoder(ChildMessage)
PARENT_DECODER = msgspec.msgpack.Decoder(ParentMessage)


def frame(message: msgspec.Struct) -> bytes:
    body = _ENCODER.encode(message)
    return LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message: msgspec.Struct) -> None:
    """Blocking send (the child's side)."""
    sock.sendall(frame(message))


def receive(sock: socket.socket) -> ChildMessage | None:
    """Blocking receive of the parent's next message (the child's side); None once the parent is gone."""
    head = _read_exactly(sock, LENGTH.size)
    if head is None:
        return None
    (length,) = LENGTH.unpack(head)
    if length > MAX_REQUEST_BYTES:
        raise ValueError(f"a frame of {length} bytes is over {MAX_REQUEST_BYTES}")
    body = _read_exactly(sock, length)
    return None if body is None else CHILD_DECODER.decode(body)


async def read_reply(reader: asyncio.StreamReader) -> ParentMessage:
    """The child's next message (the parent's side); asyncio.IncompleteReadError once the child is gone."""
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_REPLY_BYTES:
        raise ValueError(f"a reply of {length} bytes is over {MAX_REPLY_BYTES}")
    return PARENT_DECODER.decode(await reader.readexactly(length))


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
