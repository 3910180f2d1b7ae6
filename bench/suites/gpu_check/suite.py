"""The GPU suite in one command: GPU tests, kernel benchmark, engine at 7B shapes, stack overheads.

    loraserve bench --suite gpu-check [--out out/gpu-check] [--parts tests kernels engine stack]
    loraserve bench --suite gpu-check --dry-run      # the same driver on CPU at tiny shapes
    make gpu-check                                     # the same, from the repo's venv

Parts (each in its own process, under its own time limit, so one that fails or hangs loses
nothing of the others; GPU memory is returned between them):

    tests    every `gpu`-marked test (`pytest -m gpu`), counted from its JUnit XML
    kernels  batched LoRA shrink/expand and paged attention against torch baselines and the
             memory-bandwidth roofline (bench/suites/kernels/lora.py, bench/suites/kernels/attention.py)
    engine   the engine on a 7B-shaped random model: n = 1, 100, 1000 adapters, the base model
             alone, PEFT and merge-and-swap (bench/suites/gpu_check/engine.py)
    stack    gateway + scheduler + store + one worker against the in-process engine; adapter
             fetch and host-to-device copy at 7B shapes (bench/suites/gpu_check/stack.py)
    overhead `loraserve bench --suite overhead --quick` on the GPU: LoRA over the base model on
             small models, each with decode steps replayed from CUDA graphs and all eager

Writes --out/results.json (environment, every part's figures, the targets) and --out/results.md
(the same as Markdown tables), parts/<part>.json and logs/<part>.log. On a bare GPU machine with
no venv, `deploy/gpu-check.sh` installs the carried wheels and the project, then runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.results import suite_results
from loraserve.bench.common.settings import add_settings
from loraserve.bench.suites.gpu_check import report as gpu_report
from loraserve.bench.suites.gpu_check.preset import DRY_RUN, GPU, GpuPreset
from loraserve.config_cli import setting

PARTS = ("tests", "kernels", "engine", "stack", "overhead", "tensor-parallel")
# Seconds each part may take on the GPU (together about 11 minutes on one H100: where one command may
# run 10 minutes, run `--parts overhead` in a second one); dry runs get more per part, as a shared
# 2-core CPU is slow.
GPU_LIMITS_S = {"tests": 110, "kernels": 70, "engine": 260, "stack": 100, "overhead": 120, "tensor-parallel": 120}
DRY_RUN_LIMIT_S = 300


@dataclass(frozen=True)
class GpuCheckSettings:
    """The gpu-check suite's flags (its own alone)."""

    out: Path = setting(Path("out/gpu-check"), "results folder (created)")
    work: Path | None = setting(None, "scratch folder for the random model (default: --out/work)")
    parts: tuple[str, ...] = setting(PARTS, "the parts to run, in order", nargs="+", choices=PARTS)
    dry_run: bool = setting(False, "tiny shapes on CPU: exercises the whole driver")
    tests_dir: Path = setting(Path("tests"), "the test suite (for the tests part)")
    scale_limits: float = setting(1.0, "multiply every part's time limit")
    part: str | None = setting(None, argparse.SUPPRESS, choices=PARTS)  # internal: run one part in this process


SETTINGS = GpuCheckSettings


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`loraserve bench --suite gpu-check ARGV`'s flags."""
    p = argparse.ArgumentParser(prog="loraserve bench --suite gpu-check", description=__doc__.splitlines()[0])
    add_settings(p, SETTINGS)
    return p.parse_args(argv)


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {
            "device": props.name,
            "cuda": torch.version.cuda,
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _driver_version(),
        }
    else:
        env |= {"device": f"CPU ({platform.processor() or platform.machine()})", "cuda": None, "driver": None}
    return env


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


# ---- one part, in this process ---------------------------------------------------------------------
def run_tests(args: argparse.Namespace, out: Path) -> dict:
    """`pytest -m gpu` in a child process; counts and failures from its JUnit XML.

    pytest writes straight into this part's log, one line per test, so a run cut at its limit
    still shows how far it got and what each test took.
    """
    junit = out / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "--durations=15", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    sys.stdout.flush()
    done = subprocess.run([*command, "--junitxml", str(junit), str(args.tests_dir)], check=False)
    result = gpu_report.junit_counts(junit) if junit.is_file() else {"error": "pytest wrote no JUnit XML"}
    return result | {"exit_code": done.returncode, "seconds": round(time.perf_counter() - start, 1)}


def run_kernels(args: argparse.Namespace, out: Path) -> dict:
    """`loraserve bench --suite kernels --gpu-suite` (`--dry-run`: on the CPU): its report from its results.json."""
    saved = suite_results("kernels", out / "kernels", "--dry-run" if args.dry_run else "--gpu-suite")
    return {"lora": saved["records"], **{k: saved[k] for k in ("meta", "attention", "summary", "markdown")}}


def run_overhead(args: argparse.Namespace, preset: GpuPreset, out: Path, work: Path) -> dict:
    """`loraserve bench --suite overhead --quick` on the preset's device and backend; its results.json."""
    argv = ["--quick", "--adapter-cache", str(work), "--no-progress"]
    argv += ["--overhead-device", preset.device, "--overhead-backend", preset.backend]
    if args.dry_run:
        argv += ["--overhead-models", "demo", "--overhead-batch", "8", "--overhead-adapters", "4"]
        argv += ["--overhead-output-len", "3", "6", "--overhead-repeats", "1", "--overhead-scaling-n", "6"]
    return suite_results("overhead", out / "overhead", *argv)


def run_tensor_parallel(args: argparse.Namespace, out: Path, work: Path) -> dict:
    """`loraserve bench --suite tensor-parallel --quick` over the machine's GPUs (two or four ranks; skipped
    with one GPU); its results.json."""
    import torch

    argv = ["--quick", "--adapter-cache", str(work)]
    if args.dry_run:
        argv += ["--tp-models", "demo", "--tp-batch", "4", "--tp-output", "3", "--tp-repeats", "1"]
    else:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            return {"skipped": f"needs at least 2 CUDA devices; this machine has {gpus}"}
        sizes = ["1", "2", "4"] if gpus >= 4 else ["1", "2"]
        argv += ["--tp-device", "cuda", "--tp-models", "demo", "random-100m", "--tp-sizes", *sizes]
    return suite_results("tensor-parallel", out / "tensor-parallel", *argv)


def run_part(
    name: str, args: argparse.Namespace, preset: GpuPreset, out: Path, work: Path, partial: Callable[[dict], None]
) -> dict:
    if name == "tests":
        return run_tests(args, out)
    if name == "kernels":
        return run_kernels(args, out)
    if name == "engine":
        from loraserve.bench.suites.gpu_check import engine as gpu_engine

        return gpu_engine.run(preset, work, log=lambda line: print(line, flush=True), partial=partial)
    if name == "overhead":
        return run_overhead(args, preset, out, work)
    if name == "tensor-parallel":
        return run_tensor_parallel(args, out, work)
    from loraserve.bench.suites.gpu_check import stack as gpu_stack

    return gpu_stack.run(preset, work, log=lambda line: print(line, flush=True), partial=partial)


def part_main(args: argparse.Namespace) -> int:
    preset = DRY_RUN if args.dry_run else GPU
    out, work = args.out, args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    record_path = out / "parts" / f"{args.part}.json"

    def save(record: dict) -> None:
        record["seconds"] = round(time.perf_counter() - start, 1)
        tmp = record_path.with_suffix(".tmp")  # renamed into place: a cut never leaves half a record
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        tmp.rename(record_path)

    def partial(data: dict) -> None:
        save({"status": "partial", "data": data})

    try:
        record = {"status": "ok", "data": run_part(args.part, args, preset, out, work, partial)}
    except Exception as e:
        traceback.print_exc()
        record = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    save(record)
    return 0 if record["status"] == "ok" else 1


# ---- the driver ------------------------------------------------------------------------------------
def spawn_part(name: str, args: argparse.Namespace, limit_s: float) -> dict:
    """Run one part in a child process under `limit_s`; its record (or why there is none)."""
    command = [sys.executable, "-m", "loraserve.cli", "bench", "--suite", "gpu-check", "--part", name]
    command += ["--out", str(args.out), "--tests-dir", str(args.tests_dir)]
    if args.work:
        command += ["--work", str(args.work)]
    if args.dry_run:
        command.append("--dry-run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # Triton on CPU runs only interpreted; set before triton is imported
    record_path = args.out / "parts" / f"{name}.json"
    record_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with (args.out / "logs" / f"{name}.log").open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            cut = {"status": "timeout", "error": f"cut after {limit_s:.0f} s", "seconds": round(limit_s, 1)}
            if record_path.is_file():  # the figures it had when it was cut
                cut["data"] = json.loads(record_path.read_text()).get("data")
            return cut
        finally:
            if child.poll() is None:  # over its limit, or the driver itself is stopped (SIGTERM, Ctrl-C)
                os.killpg(child.pid, signal.SIGKILL)  # the part and whatever it started (a stack's processes)
                child.wait()
    if record_path.is_file():
        return json.loads(record_path.read_text())
    return {
        "status": "failed",
        "error": f"exited with {child.returncode} and no record",
        "seconds": round(time.perf_counter() - start, 1),
    }


def drive(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict:
    for folder in ("parts", "logs"):
        (args.out / folder).mkdir(parents=True, exist_ok=True)
    results = {"preset": "dry-run" if args.dry_run else "gpu", "environment": environment(), "parts": {}}
    say(f"gpu-check on {results['environment']['device']}: parts {' '.join(args.parts)}")
    for name in args.parts:
        limit = (DRY_RUN_LIMIT_S if args.dry_run else GPU_LIMITS_S[name]) * args.scale_limits
        record = spawn_part(name, args, limit)
        results["parts"][name] = record
        say(f"  {name}: {record['status']} in {record.get('seconds', '?')} s {record.get('error', '')}".rstrip())
        gpu_report.write(results, args.out)  # after every part: a later hang loses nothing
    return results


def main(args: argparse.Namespace) -> int:
    if args.part:
        return part_main(args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check needs a CUDA device; on CPU use --dry-run", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds spawn_part, which stops its part
    results = drive(args)
    print(gpu_report.markdown(results))
    return 0 if all(p["status"] == "ok" for p in results["parts"].values()) else 1
