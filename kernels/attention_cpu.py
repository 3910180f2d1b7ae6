"""Paged decode attention in C, on the CPU in float32 (`kernels/csrc/decode_attention.c`).

A decode token's keys and values are read where they lie in the pool, each sequence's once for all
the query heads of a KV head, over its own context only: no gather into a padded batch and no SDPA
call per group. `attention_torch` uses it for decode groups in float32 on the CPU and is its
reference (tests/numerics/test_kernels_attention.py compares them).

The source is built once per machine by the system's C compiler (`cc -O3 -march=native`) into
~/.cache/loraserve/kernels (a file named after the source, the flags and the CPU's features, written
under a temporary name and renamed, so concurrent workers never load half a file) and loaded with
ctypes, whose calls release the GIL. Where no compiler builds it, `decode_kernel()` is None, says why
once in the log, and the torch path runs. It computes on one thread, so it is used where torch does
(`--torch-threads 1`, as the CPU benchmarks run); with more, SDPA spreads a group over them.

In the offline engine on a 52M Llama (8 layers, 12 heads, 4 KV heads of 64), a decode step of 8
sequences ran 5-6 % faster with it than with the gather and SDPA (32- and 300-token prompts): the
keys and values are read once, a page's rows in order, at about the rate one core reads memory.
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
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
CACHE = Path.home() / ".cache" / "loraserve" / "kernels"

Tensor = torch.Tensor
DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor], None]


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """`kernel(q, pool_layer, rows, first, last, scale, out)`: out[g] = attention of q[g] [H, D] over keys
    rows[g, first[g]:last[g]] and values rows[g, S + first[g]:S + last[g]] of pool_layer [rows, H_kv * D];
    q's last dimension contiguous, out [G, H, D] contiguous, rows int64 [G, 2 * S], first/last int64 [G]."""
    try:
        library = ctypes.CDLL(str(_built()))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("decode attention in C unavailable (%s): the torch path runs", e)
        return None
    function = library.decode_attention_f32
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    function.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    function.argtypes += [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]

    def kernel(q, pool_layer, rows, first, last, scale, out) -> None:
        seqs, heads, dim = q.shape
        kv_heads = pool_layer.shape[1] // dim
        scratch = torch.empty(heads * rows.shape[1] // 2, dtype=torch.float32)
        function(
            q.data_ptr(), q.stride(0), q.stride(1), pool_layer.data_ptr(), pool_layer.stride(0),
            rows.data_ptr(), rows.shape[1] // 2, first.data_ptr(), last.data_ptr(),
            seqs, heads, kv_heads, dim, scale, out.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip

    return kernel


def usable(q: torch.Tensor, pool_layer: torch.Tensor) -> bool:
    """Whether the C kernel can attend q over pool_layer here (then `decode_kernel()` is not None)."""
    return (
        q.device.type == "cpu"
        and q.dtype == pool_layer.dtype == torch.float32
        and q.stride(2) == 1
        and pool_layer.stride(1) == 1
        and torch.get_num_threads() == 1  # one thread, as it computes: SDPA spreads over more
        and decode_kernel() is not None
    )


def _built() -> Path:
    """The shared library for this source, flags and CPU, built if it is not in the cache yet."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS, _cpu())).encode()).hexdigest()[:16]
    target = CACHE / f"decode_attention-{key}.so"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True)
            built.replace(target)
    return target


def _cpu() -> str:
    """The CPU's architecture and features (what -march=native compiles for)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"
