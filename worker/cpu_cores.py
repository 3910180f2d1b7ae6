"""Pinning a CPU worker's computation to cores, as vLLM's CPU backend binds its OpenMP threads
(`--cpu-cores`).

    cores = parse_cores("1,4-5")        # frozenset({1, 4, 5}); InvalidConfigError naming what is wrong
    with pinned(cores):                 # this thread, and the C threads it starts meanwhile
        engine = Engine(...)            #   (torch's intra-op threads; Python threads are freed after)
    service = WorkerService(engine)     # threads started here: on any core
    pin(cores)                          # the step loop (its warm-up)
    step_cores = StepCores(cores)       # the loop, each turn: use(idle=True) to wait for work, idle=False to step

Linux gives each new thread its creator's affinity. The worker pins its main thread while it loads the
engine, so that torch's threads start on those cores, lets the threads that only wait on sockets (its
I/O thread, which sends the heartbeats, ZMQ's own, the fetches and builds) start anywhere, then pins
the step loop while it steps. The step then runs where nothing else of the stack is put, its weights in
that core's caches. Empty `cores`: nothing is pinned.

An idle step loop is not pinned (`StepCores`): it wakes every few milliseconds, briefly, to look for
work, and a thread that mostly sleeps on a core a busy process computes on can wait there for seconds
before the kernel runs it (measured: 8.3 s on the 2-core VM of `docs/benchmarks.md`, vLLM computing on
the worker's core while the worker was idle, with the other core idle). Each wake-up takes the
interpreter's lock, and a thread that holds it while it waits to run holds up every other thread of the
process: the I/O thread's heartbeats stopped and the scheduler took the live worker for dead. Unpinned,
the idle loop runs on whichever core is free; stepping, it runs without pause on its own cores, where the
kernel gives it at least an even share. For the same reason no other Python thread stays pinned: those
started while the worker loaded (a progress bar's monitor, which wakes every 10 s, thread pools) are freed
when it has loaded, and those a pinned step loop starts (a pool's workers, started on first use) when it
next waits for work (`free_python_threads`).

With `--pin-all-threads` every thread is then put on those cores too: the socket threads share the
interpreter with the step loop, and one that holds it while descheduled on a busy other core makes the
step wait (measured served: ITL p50 18.6 ms against 19.2-19.8 ms, `docs/benchmarks.md`, the peer suite).
"""

from __future__ import annotations

import contextlib
import os
import threading
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


class StepCores:
    """The step loop's cores: `cores` while it steps, `idle_cores` (default: those it may use now) while it
    waits for work (see the module docstring). `use` sets the calling thread's cores only when they change;
    with no `cores` it sets nothing."""

    def __init__(self, cores: frozenset[int], idle_cores: frozenset[int] | None = None):
        self.cores = cores
        self.idle_cores = frozenset(os.sched_getaffinity(0)) if idle_cores is None else idle_cores
        self._now: frozenset[int] | None = None  # what this loop last set

    def use(self, idle: bool) -> None:
        cores = self.idle_cores if idle else self.cores
        if self.cores and cores != self._now:
            os.sched_setaffinity(0, cores)
            if idle:  # the Python threads it started while pinned (a pool's workers, on first use) inherited them
                free_python_threads(cores)
            self._now = cores


def free_python_threads(cores: set[int] | frozenset[int], started_after: set[int] | None = None) -> None:
    """Every Python thread but the calling one (of those not in `started_after`, native ids, if given) on
    `cores`: a thread started by a pinned one inherits its cores, and a Python thread must not wait to run
    on a busy core while it holds the interpreter (the module docstring). Threads that never take the
    interpreter (torch's) are not Python threads and keep theirs."""
    me = threading.get_native_id()
    for thread in threading.enumerate():
        native = thread.native_id
        if native is not None and native != me and (started_after is None or native not in started_after):
            with contextlib.suppress(ProcessLookupError, OSError):  # it ended meanwhile
                os.sched_setaffinity(native, cores)


@contextlib.contextmanager
def pinned(cores: frozenset[int]) -> Iterator[None]:
    """`pin(cores)` for the block; then the calling thread's cores as they were before it, and the same for
    the Python threads started meanwhile (a progress bar's monitor, thread pools): the threads of C
    libraries started in the block (torch's) keep `cores`."""
    before, known = os.sched_getaffinity(0), {t.native_id for t in threading.enumerate()}
    pin(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        if cores:
            free_python_threads(before, started_after={n for n in known if n is not None})


def _ranges(cores: set[int]) -> str:
    ordered = sorted(cores)
    return ",".join(str(c) for c in ordered) if len(ordered) < 8 else f"{ordered[0]}-{ordered[-1]}"
