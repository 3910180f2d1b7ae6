"""A process's CPU time (user + system, every thread it ran), to the nanosecond: psutil and /proc count it
in clock ticks (10 ms on Linux), in which a short, cheap stretch of work reads as 0 or as a whole tick.

    process_cpu_seconds(pid)     # OSError (ProcessLookupError) or psutil.Error once the process is gone
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import psutil

try:  # the process CPU-time clocks of POSIX's `clock_getcpuclockid` (Linux, the BSDs; not macOS)
    _getcpuclockid = ctypes.CDLL(ctypes.util.find_library("c")).clock_getcpuclockid
    _getcpuclockid.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_int))
except (OSError, AttributeError):
    _getcpuclockid = None


def process_cpu_seconds(pid: int) -> float:
    """The CPU seconds process `pid` has used so far (in psutil's ticks where the C library has no CPU clocks)."""
    if _getcpuclockid is None:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    clock = ctypes.c_int()
    if error := _getcpuclockid(pid, ctypes.byref(clock)):
        raise OSError(error, f"clock_getcpuclockid({pid})")
    return time.clock_gettime(clock.value)
