"""loraserve against vLLM's CPU build on the same machine, the same model and the same adapters.

    loraserve bench --suite peer --quick --out docs/peer      # 5.5 min on 2 cores (vLLM compiles cached)
    loraserve bench --suite peer --out /tmp/peer               # the full preset
    loraserve bench --suite peer --peer-systems loraserve --model DIR --out /tmp/p   # no vLLM at all

Both serve a random Llama (`random_model.py`, `--shape`) or `--model DIR`, with `--adapters` synthetic
PEFT adapters on every projection saved in `--peer-adapter-dtype` under `--cache-dir`: vLLM from its venv
(`vllm.py`), loraserve as the real stack with its OpenAI HTTP edge (`loraserve_server.py`, compiled unless
`--no-loraserve-compile`), both in `--dtype`, on `--threads` threads, no prefix cache.

Pairings (`--peer-pairings`, `plan.py`): `base` (vLLM without --enable-lora, its compiled path; requests
name no adapter) and `lora` (vLLM with the adapters; requests round-robin over them). Each pairing starts
its vLLM server, warms both up, alternates timed runs (`--peer-repeats` each) of the same requests through
one client (`client.py`), then checks greedy agreement untimed (logprobs=0). Figures and targets:
`figures.py`. Where vLLM cannot be installed or started, the suite records why (a record with `error`) and
runs loraserve's half; vLLM's targets are then None, met False.

Both servers of a pairing stay up during its runs (`idle_cpu_s_per_s`: what each uses idle). vLLM's engine
polls (a third of a core here), so it is paused (SIGSTOP) during loraserve's runs unless `--no-pause-idle`;
loraserve's stack is not (its scheduler would count a stopped worker's silence as a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.bench.common.settings import config_from_args
from loraserve.bench.suites.peer import figures
from loraserve.bench.suites.peer.client import Completion, send_all
from loraserve.bench.suites.peer.fixtures import adapter_dirs, ensure_model
from loraserve.bench.suites.peer.loraserve_server import LoraserveOptions, LoraserveServer
from loraserve.bench.suites.peer.plan import PAIRINGS, Request, Run, alternation, requests
from loraserve.bench.suites.peer.processes import Server, tree_cpu_seconds
from loraserve.bench.suites.peer.vllm import VllmOptions, VllmServer, VllmUnavailable, ensure_venv
from loraserve.config_cli import setting
from loraserve.model_config import ModelConfig
from loraserve.tokenizer import Tokenizer

CACHE = Path.home() / ".cache" / "loraserve"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PeerPreset(Preset):
    """What one run sends, and how many runs: the quick and full presets (flags override each)."""

    peer_repeats: int
    requests: int
    concurrency: int
    prompt_len: int
    max_tokens: int


QUICK = PeerPreset(peer_repeats=3, requests=32, concurrency=8, prompt_len=32, max_tokens=64)
FULL = PeerPreset(peer_repeats=5, requests=64, concurrency=16, prompt_len=64, max_tokens=128)


@dataclass(frozen=True)
class PeerSettings:
    """The peer suite's flags (its own alone). A None numbers flag takes the preset's value."""

    quick: bool = setting(False, "the quick preset (fits 15 minutes on 2 cores, vLLM's compiles included)")
    out: Path | None = setting(None, "write DIR/results.json")
    peer_systems: str = setting(
        "both", "both, or loraserve alone (vLLM is then neither installed nor started)", choices=("both", "loraserve")
    )
    peer_pairings: tuple[str, ...] = setting(PAIRINGS, "pairings: base (no adapter), lora (the adapters)", nargs="+")
    peer_repeats: int | None = setting(None, "timed runs per system and pairing, alternating (quick 3, full 5)")
    requests: int | None = setting(None, "requests per run (quick 32, full 64)")
    concurrency: int | None = setting(None, "requests in flight (quick 8, full 16)")
    prompt_len: int | None = setting(None, "prompt tokens per request (quick 32, full 64)")
    max_tokens: int | None = setting(None, "output tokens per request, EOS ignored (quick 64, full 128)")
    adapters: int = setting(16, "adapters in the lora pairing")
    peer_adapter_dtype: str = setting("float32", "the adapters' files' dtype (both read the same)", choices=DTYPES)
    ranks: tuple[int, ...] = setting((8, 16, 32), "adapter ranks, round-robin", nargs="+")
    model: Path | None = setting(None, "model directory (default: a random Llama of --shape, written once)")
    shape: tuple[int, ...] = setting(
        (768, 8, 12, 4, 2048),
        "the random Llama's shape",
        nargs=5,
        metavars=("HIDDEN", "LAYERS", "HEADS", "KV_HEADS", "INTERMEDIATE"),
    )
    dtype: str = setting("float32", "both systems' dtype", choices=DTYPES)
    threads: int = setting(1, "compute threads of each system (the other cores serve HTTP and the roles)")
    pool_gb: float = setting(1.0, "loraserve's page pool (GiB)")
    loraserve_compile: bool = setting(True, "loraserve's worker with --compile (its layers compiled, as vLLM's base)")
    vllm_kvcache_gb: int = setting(1, "vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    vllm_venv: Path = setting(CACHE / "vllm-venv", "vLLM's venv (installed there the first time)")
    vllm_start_timeout: float = setting(900.0, "seconds to wait for a vLLM server's /health (it compiles first)")
    cache_dir: Path = setting(
        CACHE / "peer", "where the random model and the adapters are written once, and vLLM's logs"
    )
    pause_idle: bool = setting(
        True, "pause (SIGSTOP) the other system's server during a timed run where it can be: vLLM's engine polls idle"
    )
    idle_window: float = setting(3.0, "seconds each server is watched idle after its warm-up (0: not at all)")
    seed: int = setting(0, "")


SETTINGS = PeerSettings


def resolve(settings: PeerSettings) -> PeerSettings:
    """`settings` with every unset number taken from its preset."""
    preset = QUICK if settings.quick else FULL
    chosen = {k: v for k, v in asdict(preset).items() if getattr(settings, k) is None}
    bad = sorted(set(settings.peer_pairings) - set(PAIRINGS))
    if bad:
        raise ValueError(f"unknown pairings {bad}: choose from {PAIRINGS}")
    return replace(settings, **chosen)


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    settings = resolve(config_from_args(PeerSettings, args))
    result = run(settings)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print(f"peer suite: {result['elapsed_s']:.0f} s")
    publish(settings.out, "peer", result.pop("records"), threads=settings.threads, **result)
    return 0


def run(settings: PeerSettings) -> dict:
    """Every pairing, both systems (or loraserve's half alone); the results' fields."""
    model_dir = settings.model or ensure_model(settings.cache_dir, settings.shape, settings.seed)
    config = ModelConfig.from_dir(model_dir)
    s = settings
    adapters = adapter_dirs(model_dir, s.adapters, s.ranks, s.cache_dir, s.seed, s.peer_adapter_dtype)
    tokenizer = Tokenizer.from_model_dir(model_dir)

    def decode(token_id: int) -> str:  # one token alone, as loraserve's logprobs name it
        return tokenizer.decode([token_id], skip_special_tokens=False)

    base_name = Path(model_dir).name  # loraserve's id of the base model; vLLM serves it under the same name
    vllm: dict = {"wanted": settings.peer_systems == "both", "python": None, "error": None, "servers": []}
    python = None
    if vllm["wanted"]:
        try:
            python = ensure_venv(settings.vllm_venv, settings.vllm_venv.with_name("vllm-install.log"))
            vllm["python"] = str(python)
        except VllmUnavailable as e:
            vllm["error"] = str(e)
            print(f"vLLM unavailable: {e}", flush=True)
    records: list[dict] = []
    agreement: dict[str, dict] = {}
    idle_cpu: dict[str, dict[str, float | None]] = {}  # pairing -> system -> CPU s/s used idle
    options = LoraserveOptions(Path(model_dir), s.dtype, s.concurrency, s.threads, s.pool_gb, s.loraserve_compile)
    loraserve = LoraserveServer.start(options, adapters if "lora" in s.peer_pairings else {})
    try:
        for pairing in settings.peer_pairings:
            servers: dict[str, Server] = {}
            if python is not None:
                server = _start_vllm(python, settings, Path(model_dir), base_name, config, pairing, adapters, vllm)
                if server is None:
                    records.append({"pairing": pairing, "system": "vllm", "error": vllm["servers"][-1]["error"]})
                else:
                    servers["vllm"] = server
            servers["loraserve"] = loraserve
            try:
                sends = _requests(settings, pairing, config, base_name, adapters)
                idle_cpu[pairing] = {}
                texts, tokens = _pairing(settings, pairing, servers, sends, records, idle_cpu[pairing], decode)
            finally:
                if "vllm" in servers:
                    servers["vllm"].stop()
            agreement[pairing] = _agreement(texts, tokens)
    finally:
        loraserve.stop()
    medians = {p: {s: figures.median_tokens_per_s(records, p, s) for s in ("vllm", "loraserve")} for p in PAIRINGS}
    return {
        "records": records,
        "targets": figures.targets(records, agreement, settings.adapters),
        "agreement": agreement,
        "idle_cpu_s_per_s": idle_cpu,
        "medians": medians,
        "vllm": vllm,
        "model": {"dir": str(model_dir), "parameters_m": round(_parameters(config) / 1e6, 1), "name": base_name},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
    }


def _requests(
    settings: PeerSettings, pairing: str, config: ModelConfig, base_name: str, adapters: dict[str, Path]
) -> tuple[list[Request], list[Request]]:
    """(the timed runs' requests, the warm-up's): other prompts for the warm-up, and at least one
    request per adapter, so every adapter is loaded before the clock starts."""
    names = list(adapters)
    plan = requests(pairing, settings.requests, settings.prompt_len, config.vocab_size, base_name, names, settings.seed)
    count = max(settings.concurrency, len(names))
    warm = requests(pairing, count, settings.prompt_len, config.vocab_size, base_name, names, settings.seed + 1)
    return plan, warm


def _start_vllm(
    python: Path,
    settings: PeerSettings,
    model_dir: Path,
    base_name: str,
    config: ModelConfig,
    pairing: str,
    adapters: dict[str, Path],
    vllm: dict,
) -> VllmServer | None:
    """The pairing's vLLM server, or None with the reason in `vllm["servers"]`."""
    options = VllmOptions(
        model_dir, base_name, settings.dtype, config.max_position_embeddings, settings.concurrency,
        settings.threads, settings.vllm_kvcache_gb, settings.seed,
    )  # fmt: skip
    log_file = settings.cache_dir / "logs" / f"vllm-{pairing}.log"  # the last start's, kept beside the model
    entry: dict = {"pairing": pairing, "log": str(log_file), "started_s": None, "notes": [], "error": None}
    vllm["servers"].append(entry)
    lora, ranks = adapters if pairing == "lora" else None, max(settings.ranks)
    try:
        server = VllmServer.start(python, options, log_file, settings.vllm_start_timeout, lora, ranks)
    except VllmUnavailable as e:
        entry["error"] = str(e)
        print(f"vLLM ({pairing}) did not start: {e}", flush=True)
        return None
    entry["started_s"], entry["notes"] = round(server.started_s, 1), server.notes
    return server


Outputs = dict[str, list[figures.Output]]  # system -> one output per request


def _pairing(
    settings: PeerSettings,
    pairing: str,
    servers: dict[str, Server],
    sends: tuple[list[Request], list[Request]],
    records: list[dict],
    idle: dict[str, float | None],
    decode: Callable[[int], str],
) -> tuple[dict[str, list[list[figures.Output]]], Outputs]:
    """Warm each system up and measure it idle (into `idle`), the alternating timed runs, then the
    agreement check (the requests once more, with logprobs=0, untimed); returns each system's texts
    per timed run and its tokens."""
    plan, warm = sends
    for name, server in servers.items():
        asyncio.run(send_all("127.0.0.1", server.port, warm, settings.concurrency, 4))
        idle[name] = _idle_cpu(server, settings.idle_window)
    texts: dict[str, list[list[figures.Output]]] = {name: [] for name in servers}
    for run in alternation(pairing, tuple(servers), settings.peer_repeats):
        server = servers[run.system]
        if not server.alive():
            records.append({"pairing": pairing, "system": run.system, "repeat": run.repeat, "error": "server exited"})
            continue
        others = [s for name, s in servers.items() if name != run.system] if settings.pause_idle else []
        for other in others:
            other.pause()
        try:
            completions, seconds, cpu = _timed(server, plan, settings)
        finally:
            for other in others:
                other.resume()
        record = figures.run_record(run, completions, seconds, cpu, settings.max_tokens)
        records.append(record)
        texts[run.system].append([c.text if c.error is None else None for c in completions])
        _print(run, record)
    tokens: Outputs = {}
    for name, server in servers.items():
        if server.alive():
            checked, _ = asyncio.run(
                send_all("127.0.0.1", server.port, plan, settings.concurrency, settings.max_tokens, check=True)
            )
            tokens[name] = [_tokens(c, decode) for c in checked]
    return texts, tokens


def _idle_cpu(server: Server, seconds: float) -> float | None:
    """CPU seconds per second that `server` uses while nothing is sent: what an idle server takes
    from the other one's runs (both stay up during a pairing). None for a window of 0."""
    if seconds <= 0:
        return None
    cpu0 = tree_cpu_seconds(server.pids)
    time.sleep(seconds)
    return round((tree_cpu_seconds(server.pids) - cpu0) / seconds, 3)


def _tokens(c: Completion, decode: Callable[[int], str]) -> tuple[str, ...] | None:
    """A checked completion's tokens as agreement compares them (`figures.py`): its ids decoded one by
    one where the server sent ids, else the texts its logprobs name; None if it failed or named none."""
    if c.error is not None:
        return None
    texts = [decode(i) for i in c.token_ids] if c.token_ids else c.token_texts
    return figures.canonical_tokens(texts) if texts else None


def _timed(server: Server, plan: list[Request], settings: PeerSettings) -> tuple[list[Completion], float, float]:
    cpu0 = tree_cpu_seconds(server.pids)
    completions, seconds = asyncio.run(
        send_all("127.0.0.1", server.port, plan, settings.concurrency, settings.max_tokens)
    )
    return completions, seconds, tree_cpu_seconds(server.pids) - cpu0


def _agreement(texts: dict[str, list[list[figures.Output]]], tokens: Outputs) -> dict:
    """How many checked requests named their tokens on each system, each system's agreement with
    itself across its timed runs; with both systems, their agreement on tokens (`figures.agreement`)
    and the fraction of identical texts (first timed run of each)."""
    found: dict = {
        "checked": {name: sum(t is not None for t in outputs) for name, outputs in tokens.items()},
        "self": {name: figures.self_agreement(runs) for name, runs in texts.items()},
    }
    if not all(tokens.get(s) for s in ("vllm", "loraserve")):
        return found
    found |= figures.agreement(tokens["vllm"], tokens["loraserve"], ("vllm", "loraserve"))
    same_text = figures.agreement(texts["vllm"][0], texts["loraserve"][0]) if all(texts.values()) else None
    found["identical_text_fraction"] = None if same_text is None else same_text["fraction"]
    return found


def _print(run: Run, r: dict) -> None:
    cpu = "–" if r["cpu_s_per_token"] is None else f"{1000 * r['cpu_s_per_token']:.2f} ms"
    print(
        f"{run.pairing:4s} {run.system:9s} #{run.repeat}  {r['tokens_per_s']} tok/s  TTFT p50 {r['ttft_p50_s']} s"
        f"  ITL p50 {r['itl_p50_s']} s p99 {r['itl_p99_s']} s  CPU/token {cpu}  errors {r['errors']}",
        flush=True,
    )


def _parameters(config: ModelConfig) -> int:
    kv = config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    layer = 2 * config.hidden_size * q + 2 * config.hidden_size * kv + 3 * config.hidden_size * config.intermediate_size
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * layer + embeddings
