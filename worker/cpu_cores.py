"""Pinning a CPU worker's computation to cores, as vLLM's CPU backend binds its OpenMP threads
(`--cpu-cores`).

    cores = parse_cores("1,4-5")        # frozenset({1, 4, 5}); InvalidConfigError naming what is wrong
    with pinned(cores):                 # this thread, and the threads it starts meanwhile
        engine = Engine(...)            #   (torch's intra-op threads)
    service = WorkerService(engine)     # threads started here: on any core
    pin(cores)                          # the step loop

Linux gives each new thread its creator's affinity. The worker pins its main thread while it loads the
engine, so that torch's threads start on those cores, lets the threads that only wait on sockets (its
I/O thread, which sends the heartbeats, ZMQ's own, the fetches and builds) start anywhere, then pins
the step loop. The step then runs where nothing else of the stack is put, its weights in that core's
caches, and a busy neighbour on those cores cannot starve the heartbeats. Empty `cores`: nothing is pinned.

With `--pin-all-threads` every thread is then put on those cores too: the socket threads share the
interpreter with the step loop, and one that holds it while descheduled on a busy other core makes the
step wait (measured served: ITL p50 18.6 ms against 19.2-19.8 ms, `docs/benchmarks.md`, the peer suite).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from loraserve.errors import InvalidConfigError


def parse_cores(text: str) -> frozenset[int]:
    """The cores a list such as "1", "0-3" or "1,4-5" names (empty: none); each must be one this process
    may run on."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise InvalidConfigError(f'cpu_cores: {part!r} is not a core or a range of cores such as "2-5"')
        cores.update(range(int(first), int(last) + 1))
    allowed = os.sched_getaffinity(0)
    if cores - allowed:
        raise InvalidConfigError(
            f"cpu_cores: cores {sorted(cores - allowed)} are not among this process's {_ranges(allowed)}"
        )
    return frozenset(cores)


def pin(cores: frozenset[int]) -> None:
    """Run the calling thread, and the threads it starts from now on, on `cores` only (empty: as it is)."""
    if cores:
        os.sched_setaffinity(0, cores)


def pin_every_thread(cores: frozenset[int]) -> None:
    """Every thread of this process on `cores` (`--pin-all-threads`); threads started later inherit their
    creator's cores."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


@contextlib.contextmanager
def pinned(cores: frozenset[int]) -> Iterator[None]:
    """`pin(cores)` for the block; the calling thread's cores as they were after it."""
    before = os.sched_getaffinity(0)
    pin(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _ranges(cores: set[int]) -> str:
    ordered = sorted(cores)
    return ",".join(str(c) for c in ordered) if len(ordered) < 8 else f"{ordered[0]}-{ordered[-1]}"
