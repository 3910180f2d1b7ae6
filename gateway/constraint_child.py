"""A constraint compiler: one of the gateway's sandbox processes (`constraints.py` starts and owns them).

`python -m loraserve.gateway.constraint_child`, its stdin one end of a socket pair (`constraint_wire.py`).
It names itself `loraserve-gateway-constraints`, dies with the gateway (Linux PDEATHSIG, and the
socket's end), writes no core file, and leaves Ctrl-C to the gateway. The first message (`Start`)
carries the model's tokenizer and the memory bound: the bound (RLIMIT_AS) is set before anything
is built, then the LLTokenizer is built once, then each `Compile` is answered in turn with
`Compiled` or `Refused` (`constraint_check.check_constraint`). When the gateway closes its end (it
stops, or killed the child it waited too long for), the child exits 0 without a word.

Checks run on one thread whose stack is COMPILE_STACK_BYTES, half the 8 MiB main-thread stack a
worker builds its matchers on: a grammar whose compiling recurses deep enough to overflow a worker's
stack overflows this one first (and kills only this process), with room to spare.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from loraserve.errors import InvalidRequestError
from loraserve.gateway.constraint_check import check_constraint
from loraserve.gateway.constraint_wire import Compile, Compiled, Ready, Refused, Start, receive, send
from loraserve.process import die_with_parent, set_title
from loraserve.structured import ll_tokenizer

TITLE = "loraserve-gateway-constraints"
COMPILE_STACK_BYTES = 4 << 20
_FIELD = "constraint"  # errors name this; the parent puts the request's own field in its place


def main() -> int:
    _become_child()
    sock = socket.socket(fileno=sys.stdin.fileno())
    try:
        return _serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the gateway closed its end (it stops, or gave up on us)
        return 0


def _serve(sock: socket.socket) -> int:
    """Start, then answer each Compile until the gateway closes its end (0), or 2 for a message out of turn."""
    start = receive(sock)
    if not isinstance(start, Start):
        print(f"{TITLE}: expected Start, got {type(start).__name__}", file=sys.stderr)
        return 2
    if start.memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (start.memory_bytes, start.memory_bytes))
    tokenizer = ll_tokenizer(start.tokenizer_json, start.vocab_size, start.eos_token_ids)
    del start
    threading.stack_size(COMPILE_STACK_BYTES)
    checker = ThreadPoolExecutor(1, thread_name_prefix="constraint-check")
    send(sock, Ready(os.getpid()))
    while (message := receive(sock)) is not None:
        if not isinstance(message, Compile):
            print(f"{TITLE}: expected Compile, got {type(message).__name__}", file=sys.stderr)
            return 2
        send(sock, checker.submit(answer, tokenizer, message).result())
    return 0


def answer(tokenizer, message: Compile) -> Compiled | Refused:
    """The reply to one Compile: its grammar, or why it is refused (without a field name)."""
    try:
        value = json.loads(message.text) if message.encoded else message.text
        return Compiled(check_constraint(tokenizer, message.kind, value, _FIELD))
    except InvalidRequestError as e:
        return Refused(e.problem)
    except RecursionError:
        return Refused("is nested too deeply to compile: flatten it")
    except MemoryError:
        return Refused("needs more memory to compile than the gateway allows (--constraint-memory-mib): simplify it")
    except Exception as e:  # whatever else a constraint makes go wrong is still the constraint's
        return Refused(f"could not be compiled: {type(e).__name__}: {str(e)[:300]}")


def _become_child() -> None:
    set_title(TITLE)
    die_with_parent(signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not leave a core file per attack
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway stops its children itself


if __name__ == "__main__":
    sys.exit(main())
