"""Supervision of a role's long-running tasks: one that dies takes the role down, loudly.

An asyncio task that raises keeps its exception to itself until someone awaits it. A role whose
receive loop died that way lives on as a zombie: the process is up, gRPC health says SERVING,
and nothing it should do happens any more. So every long-running task of a role runs under
`supervise`: when one ends before the role was asked to stop — by an exception or by returning —
its traceback is logged, the role's health is set to NOT_SERVING (`on_failure`, `health_off`), the other tasks
are cancelled, and `RoleFailed` is raised, which `loraserve.process.run_service` turns into exit
code 1. A process manager (or `loraserve up`) then sees a dead role and can restart it.

Work done on threads (the adapter store's data plane) is watched from the loop with `watch_thread`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from loraserve.errors import LoraserveError

log = logging.getLogger(__name__)


class RoleFailed(LoraserveError):
    """A long-running task of a role ended unexpectedly; the role must exit non-zero."""


async def run_tasks(tasks: dict[str, Coroutine[Any, Any, Any]], stop: asyncio.Event | threading.Event | None) -> None:
    """Run `tasks` until `stop` is set (forever when None), then cancel them and return.

    If a task ends first, the others are cancelled and RoleFailed is raised from its exception.
    """
    running = {asyncio.create_task(coro, name=name): name for name, coro in tasks.items()}
    stopper = asyncio.create_task(_stopped(stop), name="stop")
    try:
        done, _ = await asyncio.wait({*running, stopper}, return_when=asyncio.FIRST_COMPLETED)
        dead = next((t for t in running if t in done), None)
        if dead is not None:
            raise _failure(running[dead], dead)
    finally:
        pending = [*running, stopper]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def supervise(
    role: str,
    tasks: dict[str, Coroutine[Any, Any, Any]],
    stop: asyncio.Event | threading.Event | None,
    on_failure: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """`run_tasks`, and when one dies: log its traceback, await `on_failure()` (health NOT_SERVING), re-raise."""
    try:
        await run_tasks(tasks, stop)
    except RoleFailed as e:
        log.critical("%s: %s; the role stops", role, e, exc_info=e.__cause__ or e)
        if on_failure is not None:
            try:
                await on_failure()
            except Exception:
                log.exception("%s: could not report the failure", role)
        raise


def health_off(health: Any, service_names: list[str], hold_s: float = 0.5) -> Callable[[], Awaitable[None]]:
    """`on_failure` for a gRPC role: health NOT_SERVING, held `hold_s` before the server stops, so a
    health probe sees the role report itself down rather than only a refused connection."""

    async def off() -> None:
        from loraserve.grpc_utils import set_serving  # grpc is heavy; supervise itself does not need it

        await set_serving(health, service_names, False)
        await asyncio.sleep(hold_s)

    return off


async def watch_thread(thread: threading.Thread, failure: Callable[[], BaseException | None], poll_s: float = 0.1):
    """Return never while `thread` lives; when it has ended, raise what it failed with (or RoleFailed)."""
    while thread.is_alive():
        await asyncio.sleep(poll_s)
    raise failure() or RoleFailed(f"thread {thread.name} ended")


def _failure(name: str, task: asyncio.Task) -> RoleFailed:
    if task.cancelled():
        return RoleFailed(f"task {name} was cancelled")
    exc = task.exception()
    if isinstance(exc, RoleFailed):
        return exc
    if exc is None:
        return RoleFailed(f"task {name} ended")
    failed = RoleFailed(f"task {name} died: {type(exc).__name__}: {exc}")
    failed.__cause__ = exc
    return failed


async def _stopped(stop: asyncio.Event | threading.Event | None) -> None:
    if stop is None:
        await asyncio.Event().wait()
    elif isinstance(stop, asyncio.Event):
        await stop.wait()
    else:
        while not stop.is_set():
            await asyncio.sleep(0.1)
