"""Where the profiled scheduler's time went, by source: `--cp-profile`'s figures in results.json.

The scheduler runs under cProfile; its own time per function (`tottime`) is summed by where the
function lives: a file of this repository (`scheduler/cluster.py`), an installed package (`grpc`,
`zmq`, `msgspec`), a standard-library package (`asyncio`), or built-in and C functions, the event
loop's wait for I/O apart. Each source's share is of the whole profiled time (the wait included),
largest first.
"""

from __future__ import annotations

import pstats
import sysconfig
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
IDLE = "waiting for I/O (select/epoll)"


def source(filename: str, name: str = "") -> str:
    """The source a profiled function belongs to, from its file (and, for a built-in, its name:
    the event loop's wait for I/O is idle time, not work, and is told apart)."""
    if filename.startswith("~") or filename.startswith("<"):
        return IDLE if "of 'select." in name else "built-in and C functions"
    path = Path(filename)
    if "site-packages" in path.parts:
        return path.parts[path.parts.index("site-packages") + 1].removesuffix(".py")
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if path.is_relative_to(STDLIB):
        return path.relative_to(STDLIB).parts[0].removesuffix(".py")
    return filename


def split(profile: Path, top: int = 15) -> dict:
    """The profile's total seconds and its `top` sources, each {"source", "seconds", "share"}."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    by_source: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        by_source[source(filename, name)] += tottime
    total = sum(by_source.values())
    ranked = sorted(by_source.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {
        "total_s": round(total, 3),
        "sources": [
            {"source": s, "seconds": round(t, 3), "share": round(t / total, 4) if total else 0.0} for s, t in ranked
        ],
    }
