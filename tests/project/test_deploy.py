"""deploy/: the Grafana dashboard asks only for metrics the roles export, the Kubernetes manifests are
valid (offline, against kubernetes-validate's bundled schemas) and set only real flags, and compose
has health checks, restart policies and a provisioned Grafana."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests target; kubernetes-validate bundles its schemas
TARGET_LABELS = {"job", "instance"}  # labels Prometheus adds to every scraped series
GRPC_ROLES = {"gateway", "scheduler", "adapter-store"}


# ---- the metrics the roles export ---------------------------------------------------------------

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def exported_metrics() -> dict[str, set[str]]:
    """Every series name the roles serve on /metrics -> its label names: the metrics of the gateway's
    and scheduler's modules, the worker's step histogram and custom collector, and prometheus-client's
    process collectors (all the adapter store serves)."""
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    from loraserve.gateway import metrics as gateway
    from loraserve.scheduler import metrics as scheduler
    from loraserve.wire import WorkerReport
    from loraserve.worker import metrics as worker

    declared = {}  # family name -> label names, for metrics that have no samples until first used
    for module in (gateway, scheduler, worker):
        for metric in vars(module).values():
            if isinstance(metric, MetricWrapperBase):
                (family,) = metric.describe()
                declared[family.name] = set(metric._labelnames)  # no public accessor
    report = WorkerReport(
        worker_id="w",
        ready=True,
        max_batch_size=1,
        total_pages=1,
        free_pages=1,
        kv_pages=0,
        adapter_pages=0,
        running=[],
        waiting=[],
        resident=[],
    )
    host_cache = SimpleNamespace(evictions=0, budget_bytes=None, nbytes=0)
    collector = worker.WorkerCollector(lambda: report, SimpleNamespace(), host_cache, resident_count=lambda: 0)
    names: dict[str, set[str]] = {}
    for family in [*REGISTRY.collect(), *collector.collect()]:
        labels = declared.get(family.name, set()) | {k for s in family.samples for k in s.labels}
        for suffix in SUFFIXES.get(family.type, ("",)):
            extra = {"le"} if suffix == "_bucket" else set()
            names.setdefault(family.name + suffix, set()).update(labels | extra)
    return names


# ---- PromQL: the metric names and labels an expression uses --------------------------------------

STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
RANGE = re.compile(r"\[[^\]]*\]")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
NAME = re.compile(r"[a-zA-Z_:][\w:]*")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)")


def promql_problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What is wrong with `expr`: metric names nobody exports, labels none of its metrics has."""
    text = RANGE.sub(" ", STRING.sub('""', expr))
    grouped = {label.strip() for group in GROUPING.findall(text) for label in group.split(",") if label.strip()}
    text = GROUPING.sub(" ", text)
    matched = {name for _, body in SELECTOR.findall(text) for name in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body)}
    text = NUMBER.sub(" ", SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text))
    metrics = {
        m.group()
        for m in NAME.finditer(text)
        if m.group() not in KEYWORDS and not text[m.end() :].lstrip().startswith("(")  # not a function
    }
    problems = [f"{expr}: no role exports {name!r}" for name in sorted(metrics - exported.keys())]
    if not metrics:
        problems.append(f"{expr}: names no metric")
    known = set().union(TARGET_LABELS, *(exported.get(name, set()) for name in metrics))
    problems += [f"{expr}: no metric of it has the label {label!r}" for label in sorted((grouped | matched) - known)]
    return problems


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and Prometheus template variables."""
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard["templating"]["list"]:
        if variable.get("datasource", {}).get("type") == "prometheus":
            metric, label = LABEL_VALUES.fullmatch(variable["query"]["query"]).groups()
            queries.append(f"sum by ({label}) ({metric})")
    return queries


def load_dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "loraserve.json").read_text())


def test_promql_checker_finds_misnamed_metrics_and_labels():
    exported = {"a_total": {"code"}, "b_bucket": {"le", "worker"}}
    good = 'histogram_quantile(0.99, sum by (le, worker) (rate(b_bucket{worker=~"$w"}[$__rate_interval]))) / 1e3'
    assert promql_problems(good, exported) == []
    assert promql_problems('sum by (code) (rate(a_total{job=~"x"}[5m]))', exported) == []
    assert promql_problems("rate(a[5m])", exported) == ["rate(a[5m]): no role exports 'a'"]
    assert promql_problems("sum by (tenant) (rate(a_total[5m]))", exported) == [
        "sum by (tenant) (rate(a_total[5m])): no metric of it has the label 'tenant'"
    ]
    assert promql_problems('a_total{use="kv"}', exported) == [
        "a_total{use=\"kv\"}: no metric of it has the label 'use'"
    ]


def test_every_dashboard_query_names_an_exported_metric_and_its_labels():
    exported = exported_metrics()
    queries = dashboard_queries(load_dashboard())
    assert len(queries) > 30
    problems = [problem for expr in queries for problem in promql_problems(expr, exported)]
    assert problems == [], "\n".join(problems)


def test_dashboard_shows_what_operators_need():
    dashboard = load_dashboard()
    text = "\n".join(dashboard_queries(dashboard))
    for metric in (
        "loraserve_gateway_requests_total",
        "loraserve_scheduler_assigned_requests_total",
        "loraserve_scheduler_queue_length",
        "loraserve_scheduler_ready_workers",
        "loraserve_gateway_time_to_first_token_seconds_bucket",
        "loraserve_gateway_request_duration_seconds_bucket",
        "loraserve_worker_step_seconds_bucket",
        "loraserve_worker_pool_pages",
        "loraserve_worker_pool_waste_fraction",
        "loraserve_worker_adapter_loads_total",
        "loraserve_worker_adapter_evictions_total",
        "loraserve_worker_host_cache_evictions_total",
        "loraserve_worker_prefetch_hits_total",
        "loraserve_worker_prefetch_late_total",
        "loraserve_gateway_failovers_total",
    ):
        assert re.search(rf"\b{metric}\b", text), f"no panel shows {metric}"
    # the latency breakdown (queue, adapter load, prefill, decode) is in the traces: Jaeger panels
    searches = [t for p in dashboard["panels"] for t in p.get("targets", []) if t.get("queryType") == "search"]
    assert {"loraserve-gateway", "loraserve-worker"} <= {t["service"] for t in searches}
    assert any(p["type"] == "traces" for p in dashboard["panels"])


def test_committed_dashboard_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GRAFANA / "dashboard.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.render() == (GRAFANA / "dashboards" / "loraserve.json").read_text(), (
        "deploy/grafana/dashboards/loraserve.json is stale: run `.venv/bin/python deploy/grafana/dashboard.py`"
    )


def test_grafana_provisions_the_dashboards_data_sources():
    (datasources,) = (GRAFANA / "provisioning" / "datasources").glob("*.yaml")
    provisioned = {(d["type"], d["uid"]) for d in yaml.safe_load(datasources.read_text())["datasources"]}
    dashboard = load_dashboard()
    used = {
        (d["type"], d["uid"])
        for p in dashboard["panels"]
        for d in [p.get("datasource"), *(t.get("datasource") for t in p.get("targets", []))]
        if d
    }
    assert used <= provisioned and {t for t, _ in used} == {"prometheus", "jaeger"}


# ---- Kubernetes ---------------------------------------------------------------------------------


def manifests() -> list[tuple[str, dict]]:
    return [
        (path.name, doc)
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def objects(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in manifests() if doc["kind"] == kind}


def workloads() -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] in ("Deployment", "StatefulSet")]


def container_env(container: dict) -> dict[str, str]:
    """The container's environment: its ConfigMaps (envFrom), then its own env (values from the
    downward API stand in as 'pod-field')."""
    config_maps = objects("ConfigMap")
    env = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "pod-field")
    return env


def role_containers() -> list[tuple[str, dict, dict]]:
    """(role, container, pod spec) of every container that runs a loraserve role."""
    pods = [w["spec"]["template"]["spec"] for w in workloads()]
    return [(c["args"][0], c, pod) for pod in pods for c in pod["containers"]]


def test_manifests_validate_against_the_kubernetes_schemas():
    problems = []
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # strict: unknown fields are errors
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{name} {doc['kind']}/{doc['metadata']['name']} at {list(e.absolute_path)}: {e.message}")
    assert problems == [], "\n".join(problems)
    kinds = {doc["kind"] for _, doc in manifests()}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= kinds


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert {image["name"] for image in kustomization["images"]} == {
        c["image"] for _, c, _ in role_containers()
    }  # kustomize sets every container's image


def test_every_role_runs_with_real_flags_and_binds_beyond_loopback(monkeypatch):
    from loraserve.cli import build_parser

    roles = set()
    for role, container, _ in role_containers():
        env = container_env(container)
        parser = build_parser(role)
        (subcommands,) = [a for a in parser._actions if a.dest == "command"]
        flags = {o for action in subcommands.choices[role]._actions for o in action.option_strings}
        for variable in env:
            if variable.startswith("LORASERVE_"):  # LORASERVE_X_Y is the env twin of --x-y
                assert "--" + variable.removeprefix("LORASERVE_").lower().replace("_", "-") in flags, (role, variable)
        with monkeypatch.context() as m:
            for variable, value in env.items():
                m.setenv(variable, value)
            build_parser(role).parse_args([role])  # every value parses (types, choices)
        if role in GRPC_ROLES:
            assert env["LORASERVE_BIND"].startswith("0.0.0.0:"), role
        assert env["LORASERVE_METRICS_HOST"] == "0.0.0.0", role
        roles.add(role)
    assert roles == {"gateway", "scheduler", "adapter-store", "worker"}


def test_probes_resources_and_gpus():
    for role, container, _ in role_containers():
        env = container_env(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container[kind]
            if role in GRPC_ROLES and kind == "readinessProbe":
                assert probe["grpc"]["port"] == int(env["LORASERVE_BIND"].rsplit(":", 1)[1]), role
            for action in ("grpc", "httpGet", "tcpSocket"):
                if action in probe:
                    port = probe[action]["port"]
                    assert port in ports.values() or port in ports, (role, kind, port)
        if role in {"scheduler", "adapter-store"}:
            assert "grpc" in container["livenessProbe"], role
        assert ports["metrics"] == int(env["LORASERVE_METRICS_PORT"]), role
        assert container["resources"]["requests"] and container["resources"]["limits"], role
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus == 1) == (role == "worker"), role
    (worker,) = [c for role, c, _ in role_containers() if role == "worker"]
    *python_c, code = worker["readinessProbe"]["exec"]["command"]
    assert python_c == ["python", "-c"]
    compile(code, "worker readiness probe", "exec")
    assert f":{container_env(worker)['LORASERVE_METRICS_PORT']}/metrics" in code


def test_services_and_addresses_reach_declared_ports():
    services = objects("Service")
    for name, service in services.items():
        (workload,) = [w for w in workloads() if w["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        named = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named, name
    for role, container, _ in role_containers():
        for variable, value in container_env(container).items():
            for host, port in re.findall(r"\b(loraserve-[a-z-]+):(\d+)", value):
                assert host in services, (role, variable, value)
                assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, (role, variable, value)


def mounted(pod: dict, container: dict, path: str) -> dict:
    """The volume (or volume claim template name) mounted in `container` at the directory `path`."""
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return volumes.get(mount["name"], {"claim": mount["name"]})


def test_adapter_store_keeps_its_data_dir_on_a_persistent_volume():
    (store,) = [w for w in workloads() if w["spec"]["template"]["spec"]["containers"][0]["args"] == ["adapter-store"]]
    assert store["kind"] == "StatefulSet" and store["spec"]["replicas"] == 1  # one store per data dir (its lock)
    pod = store["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volume = mounted(pod, container, container_env(container)["LORASERVE_DATA_DIR"])
    assert volume["claim"] in {t["metadata"]["name"] for t in store["spec"]["volumeClaimTemplates"]}


def test_gateway_reads_its_auth_file_from_the_secret():
    from loraserve.gateway.tenants import parse_auth_config

    ((gateway, pod),) = [(c, p) for role, c, p in role_containers() if role == "gateway"]
    path = PurePosixPath(container_env(gateway)["LORASERVE_AUTH_FILE"])
    secret = objects("Secret")[mounted(pod, gateway, str(path.parent))["secret"]["secretName"]]
    parse_auth_config(secret["stringData"][path.name])  # the gateway would start with it


def test_every_role_mounts_the_internal_keys_and_workers_never_get_the_token():
    from loraserve import internal_auth

    for role, container, pod in role_containers():
        volume = mounted(pod, container, container_env(container)["LORASERVE_INTERNAL_KEYS"])
        assert volume["secret"]["secretName"] == "loraserve-internal-keys", role
        items = volume["secret"].get("items")
        if role == "worker":  # exactly what load(dir, "worker") reads
            wanted = {f"{r}.key" for r in internal_auth.ROLES} | {"worker.key_secret"}
            assert {i["key"] for i in items} == wanted and all(i["key"] == i["path"] for i in items)
        else:
            assert items is None, f"{role} needs every key and the internal token"


def test_the_tensor_parallel_overlay_patches_the_worker_into_a_valid_multi_gpu_pod(monkeypatch):
    """deploy/k8s/tensor-parallel: its JSON patches apply to the base manifests, the result validates, and
    the worker's GPUs match its --tensor-parallel, a flag the worker parses."""
    import jsonpatch

    from loraserve.cli import build_parser

    overlay = yaml.safe_load((K8S / "tensor-parallel" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."]
    patched = {}
    for entry in overlay["patches"]:
        kind, name = entry["target"]["kind"], entry["target"]["name"]
        doc = objects(kind)[name]
        patched[kind] = jsonpatch.apply_patch(doc, yaml.safe_load(entry["patch"]))
        kubernetes_validate.validate(patched[kind], K8S_VERSION, strict=True)
    env = patched["ConfigMap"]["data"]
    (container,) = patched["Deployment"]["spec"]["template"]["spec"]["containers"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == int(env["LORASERVE_TENSOR_PARALLEL"]) > 1
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    with monkeypatch.context() as m:
        for variable, value in env.items():
            m.setenv(variable, value)
        args = build_parser("worker").parse_args(["worker"])
    assert args.tensor_parallel == gpus


# ---- compose ------------------------------------------------------------------------------------


def test_compose_has_healthchecks_restart_policies_and_grafana():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    for name, service in services.items():
        if service.get("restart") == "no":  # a one-shot set-up step (the internal keys): no health to check
            assert service["command"][0] == "keys", name
            continue
        assert service.get("restart") == "unless-stopped", name
        if "build" not in service:
            continue
        command = service["command"]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name
        compile(test[3], f"{name} healthcheck", "exec")
        if "--bind" in command:  # gRPC roles: the health check asks their gRPC health service
            bind_port = command[command.index("--bind") + 1].rsplit(":", 1)[1]
            assert test[-1] == f"127.0.0.1:{bind_port}", name
        else:  # the worker: its metrics say it is ready
            assert ":9100/metrics" in shlex.join(test), name
    for name, service in services.items():  # every role of the stack authenticates its internal planes
        if "build" in service and service.get("restart") != "no":
            assert service["environment"]["LORASERVE_INTERNAL_KEYS"] == "/keys", name
            assert "internal-keys:/keys:ro" in service["volumes"], name
            assert service["depends_on"]["internal-keys"]["condition"] == "service_completed_successfully", name
    grafana = services["grafana"]
    assert "3000:3000" in grafana["ports"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    assert Path(ROOT, mounts["/etc/grafana/provisioning"]).resolve() == GRAFANA / "provisioning"
    (providers,) = (GRAFANA / "provisioning" / "dashboards").glob("*.yaml")
    (provider,) = yaml.safe_load(providers.read_text())["providers"]
    assert Path(ROOT, mounts[provider["options"]["path"]]).resolve() == GRAFANA / "dashboards"
