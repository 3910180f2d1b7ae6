"""The kernel suites' `results.json`, through `bench/common/results.py` like every other suite's.

    write_report(out, "kernels", report, "lora")

writes {"suite", "machine", "commit", "records", "targets", ...}: the records are the report's rows
(`report[rows_key]`), the machine names the GPU (`gpu`) when the run had one, and the rest of the
report (meta, attention rows, summary, markdown) rides along under its own keys. The targets come
from the report's summary, each {"name", "goal", "value", "met"}; a dry run's times are the
interpreter's, so its timing targets say `met: None` (only correctness is judged).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraserve.bench.common.results import target, write_results

ROOFLINE_FACTOR = 2.0  # LoRA decode b64 distinct r16 within 2x of the roofline


def targets(summary: dict[str, Any], dry_run: bool) -> list[dict[str, Any]]:
    """The kernel targets the summary covers: LoRA within 2x of the roofline, Triton faster than
    gather-then-bmm in every case, Triton agreeing with the torch references (LoRA, and attention
    when it ran)."""
    out = []
    if "within_2x_roofline" in summary:
        head = summary.get("lora_decode_b64_distinct_r16") or {}
        name = f"LoRA {head.get('case', 'decode r16 b64 distinct')}, Triton time / roofline"
        met = None if dry_run or not head else summary["within_2x_roofline"]
        out.append(target(name, f"<= {ROOFLINE_FACTOR:g}", head.get("x_roofline"), met))
    if "faster_than_bmm_everywhere" in summary:
        slower = summary["not_faster_than_bmm"]
        met = None if dry_run else summary["faster_than_bmm_everywhere"]
        out.append(target("LoRA cases where Triton is not faster than gather-then-bmm (eager)", "none", slower, met))
    correct = [summary[k] for k in ("lora_all_correct", "attention_all_correct") if k in summary]
    if correct:
        out.append(target("Triton agrees with the torch references", "every case", all(correct), all(correct)))
    return out


def write_report(out: Path, suite: str, report: dict[str, Any], rows_key: str) -> Path:
    """`out/results.json` for a kernel suite's report (see the module docstring); returns its path."""
    meta = report["meta"]
    extra = {k: v for k, v in report.items() if k != rows_key}
    gpu = None if meta.get("dry_run") else {"gpu": meta.get("device")}
    summary = report.get("summary") or {}
    return write_results(
        out, suite, report[rows_key], machine_extra=gpu, targets=targets(summary, bool(meta.get("dry_run"))), **extra
    )
