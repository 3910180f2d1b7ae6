"""Process plumbing every role's `main` uses: title, dying with the parent, graceful stop signals."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from loraserve.config_cli import add_config_arguments, config_from_args, config_to_argv, flags_of

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


DRAIN_TIMEOUT_S = 30.0  # `--drain-timeout` of the gateway, the worker and `loraserve up`


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every role has: internal keys, tracing (a group of its own), metrics."""
    from loraserve.internal_auth import InternalAuthSettings
    from loraserve.metrics import MetricsSettings
    from loraserve.telemetry import TracingSettings

    add_config_arguments(parser, InternalAuthSettings)
    add_config_arguments(parser.add_argument_group("tracing"), TracingSettings)
    add_config_arguments(parser, MetricsSettings)


def service_argv(args: argparse.Namespace, **chosen: object) -> list[str]:
    """Those flags again, for a role `loraserve up` starts: the `chosen` values, and every other one of
    `args` not at its default."""
    from loraserve.internal_auth import InternalAuthSettings
    from loraserve.metrics import MetricsSettings
    from loraserve.telemetry import TracingSettings

    argv: list[str] = []
    for cls in (InternalAuthSettings, TracingSettings, MetricsSettings):
        own = {name: value for name, value in chosen.items() if name in {f.dest for f in flags_of(cls)}}
        argv += config_to_argv(config_from_args(cls, args, **own), changed_only=True, always=set(own))
    return argv


def set_title(title: str) -> None:
    """The process's title, as `ps` and the abuse suite's role watch see it."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # optional nicety
        pass


def die_with_parent(signum: int) -> None:
    """Linux: have the kernel send `signum` to this process when its parent dies (prctl PDEATHSIG), and
    send it now if the parent died already."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)


def become_service(name: str) -> threading.Event:
    """Set the process title, turn SIGTERM/SIGINT into an Event, and die with the parent when asked.

    `loraserve up` sets LORASERVE_DIE_WITH_PARENT=1 for its children (Linux prctl PDEATHSIG), so no
    role outlives the launcher; a role started alone (a container's main process) does not.

    Returns the event that is set when the process should stop.
    """
    set_title(f"loraserve-{name}")
    if os.environ.get("LORASERVE_DIE_WITH_PARENT") == "1":
        die_with_parent(signal.SIGTERM)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("%s: received %s, stopping", name, signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


async def until_stopped(stop: threading.Event, poll_s: float = 0.1) -> None:
    """Await the stop Event from asyncio code (signal handlers set it from the main thread)."""
    import asyncio

    while not stop.is_set():
        await asyncio.sleep(poll_s)


def run_service(
    name: str,
    args,
    serve: Callable[[threading.Event], Coroutine[Any, Any, None] | None],
    title: str | None = None,
) -> int:
    """The `main` of every role: title, signals, tracing, metrics, and errors as one line.

    `serve(stop)` runs until the stop Event is set: an async function runs on uvloop (gateway,
    scheduler, adapter store), a plain one on this thread (the worker's step loop). A
    LoraserveError or socket error (a busy port, a bad flag value) ends the process with exit code
    1 and a one-line message; the traceback is logged at DEBUG level, for errors that happen after
    start-up. Anything else propagates. `title` names the process (default: `name`).
    """
    import uvloop
    import zmq

    from loraserve import telemetry
    from loraserve.errors import LoraserveError
    from loraserve.metrics import serve_metrics

    stop = become_service(title or name)
    telemetry.setup_tracing(name, args.trace_exporter, args.otlp_endpoint)
    try:
        serve_metrics(args, name)
        running = serve(stop)
        if running is not None:
            uvloop.run(running)
    except (LoraserveError, zmq.ZMQError) as e:
        log.error("%s: %s", name, e)
        log.debug("%s stopped by", name, exc_info=e)
        return 1
    finally:
        telemetry.shutdown_tracing()
    return 0
