"""The GPU suite's report: JUnit counts, the targets check, results.json and results.md."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from loraserve.bench.common.results import judged, target, write_results
from loraserve.bench.common.tables import fmt, markdown_table

KERNEL_HEAD = "kernels.summary.lora_decode_b64_distinct_r16"
# (name, goal, where the value is in the results: part.key.key...); a goal "yes" is met by a true value
TARGETS = [
    ("LoRA decode kernel, batch 64 distinct rank 16, h 4096: time / roofline", "<= 2", f"{KERNEL_HEAD}.x_roofline"),
    ("Triton LoRA faster than gather-bmm at every point", "yes", "kernels.summary.faster_than_bmm_everywhere"),
    ("engine throughput n=1000 / n=1", ">= 0.9", "engine.ratios.high_over_low"),
    ("LoRA overhead vs the base model", "<= 0.10", "engine.ratios.lora_overhead"),
    ("decode step with CUDA graphs, batch 64, most adapters: eager ms / graph ms", "> 1", "engine.graph_speedup"),
    ("loraserve / PEFT throughput (same trace)", ">= 30", "engine.ratios.over_peft"),
    ("stack: added latency per token (p50 TPOT difference), ms", "< 1", "stack.stack_vs_engine.added_tpot_p50_ms"),
]


def junit_counts(path: Path) -> dict:
    """Passed / failed / skipped counts and the failures' names and messages from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (problem.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts | {"failures": failures}


def _lookup(results: dict, path: str):
    name, *keys = path.split(".")
    value = results["parts"].get(name, {}).get("data")  # a part cut at its limit keeps the figures it had
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def targets(results: dict) -> list[dict]:
    rows = []
    for name, goal, path in TARGETS:
        value = _lookup(results, path)
        if goal == "yes":
            rows.append(target(name, goal, value, None if value is None else bool(value)))
        else:
            rows.append(judged(name, goal, value, None))
    return rows


def _table(header: list[str], rows: list[list]) -> str:
    return markdown_table(header, [[fmt(v) for v in row] for row in rows])


def _engine_md(data: dict) -> str:
    cols = ["system", "n_adapters", "finished", "requests", "tokens_per_s", "req_per_s", "ttft_p50_s", "tpot_p50_s"]
    cols += ["mean_batch_size", "adapter_loads", "prefetch_hit_rate", "wall_s"]
    rows = [[r.get(c, r.get("error") if c == "tokens_per_s" else None) for c in cols] for r in data["rows"]]
    model = data["model"]
    head = (
        f"Model: random Llama, {model['parameters'] / 1e9:.2f}B parameters ({model['shape']}), {model['dtype']}. "
        f"Workload: {data['workload']}."
    )
    r = data["ratios"]
    ratios = "\n".join(
        [
            f"- throughput n={r['high']} / n={r['low']}: {r['high_over_low']}",
            f"- LoRA overhead (1 - throughput at n={r['low']} / the base model's, same requests): {r['lora_overhead']}",
            f"- loraserve / peft at n={r['baseline_n']}: {r['over_peft']}",
            f"- loraserve / merge-and-swap at n={r['baseline_n']}: {r['over_merge_and_swap']}",
        ]
    )
    profile = []
    for p in data.get("decode_profile", []):
        if "error" in p:
            profile.append(f"- decode-step profile, n={p['n_adapters']}: {p['error']}")
            continue
        graphs = "CUDA graphs" if p.get("cuda_graphs") else "eager"
        profile.append(
            f"- decode step ({graphs}), batch {p['batch']}, {p['n_adapters']} adapters: "
            f"{p['wall_ms_per_step']} ms wall, "
            f"{p['kernel_ms_per_step']} ms of GPU kernels ({p['launches_per_step']} launches), "
            f"GPU busy {p['gpu_busy']}; top: "
            + "; ".join(f"{t['kernel']} {t['ms_per_step']} ms ({t['calls_per_step']:g}x)" for t in p["top"][:5])
        )
    return f"{head}\n\n{_table(cols, rows)}\n\n{ratios}\n" + "\n".join(profile)


def _overhead_md(data: dict) -> str:
    cols = ["model", "cuda_graphs", "backend", "n_adapters", "batch", "tokens_per_s_base", "tokens_per_s_lora"]
    cols += ["overhead", "step_ms_base", "step_ms_lora", "host_ms_per_step"]
    records = data.get("records", [])
    lines = [_table(cols, [[r.get(c) for c in cols] for r in records if r["kind"] == "overhead"])]
    for r in records:
        if r["kind"] == "scaling":
            lines.append(f"- {r['model']}: n={r['n_adapters']} / n=1, saturated: {r['ratio']}")
    return "\n".join(lines)


def _stack_md(data: dict) -> str:
    parts = []
    svc = data.get("stack_vs_engine", {})
    if "rows" in svc:
        cols = ["finished", "requests", "tokens_per_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "wall_s"]
        parts.append(_table(["system", *cols], [[k, *[v.get(c) for c in cols]] for k, v in svc["rows"].items()]))
        parts.append(
            f"- added p50 time per output token: {svc['added_tpot_p50_ms']} ms; "
            f"added p50 time to first token: {svc['added_ttft_p50_ms']} ms"
        )
    elif svc:
        parts.append(f"- stack vs in-process: {svc}")
    fetch = data.get("adapter_fetch", {})
    for r in fetch.get("results", []):
        parts.append(
            f"- adapter fetch ({r['phase']}, {r['megabytes']:.1f} MB): median {r['median_ms']:.2f} ms, "
            f"p90 {r['p90_ms']:.2f} ms, {r['median_gbps']:.2f} GB/s"
        )
    if "error" in fetch:
        parts.append(f"- adapter fetch: {fetch['error']}")
    h2d = data.get("host_to_device", {})
    if h2d:
        parts.append("- host to device (rank-16 q/k/v/o adapter): " + ", ".join(f"{k} {v}" for k, v in h2d.items()))
    return "\n".join(parts)


def _tensor_parallel_md(data: dict) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}"
    speed = [r for r in data["records"] if r["kind"] == "speed"]
    traffic = [r for r in data["records"] if r["kind"] == "traffic"]
    parts = [
        _table(
            ["model", "ranks", "side", "tokens/s"],
            [[r["model"], r["size"], r["side"], r["tokens_per_s"]] for r in speed],
        )
    ]
    rows = [[r["model"], r["size"], r["base_bytes"], r["lora_bytes"], r["lora_share"]] for r in traffic]
    parts.append(_table(["model", "ranks", "base bytes/step", "LoRA bytes/step", "LoRA share"], rows))
    return "\n\n".join(parts)


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"# GPU check ({results['preset']})",
        "",
        f"Device: {env['device']}; driver {env.get('driver')}; CUDA {env.get('cuda')}; torch {env['torch']}; "
        f"triton {env.get('triton')}; Python {env['python']}; {env['cpus']} CPUs.",
        "",
        "## Targets",
        "",
        _table(
            ["target", "goal", "measured", "met"],
            [
                [t["name"], t["goal"], t["value"], {True: "yes", False: "no", None: "–"}[t["met"]]]
                for t in targets(results)
            ],
        ),
    ]
    for name, part in results["parts"].items():
        lines += ["", f"## {name} ({part['status']}, {part.get('seconds')} s)", ""]
        data = part.get("data")
        if part["status"] != "ok":
            lines.append(f"Error: {part.get('error')}" + (" (the figures below are those it had)" if data else ""))
            lines.append("")
        if data is None:
            continue
        if name == "tests":
            lines.append(
                f"passed {data['passed']}, failed {data['failed']}, skipped {data['skipped']} "
                f"(pytest exit {data['exit_code']}, {data['seconds']} s)"
            )
            lines += [f"- FAILED {f['test']}: {f['message']}" for f in data["failures"]]
        elif name == "kernels":
            lines.append(data.get("markdown", ""))
        elif name == "engine":
            lines.append(_engine_md(data))
        elif name == "overhead":
            lines.append(_overhead_md(data))
        elif name == "tensor-parallel":
            lines.append(_tensor_parallel_md(data))
        else:
            lines.append(_stack_md(data))
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    fields = {k: v for k, v in results.items() if k != "parts"}
    records = [{"part": name, **record} for name, record in results["parts"].items()]
    write_results(out, "gpu-check", records, parts=results["parts"], targets=targets(results), **fields)
    (out / "results.md").write_text(markdown(results))
