"""Flags derived from configuration dataclasses: names, help, types, defaults, environment twins, and
configurations written back as flags (what `loraserve up` hands each role)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loraserve.adapter_store.config import PersistenceConfig, StoreConfig, StoreLimits
from loraserve.adapter_store.main import StoreCommand
from loraserve.cli import CliSettings
from loraserve.config_cli import add_config_arguments, config_from_args, config_to_argv, setting
from loraserve.demo.build import BuildSettings
from loraserve.demo.model_settings import ModelSettings
from loraserve.demo.show import ShowSettings
from loraserve.flags import EnvArgumentParser
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.constraints import ConstraintConfig
from loraserve.gateway.failover import FailoverConfig
from loraserve.gateway.http.connections import ConnectionLimits
from loraserve.gateway.keys import KeysSettings
from loraserve.gateway.tls import TlsSettings
from loraserve.gateway.tokenizing import TokenizingConfig
from loraserve.internal_auth import InternalAuthSettings
from loraserve.launcher.commands import UpSettings
from loraserve.metrics import MetricsSettings
from loraserve.scheduler.config import ClusterConfig, PolicyConfig, SchedulerConfig
from loraserve.telemetry import TracingSettings
from loraserve.worker.cli import WORKER_ENGINE_DEFAULTS, GenerateSettings
from loraserve.worker.config import EngineConfig, FetchConfig, WorkerConfig

GIB = 2**30


@dataclass(frozen=True)
class Inner:
    depth: int = setting(3, "how deep")


@dataclass(frozen=True)
class Example:
    name: str = setting(help="a positional", flag="name")
    max_batch_size: int = setting(64, "requests per step")
    cache_bytes: int | None = setting(
        None,
        "cache, GiB",
        flag="--cache-gb",
        flag_type=float,
        parse=lambda g: int(g * GIB),
        show=lambda n: None if n is None else n / GIB,
    )
    mode: str = setting("auto", "a choice", choices=("auto", "off", "on"), switch=("--force-off", "off", "sets off"))
    prefetch: bool = setting(True, "a default-on switch")
    eager: bool = setting(False, "a default-off switch")
    maybe: bool | None = setting(None, "three states")
    tags: tuple[str, ...] = setting((), "repeatable", metavar="TAG")
    where: Path | None = setting(None, "a path")
    inner: Inner = field(default_factory=Inner)
    internal: int = 7  # no help: not a setting


def _parser(env: bool = False, **kwargs) -> argparse.ArgumentParser:
    parser = EnvArgumentParser() if env else argparse.ArgumentParser()
    add_config_arguments(parser, Example, **kwargs)
    return parser


def _parse(argv: list[str], env: bool = False, **kwargs) -> Example:
    return config_from_args(Example, _parser(env, **kwargs).parse_args(argv))


def test_flags_come_from_field_names_metadata_and_annotations():
    parser = _parser()
    options = {o: a for a in parser._actions for o in a.option_strings}
    assert {"--max-batch-size", "--cache-gb", "--mode", "--force-off", "--prefetch", "--no-prefetch"} <= set(options)
    assert {"--eager", "--maybe", "--no-maybe", "--tags", "--where", "--depth"} <= set(options)
    assert "--no-eager" not in options, "a default-off bool is a plain switch, as `--enforce-eager` always was"
    assert "--internal" not in options, "a field without help is no setting"
    assert options["--max-batch-size"].help == "requests per step" and options["--max-batch-size"].default == 64
    assert options["--mode"].choices == ("auto", "off", "on")
    assert options["--tags"].metavar == "TAG" and options["--cache-gb"].metavar == "CACHE_GB"
    config = _parse(["hello"])
    assert config == Example(name="hello"), "every default is the dataclass's"
    config = _parse(["hi", "--max-batch-size", "8", "--cache-gb", "0.5", "--no-prefetch", "--eager", "--no-maybe"])
    assert (config.max_batch_size, config.cache_bytes, config.prefetch, config.eager, config.maybe) == (
        8,
        GIB // 2,
        False,
        True,
        False,
    )
    config = _parse(["hi", "--tags", "a", "--tags", "b", "--where", "/x", "--depth", "5", "--force-off"])
    assert (config.tags, config.where, config.inner, config.mode) == (("a", "b"), Path("/x"), Inner(5), "off")
    with pytest.raises(SystemExit):
        _parse(["hi", "--mode", "sideways"])


def test_a_role_default_and_help_replace_the_fields_and_skip_leaves_a_setting_out():
    parser = _parser(defaults={"cache_bytes": 2 * GIB}, helps={"mode": "the role's words"}, skip={"tags"})
    options = {o: a for a in parser._actions for o in a.option_strings}
    assert options["--cache-gb"].default == 2.0 and options["--mode"].help == "the role's words"
    assert "--tags" not in options
    assert config_from_args(Example, parser.parse_args(["x"])).cache_bytes == 2 * GIB


def test_environment_twins_set_defaults_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("LORASERVE_MAX_BATCH_SIZE", "12")
    monkeypatch.setenv("LORASERVE_CACHE_GB", "1")
    monkeypatch.setenv("LORASERVE_PREFETCH", "off")
    monkeypatch.setenv("LORASERVE_TAGS", "a,b")
    monkeypatch.setenv("LORASERVE_DEPTH", "9")
    config = _parse(["x"], env=True)
    assert (config.max_batch_size, config.cache_bytes, config.prefetch, config.tags, config.inner.depth) == (
        12,
        GIB,
        False,
        ("a", "b"),
        9,
    )
    assert _parse(["x", "--max-batch-size", "3"], env=True).max_batch_size == 3
    assert "LORASERVE_CACHE_GB" in _parser(env=True).format_help()


def test_a_switch_reads_its_own_twin_and_otherwise_leaves_the_setting_to_its_flag(monkeypatch):
    assert _parse(["x"], env=True).mode == "auto"
    monkeypatch.setenv("LORASERVE_MODE", "on")
    assert _parse(["x"], env=True).mode == "on"
    monkeypatch.setenv("LORASERVE_FORCE_OFF", "0")
    assert _parse(["x"], env=True).mode == "on", "a switch turned off by its twin changes nothing"
    monkeypatch.setenv("LORASERVE_FORCE_OFF", "1")
    assert _parse(["x"], env=True).mode == "off"
    monkeypatch.setenv("LORASERVE_FORCE_OFF", "perhaps")
    with pytest.raises(SystemExit, match="expected one of"):
        _parser(env=True)


def test_enforce_eager_and_its_twin_still_turn_graphs_off(monkeypatch):
    parser = EnvArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert config_from_args(EngineConfig, parser.parse_args(["--enforce-eager"])).cuda_graphs == "off"
    monkeypatch.setenv("LORASERVE_ENFORCE_EAGER", "1")
    parser = EnvArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert config_from_args(EngineConfig, parser.parse_args([])).cuda_graphs == "off"
    assert "LORASERVE_ENFORCE_EAGER" in parser.format_help()


def _round_trip(config, cls: type, defaults: dict | None = None, **values):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls, defaults=defaults)
    for changed_only in (False, True):
        argv = config_to_argv(config, changed_only=changed_only, defaults=defaults)
        assert config_from_args(cls, parser.parse_args(argv), **values) == config, (changed_only, argv)


ALL_SETTINGS = [
    CliSettings,
    ModelSettings,
    EngineConfig,
    WorkerConfig,
    GenerateSettings,
    StoreLimits,
    PersistenceConfig,
    StoreCommand,
    SchedulerConfig,
    GatewayConfig,
    FailoverConfig,
    TokenizingConfig,
    ConstraintConfig,
    TlsSettings,
    InternalAuthSettings,
    TracingSettings,
    MetricsSettings,
    UpSettings,
    KeysSettings,
    ShowSettings,
    BuildSettings,
]


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.__name__)
def test_every_role_configuration_at_its_defaults_round_trips(cls):
    positional = {"prompt": "hello", "action": "new"}
    values = {name: value for name, value in positional.items() if name in cls.__dataclass_fields__}
    _round_trip(cls(**values), cls)


def test_every_setting_changed_round_trips(tmp_path):
    profile = tmp_path / "profile.json"
    engine = EngineConfig(
        device="cpu", dtype="float16", backend="torch", max_batch_size=8, max_batched_tokens=512, max_model_len=256,
        max_lora_rank=16, rows_per_page=8, pool_pages=100, pool_memory_gb=1.5, gpu_memory_utilization=0.5,
        cpu_pool_memory_gb=0.25, adapter_pool_fraction=0.3, prefetch=False, prefix_cache=False, prefetch_depth=4,
        prefetch_reserve=0.2, seed=7, adapter_cache_bytes=GIB // 4, pad_decode_steps=True, cuda_graphs="uncaptured",
        warm_up="off", runner="emulated", runner_profile=profile,
    )  # fmt: skip
    _round_trip(engine, EngineConfig)
    _round_trip(engine, EngineConfig, WORKER_ENGINE_DEFAULTS)
    fetch = FetchConfig("tcp://b:2", 2.0, 4, False, None, True)
    core = str(min(os.sched_getaffinity(0)))
    _round_trip(WorkerConfig("w-1", "tcp://a:1", fetch, 0.5, 3.0, 3, 0.5, 4, cpu_cores=core), WorkerConfig)
    _round_trip(WorkerConfig(fetch=FetchConfig(shm_root=tmp_path)), WorkerConfig)
    store = StoreConfig(
        model_dir=tmp_path,
        limits=StoreLimits(max_lora_rank=8, max_adapter_bytes=2**20, budget_bytes=GIB, retention_s=5.0),
        bind="127.0.0.1:1",
        data_address="tcp://127.0.0.1:2",
        adapter_root=tmp_path,
        preload=(("a", tmp_path / "a"), ("b", tmp_path / "b")),
        purge_interval_s=3.0,
        persistence=PersistenceConfig(object_store="s3://b/p", object_store_endpoint="http://h:9"),
        adapter_rows=False,
        shm_root=None,
    )
    _round_trip(store, StoreConfig, model_dir=tmp_path)
    policy = PolicyConfig.of("fcfs", max_queue_length=5, worker_timeout_s=2.0, stale_after_s=1.0, prefetch_depth=3)
    _round_trip(SchedulerConfig("h:1", "tcp://h:2", policy), SchedulerConfig)
    gateway = GatewayConfig(
        bind="0.0.0.0:1", http_bind="127.0.0.1:2", http=ConnectionLimits(5, 1.0, 2.0, 3.0),
        tool_call_parser="hermes", auth_file=tmp_path / "auth.toml",
        insecure_no_auth=True, tls=TlsSettings(tmp_path / "c", tmp_path / "k", tmp_path / "ca"), scheduler="s:1",
        store="s:2", token_address="tcp://t:3", token_advertise="tcp://t:4", max_context=99,
        default_max_new_tokens=9, max_lora_rank=32, failover=FailoverConfig(1, 2.0, 3.0, 4.0), drain_timeout_s=5.0,
        tokenizing=TokenizingConfig(tokenizer_threads=3, tokenizer_queue=7),
        constraints=ConstraintConfig(constraint_workers=3, constraint_queue=5, constraint_timeout=0.5,
                                     constraint_memory_mib=512, constraint_cache=9),
    )  # fmt: skip
    _round_trip(gateway, GatewayConfig)
    _round_trip(GenerateSettings("a prompt", "upper", ("x=/y", "z=/w"), 3, 0.5, 4, 0.9, 11), GenerateSettings)
    up = UpSettings(
        workers=3, device="cuda:0,cuda:1", base_port=8000, adapter=("a=/b",), internal_keys="/k", torch_threads=2,
        child_log_level="INFO", ready_timeout=9.0, restart=False, show_demo=True, exit_after_demo=True,
        metrics_port=9100, tls_server_name="h", tls_client_cert=tmp_path / "c", tls_client_key=tmp_path / "k",
    )  # fmt: skip
    _round_trip(up, UpSettings)


# ---- no flag outside the configuration dataclasses ------------------------------------------------------
ROOT = Path(__file__).resolve().parents[3]
MECHANISM = {
    "loraserve/config_cli.py": "the one place that turns dataclass fields into flags",
    "loraserve/flags.py": "the parser's environment twins, which config_cli.py's flags go through",
}
ELSEWHERE = {
    "tests/": "tests build throw-away parsers to check the mechanism",
}


def test_no_role_writes_a_flag_by_hand():
    """Every command line (the roles', the bench suites', the bench's helper processes') comes from
    configuration dataclasses."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [
        p
        for p in tracked.stdout.split()
        if p not in MECHANISM and not p.startswith(tuple(ELSEWHERE)) and "/v1/" not in p and (ROOT / p).exists()
    ]
    assert "launcher/up.py" in files and "worker/main.py" in files and "bench/cli.py" in files
    by_hand = [p for p in files if re.search(r"\.add_argument\(", (ROOT / p).read_text())]
    assert by_hand == [], "flags belong in a configuration dataclass's fields (loraserve/config_cli.py)"


# ---- `loraserve up` hands each role its configuration ----------------------------------------------------
def _role_parsers() -> dict[str, argparse.ArgumentParser]:
    from loraserve.cli import build_parser

    roles = {"adapter-store": "adapter-store", "scheduler": "scheduler", "gateway": "gateway", "worker-0": "worker"}
    return {name: build_parser(command) for name, command in roles.items()}


def test_up_forwards_each_roles_settings_and_the_stacks_addresses(tmp_path, monkeypatch):
    from loraserve.launcher.commands import add_arguments, role_commands

    for var in ("LORASERVE_BIND", "LORASERVE_MAX_LORA_RANK", "LORASERVE_METRICS_PORT", "LORASERVE_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    up = argparse.ArgumentParser()
    add_arguments(up)
    argv = ["--base-port", "7400", "--max-lora-rank", "32", "--memory-budget-gb", "2", "--max-queue-length", "5"]
    argv += [
        "--http-max-connections",
        "7",
        "--fetch-threads",
        "3",
        "--max-batch-size",
        "8",
        "--data-dir",
        str(tmp_path),
    ]
    argv += ["--no-adapter-rows", "--shared-memory-root", "", "--policy", "fcfs", "--engine-seed", "9"]
    commands = role_commands(up.parse_args(argv))
    monkeypatch.setenv("LORASERVE_BIND", "0.0.0.0:1")  # what the stack chose is on the command line: no twin reaches it
    parsed = {}
    for name, parser in _role_parsers().items():
        line = commands[name]
        parsed[name] = parser.parse_args(line[line.index("--log-level") :])
    store = parsed["adapter-store"]
    assert (store.bind, store.max_lora_rank, store.budget_bytes, store.adapter_rows) == (
        "127.0.0.1:7402",
        32,
        2.0,
        False,
    )
    assert config_from_args(StoreConfig, store, model_dir=tmp_path).shm_root is None
    scheduler = config_from_args(SchedulerConfig, parsed["scheduler"])
    assert (scheduler.bind, scheduler.worker_address) == ("127.0.0.1:7400", "tcp://127.0.0.1:7401")
    assert (scheduler.policy.fcfs.max_queue_length, scheduler.policy.policy) == (5, "fcfs")
    gateway = config_from_args(GatewayConfig, parsed["gateway"])
    assert (gateway.scheduler, gateway.store, gateway.bind) == ("127.0.0.1:7400", "127.0.0.1:7402", "127.0.0.1:50051")
    assert (gateway.max_lora_rank, gateway.http.max_connections) == (32, 7)
    engine = config_from_args(EngineConfig, parsed["worker-0"])
    worker = config_from_args(WorkerConfig, parsed["worker-0"])
    assert (engine.max_lora_rank, engine.max_batch_size, engine.seed, engine.device) == (32, 8, 9, "cpu")
    assert engine.adapter_cache_bytes == WORKER_ENGINE_DEFAULTS["adapter_cache_bytes"]
    assert (worker.worker_id, worker.fetch.store_address, worker.fetch.fetch_threads) == (
        "worker-0",
        "tcp://127.0.0.1:7403",
        3,
    )
    assert (worker.fetch.adapter_rows, worker.fetch.shm_root) == (False, None)


def test_every_scheduler_policy_setting_is_a_flag_and_up_forwards_it(tmp_path):
    """Each policy part's settings (the cluster view's, both strategies', with nested size classes and step
    costs) reach `loraserve scheduler` as flags, at their one default when not given, and `up` forwards them."""
    from dataclasses import fields, is_dataclass
    from typing import get_type_hints

    from loraserve.cli import build_parser
    from loraserve.launcher.commands import role_commands
    from loraserve.scheduler.config import AdaptiveConfig

    scheduler = build_parser("scheduler")
    parsed = scheduler.parse_args(["scheduler"])
    assert config_from_args(SchedulerConfig, parsed) == SchedulerConfig()

    def leaves(cls: type) -> set[str]:
        hints = get_type_hints(cls)
        return {n for f in fields(cls) for n in (leaves(hints[f.name]) if is_dataclass(hints[f.name]) else {f.name})}

    reachable = set(vars(parsed))
    for cls in (ClusterConfig, AdaptiveConfig):
        assert leaves(cls) <= reachable, leaves(cls) - reachable

    given = ["--policy", "fcfs", "--max-queue-length", "99", "--starvation-s", "7", "--max-zombies", "5"]
    given += ["--size-class-bound", "100", "--size-class-bound", "900", "--step-cost-per-token-s", "0.001"]
    args = build_parser("up").parse_args(["up", "--model", str(tmp_path), *given])
    argv = role_commands(args)["scheduler"]
    config = config_from_args(SchedulerConfig, scheduler.parse_args(argv[argv.index("scheduler") :])).policy
    assert config.policy == "fcfs" and config.fcfs.max_queue_length == config.adaptive.max_queue_length == 99
    assert config.adaptive.starvation_s == 7.0 and config.cluster.max_zombies == 5
    assert config.adaptive.size_classes.bounds == (100.0, 900.0)  # given values replace the default, not extend it
    assert config.adaptive.step_cost.per_token_s == 0.001


# ---- `loraserve bench`: each suite's flags from its settings dataclass ------------------------------------
def _bench_args(argv: list[str]) -> argparse.Namespace:
    from loraserve.cli import build_parser

    return build_parser("bench", argv).parse_args(["bench", *argv])


def test_the_bench_parser_takes_the_suite_from_the_arguments_it_is_given(monkeypatch):
    """The suite (and so its flags) comes from the command line being parsed, not this process's: a suite with
    flags of its own and a shared-flag suite parse one after the other in one process."""
    from loraserve.bench.suites.kernels.suite import KernelsSettings
    from loraserve.bench.suites.serving.suite import ServingSettings

    monkeypatch.delenv("LORASERVE_SUITE", raising=False)
    monkeypatch.setattr("sys.argv", ["loraserve", "bench", "--suite", "gpu-check"])
    kernels = _bench_args(["--suite", "kernels", "--dry-run", "--ranks", "8", "mixed", "--batch-sizes", "2"])
    assert kernels.suite == "kernels"
    assert config_from_args(KernelsSettings, kernels) == KernelsSettings(
        ranks=(8, "mixed"), batch_sizes=(2,), dry_run=True
    )
    serving = _bench_args(["--quick", "--input-len", "4", "6", "--systems", "loraserve", "peft"])
    assert serving.suite == "serving" and serving.input_len == [4, 6] and serving.n_adapters is None
    assert config_from_args(ServingSettings, serving) == ServingSettings(
        quick=True, input_len=(4, 6), systems=("loraserve", "peft")
    )
    with pytest.raises(SystemExit):
        _bench_args(["--suite", "kernels", "--quick"])  # a shared flag: not the kernels suite's
    with pytest.raises(SystemExit):
        _bench_args(["--suite", "no-such-suite"])
    monkeypatch.setenv("LORASERVE_SUITE", "attention")
    assert _bench_args(["--dry-run"]).suite == "attention"


def test_every_bench_suite_parses_to_its_settings_defaults(monkeypatch):
    """Each suite's flags, not given, are its settings dataclass's defaults (one default per setting)."""
    import dataclasses

    from loraserve.bench import cli as bench_cli

    for var in [v for v in __import__("os").environ if v.startswith("LORASERVE_")]:
        monkeypatch.delenv(var)
    for suite in bench_cli.SUITES:
        args = _bench_args(["--suite", suite])
        names = (
            [suite] if suite in bench_cli.OWN_FLAGS else [n for n in bench_cli.SUITES if n not in bench_cli.OWN_FLAGS]
        )
        for name in names:
            module = bench_cli.suite_module(name)
            for cls in [v for v in vars(module).values() if isinstance(v, type) and v.__name__.endswith("Settings")]:
                if cls.__module__ != module.__name__ or not dataclasses.is_dataclass(cls):
                    continue
                if not all("help" in f.metadata for f in dataclasses.fields(cls)):
                    continue  # a suite's run settings, built from its flags and presets: no flags of its own
                assert config_from_args(cls, args) == cls(), (suite, cls.__name__)
