"""The CPU kernels written in C (`kernels/csrc/`), built once per machine and loaded with ctypes.

A source is compiled by the system's C compiler (`$CC`, else `cc`; `-O3 -march=native`) into
~/.cache/loraserve/kernels, as a file named after the source, the flags and the CPU's features (what
-march=native compiles for), written under a temporary name and renamed, so concurrent workers never
load half a file. ctypes calls release the GIL. Where nothing builds it, `library` is None and says why
once in the log; the kernel's caller then runs its torch path. The kernels compute on one thread, so
they are used where torch does (`one_thread`: `--torch-threads 1`, as the CPU benchmarks run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
CACHE = Path.home() / ".cache" / "loraserve" / "kernels"


@functools.cache
def library(source: str) -> ctypes.CDLL | None:
    """`csrc/<source>` built and loaded, or None where it cannot be (logged)."""
    try:
        return ctypes.CDLL(str(_built(SOURCES / source)))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("%s unavailable (%s): the torch path runs", source, e)
        return None


def one_thread(*tensors: torch.Tensor) -> bool:
    """Whether a C kernel may take these tensors: float32 on the CPU, torch on one thread."""
    return torch.get_num_threads() == 1 and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _built(source: Path) -> Path:
    """The shared library for this source, flags and CPU, built if it is not in the cache yet."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(source.read_bytes() + " ".join((compiler, *FLAGS, _cpu())).encode()).hexdigest()[:16]
    target = CACHE / f"{source.stem}-{key}.so"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], check=True, capture_output=True)
            built.replace(target)
    return target


def _cpu() -> str:
    """The CPU's architecture and features."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"
