"""One constraint compiler process, seen from the gateway: started, asked, killed, its end read.

`CompilerProcess.start` runs `python -m loraserve.gateway.constraint_child` with one end of a socket
pair as its stdin, sends it the tokenizer (`Start`) and waits until it answers `Ready`; `ask` sends
one `Compile` and reads the reply (`constraint_wire.py`); `death` says how the process ended
("SIGSEGV", "exit code 1"). The pool around these is `constraints.py`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec

from loraserve.errors import UnavailableError
from loraserve.gateway.constraint_wire import Compile, Ready, frame, read_reply

CHILD_MODULE = "loraserve.gateway.constraint_child"
START_TIMEOUT_S = 120.0  # a child building the LLTokenizer of the largest vocabularies


class CompilerProcess:
    """One compiler process and the gateway's end of its socket pair."""

    def __init__(self, process: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.process, self.reader, self.writer = process, reader, writer
        self.pid = process.pid
        self.killed = False

    @classmethod
    async def start(cls, start_frame: bytes) -> CompilerProcess:
        """A child that built its tokenizer (UnavailableError saying why if it could not)."""
        ours, theirs = socket.socketpair()
        try:  # spawned from the event loop's thread: PDEATHSIG follows the thread that forked the child
            process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE],
                stdin=theirs,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                env=os.environ | {"RUST_BACKTRACE": "0"},  # a native abort ends at once, without a backtrace
            )
        except OSError as e:
            ours.close()
            raise UnavailableError(f"the constraint compiler could not start: {e}") from None
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        child = cls(process, reader, writer)
        try:
            writer.write(start_frame)
            await writer.drain()
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await read_reply(reader)
            if not isinstance(ready, Ready):
                raise ValueError(f"it answered {type(ready).__name__}")
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, msgspec.DecodeError) as e:
            death = await child.death()  # how it ended (killed if it still runs)
            raise UnavailableError(f"the constraint compiler did not start ({death}; {type(e).__name__})") from None
        return child

    @property
    def alive(self) -> bool:
        return not self.killed and self.process.poll() is None

    async def ask(self, job: Compile) -> object:
        self.writer.write(frame(job))
        await self.writer.drain()
        return await read_reply(self.reader)

    def kill(self) -> None:
        self.killed = True
        if self.process.poll() is None:
            self.process.kill()
        self.writer.close()

    async def death(self, wait_s: float = 2.0) -> str:
        """How the process ended ("SIGSEGV", "exit code 1"), once it has (killed after `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                deadline = float("inf")
            await asyncio.sleep(0.01)
        self.writer.close()
        code = self.process.returncode
        if code >= 0:
            return f"exit code {code}"
        name = signal.Signals(-code).name
        if -code in (signal.SIGABRT, signal.SIGKILL) and not self.killed:
            name += ", most likely over its memory limit"
        return name
