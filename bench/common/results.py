"""What a suite's `results.json` holds besides its records: the suite, the machine and the commit.

    write_results(args.out, "prefix", records, threads=args.threads, ratios=summary)
    publish(args.out, "prefix", records, threads=args.threads, targets=verdicts)   # prints, then writes if --out

writes `{"suite", "machine", "commit", "records", ...extra}`, every suite's results.json: the
machine's CPU model and count, platform, load averages (other processes inflate timings), memory,
torch version and the torch threads the suite ran with; the commit is `git describe --always
--dirty` of this checkout (None outside one). A suite's computed targets are `target(...)`s, or
`judged(...)`s where the goal is a comparison with a number, written once.
"""

from __future__ import annotations

import json
import operator
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine(threads: int | None = None) -> dict:
    """The machine a figure came from."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    torch = sys.modules.get("torch")
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1) if pages else None,
        "platform": platform.platform(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "torch": getattr(torch, "__version__", None),
        "threads": threads,
    }


def cpu_fields() -> dict:
    """The CPUs as the calibration, chaos, abuse, scheduling and control-plane figures name them."""
    about = machine()
    return {
        "cpus": about["cores"],
        "cpu_model": about["cpu"],
        "platform": about["platform"],
        "loadavg": about["loadavg"],
    }


def target(name: str, goal: str, value: object, met: bool | None) -> dict:
    """One of a suite's targets, as results.json's `targets` holds them."""
    return {"name": name, "goal": goal, "value": value, "met": met}


COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def judged(name: str, goal: str, value: float | None, missing: bool | None = False) -> dict:
    """A target whose goal compares with a number (`"<= 1.5"`, `">= 3"`), judged against it: met when `value`
    satisfies it; without a value, `missing` (missed, or None: not judged)."""
    op, bound = goal.split()
    return target(name, goal, value, missing if value is None else COMPARE[op](value, float(bound)))


def commit() -> str | None:
    """This checkout's commit (`-dirty` with uncommitted changes), or None outside a git checkout."""
    try:
        describe = ["git", "describe", "--always", "--dirty"]
        out = subprocess.run(describe, cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_results(
    out: Path, suite: str, records: list, threads: int | None = None, machine_extra: dict | None = None, **extra
) -> Path:
    """`out/results.json` for `suite`; returns its path. `machine_extra` adds to (and wins over) the
    machine's fields: a suite's own ones, such as the GPU it ran on."""
    out.mkdir(parents=True, exist_ok=True)
    about = machine(threads) | (machine_extra or {})
    payload = {"suite": suite, "machine": about, "commit": commit(), "records": records, **extra}
    path = out / "results.json"
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def suite_results(suite: str, out: Path, *argv: str) -> dict:
    """`loraserve bench --suite SUITE --out OUT ARGV` run in this process (a suite that runs another);
    the results.json it wrote."""
    from loraserve.bench import cli

    cli.run(["--suite", suite, "--out", str(out), *argv])
    return json.loads((out / "results.json").read_text())


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as JSON lines (a suite's per-request or per-stream file beside results.json)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def publish(
    out: Path | None, suite: str, records: list, threads: int | None = None, machine_extra: dict | None = None, **extra
) -> Path | None:
    """What every suite does last: print each of its targets (`extra["targets"]`), then, given `out`,
    write `out/results.json` (`write_results`) and say where. Returns its path (None without `out`)."""
    for t in extra.get("targets") or []:
        verdict = {True: "met", False: "MISSED"}.get(t["met"], "not judged")
        print(f"target {t['name']}: {t['value']} (goal {t['goal']}): {verdict}")
    if out is None:
        return None
    path = write_results(Path(out), suite, records, threads, machine_extra, **extra)
    print(f"results: {path}")
    return path
