"""A server's process tree, as the peer suite measures and waits for it: CPU time (each process's own CPU clock),
and an HTTP health check.

    cpu = tree_cpu_seconds([server.pid])        # user + system seconds of it and every descendant
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Protocol

import psutil

from loraserve.bench.common.cpu_clock import process_cpu_seconds


class Server(Protocol):
    """A running server as the suite drives it: its HTTP port on 127.0.0.1, its process trees' roots."""

    port: int

    @property
    def pids(self) -> list[int]: ...

    def alive(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...


def tree(roots: Iterable[int]) -> list[psutil.Process]:
    """`roots` and every live descendant."""
    found: list[psutil.Process] = []
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
    return found


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of the trees under `roots` (a process
    that exited between two readings takes its time with it: servers keep theirs)."""
    total = 0.0
    for process in tree(roots):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            total += process_cpu_seconds(process.pid)
    return total


def wait_healthy(
    url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True, interval_s: float = 2.0
) -> float:
    """Poll GET `url` until it answers 200; returns the seconds waited. TimeoutError past `timeout_s`,
    RuntimeError as soon as `alive()` says the server is gone."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (OSError, urllib.error.URLError):
            pass
        if not alive():
            raise RuntimeError(f"the server exited before {url} answered")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(interval_s)


def signal_group(process: subprocess.Popen, signal: int) -> None:
    """Send `signal` to the process group that `process` leads (started with start_new_session)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal)


def stop_group(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group that `process` leads (started with start_new_session), SIGKILL it
    after `timeout_s`."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, 15)
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass
