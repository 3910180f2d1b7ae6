"""A server's process tree, as the peer suite measures and waits for it: CPU time read from /proc,
and an HTTP health check. Linux only (both servers run here).

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
from pathlib import Path
from typing import Protocol


class Server(Protocol):
    """A running server as the suite drives it: its HTTP port on 127.0.0.1, its process trees' roots."""

    port: int

    @property
    def pids(self) -> list[int]: ...

    def alive(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...


TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads); 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on: comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: the 14th and 15th


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def tree(roots: Iterable[int]) -> list[int]:
    """`roots` and every live descendant."""
    seen: list[int] = []
    pending = list(roots)
    while pending:
        pid = pending.pop()
        if pid in seen or not Path(f"/proc/{pid}").exists():
            continue
        seen.append(pid)
        pending += _children(pid)
    return seen


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds used so far by the live processes of the trees under `roots` (a process that
    exited between two readings takes its time with it: servers keep theirs)."""
    return sum(_cpu_seconds(pid) for pid in tree(roots))


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
