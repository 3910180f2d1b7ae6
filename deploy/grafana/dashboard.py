"""Writes deploy/grafana/dashboards/loraserve.json, the Grafana dashboard of a loraserve stack.

    .venv/bin/python deploy/grafana/dashboard.py

The panels are declared below as plain data, one row per role. The latency breakdown of single
requests (queue, adapter load, prefill, decode) is in the traces, not in metrics, so its row
queries Jaeger. tests/project/test_deploy.py checks that the committed JSON is what this script writes and
that every PromQL expression names a metric (and labels) the roles really export.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "dashboards" / "loraserve.json"

PROMETHEUS = {"type": "prometheus", "uid": "prometheus"}  # uids of provisioning/datasources/loraserve.yaml
JAEGER = {"type": "jaeger", "uid": "jaeger"}
RATE = "[$__rate_interval]"
WORKER = '{worker=~"$worker"}'
WIDTH, HEIGHT = 24, 8  # Grafana's grid: 24 columns


def target(expr: str, legend: str = "__auto") -> dict:
    return {"datasource": PROMETHEUS, "expr": expr, "legendFormat": legend}


def quantiles(bucket: str, by: str = "", legend: str = "") -> list[dict]:
    """p50, p90 and p99 of a histogram's `_bucket` series, summed over everything but `le` and `by`."""
    group = f"le, {by}" if by else "le"
    series = f"sum by ({group}) (rate({bucket}{RATE}))"
    return [target(f"histogram_quantile({q}, {series})", f"p{q * 100:g} {legend}".strip()) for q in (0.5, 0.9, 0.99)]


def timeseries(title: str, targets: list[dict], unit: str, description: str, stack: bool = False, w: int = 8) -> dict:
    custom = {"fillOpacity": 30 if stack else 10, "stacking": {"mode": "normal" if stack else "none"}}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": PROMETHEUS,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "w": w,
    }


def stat(title: str, expr: str, unit: str, description: str) -> dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": PROMETHEUS,
        "targets": [target(expr, title)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "graphMode": "area"},
        "w": 4,
        "h": 4,
    }


def trace_search(title: str, service: str, operation: str, description: str, tags: str = "") -> dict:
    query = {"datasource": JAEGER, "queryType": "search", "service": service, "operation": operation, "limit": 50}
    if tags:
        query["tags"] = tags
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": JAEGER,
        "targets": [query],
        "w": 9,
        "h": 10,
    }


OVERVIEW = [
    stat("Ready workers", "sum(loraserve_scheduler_ready_workers)", "none", "Workers reporting ready to the scheduler"),
    stat("Queue length", "sum(loraserve_scheduler_queue_length)", "none", "Requests waiting for a worker"),
    stat("In flight", "sum(loraserve_gateway_requests_in_flight)", "none", "Generations the gateways serve now"),
    stat(
        "Requests / s",
        f"sum(rate(loraserve_gateway_requests_total{RATE}))",
        "reqps",
        "Generations ended per second, every outcome",
    ),
    stat(
        "TTFT p99",
        f"histogram_quantile(0.99, sum by (le) (rate(loraserve_gateway_time_to_first_token_seconds_bucket{RATE})))",
        "s",
        "99th percentile of arrival at the gateway to the first token",
    ),
    stat(
        "Failovers (range)",
        "sum(increase(loraserve_gateway_failovers_total[$__range]))",
        "none",
        "Requests continued on another worker after losing theirs, over the dashboard's time range",
    ),
]

THROUGHPUT = [
    timeseries(
        "Requests per second by role",
        [
            target(f"sum(rate(loraserve_gateway_requests_total{RATE}))", "gateway: ended"),
            target(f"sum(rate(loraserve_scheduler_assigned_requests_total{RATE}))", "scheduler: placed"),
            target(f"sum(rate(loraserve_scheduler_failed_requests_total{RATE}))", "scheduler: failed"),
        ],
        "reqps",
        "Generations the gateways ended, and requests the scheduler placed on a worker or failed",
    ),
    timeseries(
        "Requests per second by outcome",
        [target(f"sum by (code) (rate(loraserve_gateway_requests_total{RATE}))", "{{code}}")],
        "reqps",
        "OK, or the gRPC status a generation ended with",
        stack=True,
    ),
    timeseries(
        "Requests per second by tenant",
        [target(f"sum by (tenant) (rate(loraserve_gateway_requests_total{RATE}))", "{{tenant}}")],
        "reqps",
        "Callers without a valid key count as 'unauthenticated'",
        stack=True,
    ),
    timeseries(
        "Tokens per second",
        [
            target(f"sum(rate(loraserve_gateway_output_tokens_total{RATE}))", "generated"),
            target(f"sum(rate(loraserve_gateway_prompt_tokens_total{RATE}))", "prompt"),
        ],
        "short",
        "Prompt and generated tokens of completed requests",
    ),
    timeseries(
        "Engine steps per second",
        [target(f"sum by (worker) (rate(loraserve_worker_steps_total{WORKER}{RATE}))", "{{worker}}")],
        "short",
        "Forward passes over the batch, per worker",
    ),
    timeseries(
        "Failovers per second",
        [target(f"sum(rate(loraserve_gateway_failovers_total{RATE}))", "failovers")],
        "short",
        "Requests that lost their worker and were continued on another one",
    ),
]

LATENCY = [
    timeseries(
        "Time to first token",
        quantiles("loraserve_gateway_time_to_first_token_seconds_bucket"),
        "s",
        "Arrival at the gateway to the first token",
        w=12,
    ),
    timeseries(
        "Request duration",
        quantiles("loraserve_gateway_request_duration_seconds_bucket"),
        "s",
        "Arrival to the final message, completed requests",
        w=12,
    ),
]

SCHEDULER = [
    timeseries(
        "Queue length",
        [target("sum(loraserve_scheduler_queue_length)", "waiting for a worker")],
        "none",
        "Requests the scheduler holds until a worker has room",
    ),
    timeseries(
        "Ready workers",
        [target("sum(loraserve_scheduler_ready_workers)", "ready")],
        "none",
        "Workers reporting ready (not draining, not stale)",
    ),
    timeseries(
        "Requests in flight and batches",
        [
            target("sum(loraserve_gateway_requests_in_flight)", "gateway: in flight"),
            target(f"sum by (worker) (loraserve_worker_running_requests{WORKER})", "running {{worker}}"),
            target(f"sum by (worker) (loraserve_worker_waiting_requests{WORKER})", "waiting {{worker}}"),
        ],
        "none",
        "Generations in the gateways, and each worker's running batch and assigned-but-waiting requests",
    ),
]

WORKERS = [
    timeseries(
        "Step time",
        quantiles(f"loraserve_worker_step_seconds_bucket{WORKER}", by="worker", legend="{{worker}}"),
        "s",
        "Duration of one engine step (one forward over the batch)",
    ),
    timeseries(
        "Pool pages by use",
        [target(f"sum by (use) (loraserve_worker_pool_pages{WORKER})", "{{use}}")],
        "none",
        "The unified page pool: KV cache, adapter weights and free pages, summed over the chosen workers",
        stack=True,
    ),
    timeseries(
        "Pool waste",
        [target(f"loraserve_worker_pool_waste_fraction{WORKER}", "{{worker}}")],
        "percentunit",
        "Unused share of allocated pages (partly filled KV and adapter pages)",
    ),
    timeseries(
        "Adapter loads, misses and evictions",
        [
            target(f"sum(rate(loraserve_worker_adapter_loads_total{WORKER}{RATE}))", "loads"),
            target(f"sum(rate(loraserve_worker_adapter_misses_total{WORKER}{RATE}))", "misses (request waited)"),
            target(f"sum(rate(loraserve_worker_adapter_evictions_total{WORKER}{RATE}))", "evictions"),
        ],
        "short",
        "Adapters copied into the pool per second, requests that waited for that copy, adapters evicted",
    ),
    timeseries(
        "Prefetches",
        [
            target(f"sum(rate(loraserve_worker_prefetches_total{WORKER}{RATE}))", "started"),
            target(f"sum(rate(loraserve_worker_prefetch_hits_total{WORKER}{RATE}))", "hits (ready in time)"),
            target(f"sum(rate(loraserve_worker_prefetch_late_total{WORKER}{RATE}))", "late (still copying)"),
        ],
        "short",
        "Adapter loads started ahead of need, and whether they were ready when a request needed them",
    ),
    timeseries(
        "Resident adapters",
        [target(f"loraserve_worker_resident_adapters{WORKER}", "{{worker}}")],
        "none",
        "Adapters in each worker's pool",
    ),
    timeseries(
        "Host adapter cache",
        [target(f"loraserve_worker_host_cache_bytes{WORKER}", "{{worker}}")],
        "bytes",
        "Host RAM held by each worker's cache of fetched adapter weights (--adapter-cache-gb)",
    ),
    timeseries(
        "Host cache evictions per second",
        [target(f"sum by (worker) (rate(loraserve_worker_host_cache_evictions_total{WORKER}{RATE}))", "{{worker}}")],
        "short",
        "Adapters dropped from host RAM over its budget (fetched from the store again when needed)",
    ),
    timeseries(
        "Ready",
        [target(f"loraserve_worker_ready{WORKER}", "{{worker}}")],
        "none",
        "1 while the worker accepts requests",
    ),
]

PROCESSES = [
    timeseries(
        "Resident memory by process",
        [target('process_resident_memory_bytes{job=~"$job"}', "{{instance}}")],
        "bytes",
        "Every role, the adapter store included (its adapters live in host RAM)",
        w=12,
    ),
    timeseries(
        "CPU by process",
        [target(f'rate(process_cpu_seconds_total{{job=~"$job"}}{RATE})', "{{instance}}")],
        "percentunit",
        "CPU seconds per second of every role",
        w=12,
    ),
]

BREAKDOWN_HELP = """Each request is one trace across the four roles. Open a trace ID below (or paste it into
*trace_id* above) to see its breakdown:

| span | what it times |
|---|---|
| `scheduler.queue` | waiting in the scheduler's queue for a worker |
| `worker.adapter_fetch` | loading the adapter into the pool (`loraserve.adapter.source`: hit, prefetched or cold) |
| `worker.prefill` | first scheduled step to the first token |
| `worker.decode` | first token to the last |
| `adapter_store.serve_adapter` | the store sending the adapter's bytes (cold loads only) |
"""

TRACES = [
    {
        "type": "text",
        "title": "Latency breakdown",
        "options": {"mode": "markdown", "content": BREAKDOWN_HELP},
        "w": 6,
        "h": 10,
    },
    trace_search(
        "Recent requests",
        "loraserve-gateway",
        "gateway.generate",
        "The last generations, slowest first when sorted by duration; a trace ID opens the waterfall",
    ),
    trace_search(
        "Cold adapter loads",
        "loraserve-worker",
        "worker.adapter_fetch",
        "Requests whose adapter was in neither the pool nor a prefetch: fetched from the host cache or the store",
        tags="loraserve.adapter.source=cold",
    ),
    {
        "type": "traces",
        "title": "Trace ${trace_id}",
        "description": "The spans of one request: paste a trace ID into trace_id above",
        "datasource": JAEGER,
        "targets": [{"datasource": JAEGER, "query": "${trace_id}"}],
        "w": 24,
        "h": 12,
    },
]

ROWS = [
    ("Overview", OVERVIEW),
    ("Throughput", THROUGHPUT),
    ("Latency", LATENCY),
    ("Scheduler", SCHEDULER),
    ("Workers", WORKERS),
    ("Processes", PROCESSES),
    ("Latency breakdown (traces)", TRACES),
]


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": PROMETHEUS,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query,
        "refresh": 2,  # on time range change
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "sort": 1,
    }


def layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    """Rows and their panels with ids and grid positions: panels flow left to right, wrapping at 24 columns."""
    panels, y, next_id = [], 0, 1
    for title, members in rows:
        row = {"type": "row", "title": title, "collapsed": False, "panels": []}
        panels.append({"id": next_id, "gridPos": grid(0, y, WIDTH, 1), **row})
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for member in members:
            panel = dict(member)
            w, h = panel.pop("w", 8), panel.pop("h", HEIGHT)
            if x + w > WIDTH:
                x, y, row_height = 0, y + row_height, 0
            if "targets" in panel:
                panel["targets"] = [{**query, "refId": chr(ord("A") + i)} for i, query in enumerate(panel["targets"])]
            panels.append({"id": next_id, "gridPos": grid(x, y, w, h), **panel})
            next_id, x, row_height = next_id + 1, x + w, max(row_height, h)
        y += row_height
    return panels


def grid(x: int, y: int, w: int, h: int) -> dict:
    return {"x": x, "y": y, "w": w, "h": h}


def dashboard() -> dict:
    return {
        "uid": "loraserve",
        "title": "loraserve",
        "description": "Multi-LoRA serving: throughput, latency, scheduler, workers' pools and adapters, traces",
        "tags": ["loraserve"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {
            "list": [
                variable("worker", "label_values(loraserve_worker_ready, worker)"),
                variable("job", "label_values(process_resident_memory_bytes, job)"),
                {"name": "trace_id", "type": "textbox", "label": "trace_id", "query": "", "current": {"value": ""}},
            ]
        },
        "panels": layout(ROWS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
