"""Figures in the manner of S-LoRA's figures 5 and 6, one line per system (matplotlib, Agg).

    vs_adapters.png  throughput and mean request latency against the number of adapters (fig. 5)
    vs_rate.png      throughput, mean first-token latency and SLO attainment against the request
                     rate (fig. 6)

Each figure uses the slice of the results with the most points: the rate at which most adapter
counts were run, and the adapter count at which most rates were run. A figure with fewer than two
points on every line is not drawn.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MARKERS = "os^Dvx*P"


def _lines(rows: list[dict], x: str) -> dict[str, list[dict]]:
    systems = dict.fromkeys(row["system"] for row in rows)
    return {name: sorted((r for r in rows if r["system"] == name), key=lambda r: r[x]) for name in systems}


def _figure(rows: list[dict], x: str, panels: list[tuple[str, str]], title: str, path: Path, log_x: bool) -> bool:
    lines = _lines(rows, x)
    if max((len(p) for p in lines.values()), default=0) < 2:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), dpi=80)
    for ax, (key, label) in zip(axes, panels, strict=True):
        if key == "req_per_s":  # what the traces asked for: a system that keeps up sits on this line
            _offered(ax, rows, x)
        for i, (system, points) in enumerate(lines.items()):
            xs = [p[x] for p in points if p.get(key) is not None]
            ys = [p[key] for p in points if p.get(key) is not None]
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], label=system)
        ax.set_xlabel({"n_adapters": "number of adapters", "rate": "request rate (req/s)"}[x])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if log_x:
            ax.set_xscale("symlog", linthresh=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _offered(ax, rows: list[dict], x: str) -> None:
    offered = {row[x]: row["offered_req_per_s"] for row in rows if row.get("offered_req_per_s") is not None}
    if len(offered) > 1:
        xs = sorted(offered)
        ax.plot(xs, [offered[v] for v in xs], linestyle="--", color="grey", linewidth=1, label="offered load")


def _most_common(rows: list[dict], key: str, varying: str) -> object | None:
    """The value of `key` shared by the most distinct values of `varying`."""
    counts = Counter({value: len({r[varying] for r in rows if r[key] == value}) for value in {r[key] for r in rows}})
    return counts.most_common(1)[0][0] if counts else None


def plot_results(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Write the figures the results allow; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    rate = _most_common(rows, "rate", "n_adapters")
    if rate is not None:
        path = out_dir / "vs_adapters.png"
        sliced = [r for r in rows if r["rate"] == rate]
        panels = [("req_per_s", "throughput (req/s)"), ("latency_mean_s", "mean latency (s)")]
        if _figure(sliced, "n_adapters", panels, f"rate {rate} req/s", path, log_x=True):
            written.append(path)
    n = _most_common(rows, "n_adapters", "rate")
    if n is not None:
        path = out_dir / "vs_rate.png"
        sliced = [r for r in rows if r["n_adapters"] == n]
        panels = [
            ("req_per_s", "throughput (req/s)"),
            ("ttft_mean_s", "mean first-token latency (s)"),
            ("slo_attainment", "SLO attainment"),
        ]
        if _figure(sliced, "rate", panels, f"{n} adapters", path, log_x=False):
            written.append(path)
    return written
