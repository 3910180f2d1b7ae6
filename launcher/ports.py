"""Every address of a local stack, from one base port, and a block of free ports to put one on."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Ports:
    """Every address of a local stack, derived from one base port."""

    base: int

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.base}"

    @property
    def scheduler_workers(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 1}"

    @property
    def store(self) -> str:
        return f"127.0.0.1:{self.base + 2}"

    @property
    def store_data(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 3}"

    @property
    def tokens(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 4}"


def free_port_block(size: int) -> int:
    """A base port with `size` consecutive free ports on loopback (best effort: they may be taken later)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size >= 65000:
            continue
        taken: list[socket.socket] = []
        try:
            for port in range(base, base + size):
                taken.append(socket.socket())
                taken[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError("no block of free ports on 127.0.0.1")
