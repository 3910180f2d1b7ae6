"""The scheduling suite's table (terminal and Markdown) and plots, from its records (`suite.py` beside it)."""

from __future__ import annotations

from pathlib import Path

from loraserve.bench.common import tables

# the table's columns, title -> the record's key: what ran, the outcome and latencies, throughput, adapters, the rest
COLUMNS = {"scenario": "scenario", "policy": "policy", "tenant": "tenant", "flood": "flood", "prefetch": "prefetch"}
COLUMNS |= {"n": "n_requests", "done": "completed", "TTFT p50 (s)": "ttft_p50_s", "TTFT p99 (s)": "ttft_p99_s"}
COLUMNS |= {"queue p99 (s)": "queue_p99_s", "SLO": "slo_attainment", "req/s": "req_per_s"}
COLUMNS |= {"load wait (s)": "load_wait_s", "prefetch hit": "prefetch_hit_rate"}
COLUMNS |= {"ready before": "loads_ready_before_scheduled", "refused": "refused"}
COLUMNS |= {"p99 fcfs/this": "ttft_p99_improvement_vs_fcfs", "step (s)": "step_mean_s", "CPU busy": "cpu_busy"}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def rows(records: list[dict]) -> list[list[str]]:
    return [[_fmt(r.get(key)) for key in COLUMNS.values()] for r in records]


def markdown_table(records: list[dict]) -> str:
    return tables.markdown_table(list(COLUMNS), rows(records))


def print_report(records: list[dict]) -> None:
    title = "loraserve bench --suite scheduling --stack (the real stack, emulated workers)"
    console = tables.wide_console(160)
    console.print(tables.rich_table(title, list(COLUMNS), rows(records), {"scenario", "policy", "tenant"}))


def _label(r: dict) -> str:
    if "tenant" in r:
        tenant = "every tenant" if r["tenant"] == "all" else r["tenant"]
        return f"flood: {tenant}" + ("" if r.get("flood") else " (calm)")
    return r["scenario"] + ("" if r.get("prefetch", True) else " (no prefetch)")


def plot(records: list[dict], out_dir: Path, prefix: str = "scheduling") -> list[Path]:
    """Three bar charts, default policy beside fcfs for every record pair: TTFT p99 and p50 (log scale),
    SLO attainment and req/s, and the prefetch hit rate with the time requests waited for adapters.
    Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(r) for r in records))
    policies = list(dict.fromkeys((r["role"], r["policy"]) for r in records))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = [
        ("ttft", [("ttft_p99_s", "TTFT p99 (s, log)", True), ("ttft_p50_s", "TTFT p50 (s, log)", True)]),
        ("slo", [("slo_attainment", "SLO attainment", False), ("req_per_s", "completed req/s", False)]),
        ("prefetch", [("prefetch_hit_rate", "prefetch hit rate", False), ("load_wait_s", "load wait (s)", False)]),
    ]
    written = []
    for name, metrics in panels:
        fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 3.8), squeeze=False)
        for ax, (key, title, log_scale) in zip(axes[0], metrics, strict=True):
            width = 0.8 / max(1, len(policies))
            for i, (role, policy) in enumerate(policies):
                values = []
                for label in labels:
                    r = next((r for r in records if _label(r) == label and r["role"] == role), None)
                    values.append((r or {}).get(key) or 0.0)
                xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(labels))]
                ax.bar(xs, values, width, label=f"{policy} ({role})")
            ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
            ax.set_title(title)
            if log_scale:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
