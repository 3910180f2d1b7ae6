"""The kernels suite's reports: the GPU suite's sweep (`run_suite`: LoRA and attention at the suite's
sizes), the command line's sweep (`run_sweep`), their text table, summary of the targets and Markdown.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from loraserve.bench.common.stats import ratio
from loraserve.bench.common.tables import fmt, markdown_table
from loraserve.bench.suites.kernels import attention as attention_bench
from loraserve.bench.suites.kernels.attention import attention_markdown
from loraserve.bench.suites.kernels.device import ensure_interpreter, suite_meta
from loraserve.bench.suites.kernels.lora import SUITE_BUDGET_S, Case, LoraConfig, Result, benchmark, format_table
from loraserve.bench.suites.kernels.results import ROOFLINE_FACTOR
from loraserve.bench.suites.kernels.timing import cuda_timers, wall_timers


def suite_config(dry_run: bool) -> LoraConfig:
    """The suite's sweep; tiny shapes for the dry run (CPU, interpreter)."""
    if dry_run:
        return LoraConfig(
            ranks=[4, "mixed"],
            batch_sizes=[1, 3],
            popularity=["distinct", "identical"],
            prefill_len=5,
            hidden=64,
            row_width=32,
            rows_per_page=8,
            mixed_ranks=(2, 4, 8),
        )
    return LoraConfig()


def _headline(results: list[Result], want: Case) -> Result | None:
    """The wanted case's row, else the closest stand-in (dry run): decode, distinct, smallest int rank,
    largest batch."""
    measured = [r for r in results if r.error is None]
    exact = [
        r
        for r in measured
        if (r.phase, r.rank, r.batch_size, r.popularity) == (want.phase, want.rank, want.batch_size, want.popularity)
    ]
    if exact:
        return exact[0]
    similar = [r for r in measured if r.phase == want.phase and r.popularity == want.popularity]
    similar = [r for r in similar if isinstance(r.rank, int)]
    return min(similar, key=lambda r: (r.rank, -r.batch_size), default=None)


def lora_summary(results: list[Result]) -> dict[str, Any]:
    """The targets: decode b64 distinct r16 within 2x of the roofline (graph time, eager when there is
    no graph), and Triton (eager) faster than bmm (eager) in every case."""
    head = _headline(results, Case("decode", 16, 64, "distinct"))
    headline = None
    if head is not None:
        timing = "graph" if head.triton_graph_us is not None else "eager"
        t = head.triton_graph_us if timing == "graph" else head.triton_us
        times = {k: getattr(head, k) for k in ("triton_us", "triton_graph_us", "roofline_us")}
        headline = {"case": head.label, "timing": timing, **times, "x_roofline": ratio(t, head.roofline_us)}
    measured = [r for r in results if r.error is None]
    with_bmm = [r for r in measured if r.triton_us is not None and r.bmm_us is not None]
    with_loop = [r for r in measured if r.triton_us is not None and r.loop_us is not None]
    not_faster_bmm = [r.label for r in with_bmm if r.triton_us >= r.bmm_us]
    not_faster_loop = [r.label for r in with_loop if r.triton_us >= r.loop_us]
    x = headline["x_roofline"] if headline else None
    return {
        "lora_decode_b64_distinct_r16": headline,
        "within_2x_roofline": x is not None and x <= ROOFLINE_FACTOR,
        "faster_than_bmm_everywhere": bool(with_bmm) and not not_faster_bmm,
        "not_faster_than_bmm": not_faster_bmm,
        "faster_than_loop_everywhere": bool(with_loop) and not not_faster_loop,
        "not_faster_than_loop": not_faster_loop,
        "lora_all_correct": bool(measured) and all(r.ok is not False for r in measured),
        "lora_errors": [f"{r.label}: {r.error}" for r in results if r.error not in (None, "skipped")],
        "lora_skipped": [r.label for r in results if r.error == "skipped"],
    }


def lora_markdown(results: list[Result]) -> str:
    headers = ["phase", "rank", "batch", "popularity", "tokens", "adapters", "path", "triton µs", "graph µs", "loop µs"]
    headers += ["loop graph µs", "bmm µs", "roofline µs", "graph/roof", "bmm/triton", "loop/triton", "max err"]
    rows = []
    for r in results:
        if r.error is not None:
            rows.append([r.phase, str(r.rank), str(r.batch_size), r.popularity, *["-"] * 12, r.error])
            continue
        tokens = f"{r.tokens}" + (f" ({r.tokens_per_request}/req)" if r.phase == "prefill" else "")
        rank = f"mixed ≤ {r.max_rank}" if r.rank == "mixed" else str(r.rank)
        cells = [r.phase, rank, str(r.batch_size), r.popularity, tokens, str(r.adapters), r.path]
        cells += [fmt(v) for v in (r.triton_us, r.triton_graph_us, r.loop_us, r.loop_graph_us, r.bmm_us)]
        cells += [fmt(v) for v in (r.roofline_us, r.x_roofline, r.bmm_x, r.loop_x)]
        rows.append([*cells, fmt(r.max_abs_err, ".1e")])
    return markdown_table(headers, rows)


def target_lines(summary: dict[str, Any]) -> list[str]:
    """One markdown line per target."""
    head = summary["lora_decode_b64_distinct_r16"]
    if head is None:
        within = "- LoRA decode b64 distinct r16 within 2× roofline: not measured"
    else:
        t = head["triton_graph_us"] if head["timing"] == "graph" else head["triton_us"]
        within = (
            f"- LoRA {head['case']} within 2× roofline: **{'yes' if summary['within_2x_roofline'] else 'no'}** "
            f"({fmt(t)} µs {head['timing']} vs {fmt(head['roofline_us'])} µs roofline, "
            f"{fmt(head['x_roofline'])}×)"
        )
    slower = summary["not_faster_than_bmm"]
    bmm = (
        f"- Triton faster than gather-then-bmm in every case (eager vs eager): "
        f"**{'yes' if summary['faster_than_bmm_everywhere'] else 'no'}**"
        + (f" (not in {len(slower)}: {', '.join(slower)})" if slower else "")
    )
    correct = "- Triton agrees with the torch references in every case: " + (
        "**yes**" if summary["lora_all_correct"] and summary["attention_all_correct"] else "**no**"
    )
    return [within, bmm, correct, attention_line(summary["attention_decode_b64_ctx4096"])]


def attention_line(head: dict[str, Any] | None) -> str:
    """The attention headline: Triton (graph, else eager) against the roofline and SDPA."""
    if head is None:
        return "- Paged attention decode 64 × 1 at context 4096: not measured"
    graph = head["triton_graph_us"] is not None
    t, sdpa = (head["triton_graph_us"], head["sdpa_graph_us"]) if graph else (head["triton_us"], head["sdpa_us"])
    return (
        f"- Paged attention {head['case']}: {fmt(t)} µs {'graph' if graph else 'eager'} vs "
        f"{fmt(head['roofline_us'])} µs roofline ({fmt(ratio(t, head['roofline_us']))}×), dense SDPA {fmt(sdpa)} µs"
    )


def suite_markdown(meta: dict[str, Any], lora: list[Result], attention: list, summary: dict[str, Any]) -> str:
    bw = meta["measured_bandwidth_tbs"]
    bandwidth = (
        f"measured {bw:.2f} TB/s (datasheet {meta['datasheet_bandwidth_tbs']})"
        if bw
        else f"placeholder {meta['roofline_bandwidth_tbs']} TB/s (dry run: nothing measured)"
    )
    return "\n\n".join(
        [
            f"**{meta['device']}**, {meta['dtype']}, h = {meta['hidden']}, bandwidth {bandwidth}; "
            f"torch {meta['torch']}, triton {meta['triton']}. Times: {meta['timing']}.",
            "\n".join(target_lines(summary)),
            "### Batched LoRA (one projection h → h)\n\n" + lora_markdown(lora),
            "### Paged attention\n\n" + attention_markdown(attention),
        ]
    )


def run_suite(dry_run: bool = False, budget_s: float = SUITE_BUDGET_S, progress: bool = True) -> dict[str, Any]:
    """The GPU suite's kernel part: LoRA sweep and attention cases, JSON-serialisable.

    Returns {"meta", "lora": [rows], "attention": [rows], "summary", "markdown"}. Attention runs first
    (it is short), then LoRA; a case not started within budget_s of the start is skipped and listed.
    dry_run: tiny shapes on CPU under Triton's interpreter, wall-clock times, no graphs, and a
    placeholder bandwidth of 1 TB/s for the roofline (flagged in meta). progress: a line per case
    on stderr.
    """
    start = time.monotonic()
    if dry_run:
        ensure_interpreter()
    elif not torch.cuda.is_available():
        raise RuntimeError("run_suite needs a CUDA device (or dry_run=True)")

    device = torch.device("cpu" if dry_run else "cuda")
    timers = wall_timers() if dry_run else cuda_timers(device)
    config = suite_config(dry_run)
    meta = {**suite_meta(dry_run, device), "dtype": config.dtype, "hidden": config.hidden, "budget_s": budget_s}
    config = replace(config, bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    att_config = replace(attention_bench.suite_config(dry_run), bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    attention = attention_bench.benchmark(att_config, device, timers, start + 0.3 * budget_s, progress)
    lora = benchmark(config, device, timers, start + budget_s, progress)
    summary = {**lora_summary(lora), **attention_bench.attention_summary(attention)}
    summary["elapsed_s"] = meta["elapsed_s"] = round(time.monotonic() - start, 1)
    return {
        "meta": meta,
        "lora": [asdict(r) for r in lora],
        "attention": [asdict(r) for r in attention],
        "summary": summary,
        "markdown": suite_markdown(meta, lora, attention, summary),
    }


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI's LoRA sweep on the GPU: {"meta", "results": [rows], "summary", "markdown"}."""
    device = torch.device("cuda")
    meta = suite_meta(False, device)
    meta.update(dtype=args.dtype, hidden=args.hidden)
    if args.bandwidth is not None:
        meta.update(roofline_bandwidth_tbs=args.bandwidth, roofline_bandwidth_source="--bandwidth")
    config = replace(LoraConfig.from_args(args), bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    results = benchmark(config, device, cuda_timers(device, rep_ms=args.rep, warmup_ms=args.rep / 2))
    print(f"\n{meta['device']}, {args.dtype}, h={args.hidden}\n\n{format_table(results)}\n", file=sys.stderr)
    return {
        "meta": meta,
        "results": [asdict(r) for r in results],
        "summary": lora_summary(results),
        "markdown": lora_markdown(results),
    }
