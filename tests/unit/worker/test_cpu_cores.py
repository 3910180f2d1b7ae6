"""`--cpu-cores`: a CPU worker pinned to cores, its threads with it (`worker/cpu_cores.py`).

- Lists of cores parse as Linux writes them; anything else, or a core this process may not use, is an
  InvalidConfigError naming it (the worker's config refuses it at start).
- A real worker process started with `--cpu-cores` runs its step loop on that core while it steps, and
  the threads that wait on sockets (its I/O thread, which sends the heartbeats, and ZMQ's) wherever the OS
  puts them. Idle, its step loop is not pinned (`StepCores`): a thread that mostly sleeps on a core a busy
  process computes on was measured waiting 8 s there to run, holding up the interpreter and with it the
  heartbeats; with `--pin-all-threads` it stays pinned. No other Python thread stays pinned either: those
  started while the engine loads are freed after it, those the pinned step loop starts when it next idles.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidConfigError
from loraserve.worker.config import WorkerConfig
from loraserve.worker.cpu_cores import StepCores, parse_cores, pinned

ALLOWED = sorted(os.sched_getaffinity(0))


def test_lists_of_cores_parse_as_linux_writes_them():
    first = ALLOWED[0]
    assert parse_cores("") == frozenset()
    assert parse_cores(f"{first}") == {first}
    assert parse_cores(",".join(map(str, ALLOWED))) == set(ALLOWED)
    assert parse_cores(f" {first}-{first} , {first}") == {first}


@pytest.mark.parametrize("text", ["x", "1-", "-1", "3-1", "1.5", "1;2"])
def test_a_malformed_list_is_refused_naming_the_part(text):
    with pytest.raises(InvalidConfigError, match="is not a core or a range of cores"):
        parse_cores(text)


def test_a_core_this_process_may_not_use_is_refused_by_the_workers_config():
    missing = max(ALLOWED) + 1
    with pytest.raises(InvalidConfigError, match=rf"cores \[{missing}\] are not among this process's"):
        WorkerConfig(cpu_cores=f"{ALLOWED[0]},{missing}")


def _allowed(task: Path) -> str:
    line = next(x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list"))
    return line.split(":")[1].strip()


def _started(argv: list[str], log: Path) -> subprocess.Popen:
    """A worker process (no scheduler: it warms up alone) once it says it is ready."""
    with log.open("w") as out:
        worker = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text():
        if worker.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            raise AssertionError(log.read_text()[-2000:])
        time.sleep(0.2)
    return worker


def _worker_argv(*flags: str) -> list[str]:
    argv = [sys.executable, "-m", "loraserve.cli", "worker", "--model", str(DEMO_MODEL_DIR), *flags]
    return [*argv, "--torch-threads", "1", "--scheduler-address", "tcp://127.0.0.1:9"]


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin to one")
def test_a_worker_started_with_cpu_cores_runs_its_threads_there(tmp_path):
    core = ALLOWED[-1]
    worker = _started(_worker_argv("--cpu-cores", str(core)), tmp_path / "worker.log")
    try:
        tasks = {t.name: t for t in Path(f"/proc/{worker.pid}/task").iterdir()}
        step_loop = tasks[str(worker.pid)]  # the main thread: pinned for its warm-up, then idle, so anywhere
        deadline = time.monotonic() + 10
        while _allowed(step_loop) != _allowed(Path("/proc/self")):
            assert time.monotonic() < deadline, f"the idle step loop stays on {_allowed(step_loop)}"
            time.sleep(0.1)
        zmq_io = [t for t in tasks.values() if (t / "comm").read_text().startswith("ZMQbg/IO")]
        assert zmq_io and all(_allowed(t) == _allowed(Path("/proc/self")) for t in zmq_io)
    finally:
        worker.terminate()
        worker.wait(30)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin to one")
def test_pin_all_threads_puts_every_thread_on_those_cores(tmp_path):
    core = ALLOWED[-1]
    worker = _started(_worker_argv("--cpu-cores", str(core), "--pin-all-threads"), tmp_path / "worker.log")
    try:
        tasks = list(Path(f"/proc/{worker.pid}/task").iterdir())
        assert any((t / "comm").read_text().startswith("ZMQbg/IO") for t in tasks)
        assert {t.name: _allowed(t) for t in tasks} == {t.name: str(core) for t in tasks}
    finally:
        worker.terminate()
        worker.wait(30)


def test_pin_all_threads_without_cores_is_refused():
    with pytest.raises(InvalidConfigError, match="pin_all_threads needs cpu_cores"):
        WorkerConfig(pin_all_threads=True)


def _in_a_thread(call):
    """`call()` on a thread of its own (its cores are its own), returning what it returned."""
    out = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join(10)
    return out[0]


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin to one")
def test_the_step_loop_is_pinned_to_step_and_free_to_wait():
    core = frozenset({ALLOWED[-1]})

    def turns(cores: StepCores) -> list[set[int]]:
        seen = []
        for idle in (False, True, True, False):
            cores.use(idle=idle)
            seen.append(os.sched_getaffinity(0))
        return seen

    everywhere = set(ALLOWED)
    assert _in_a_thread(lambda: turns(StepCores(core))) == [core, everywhere, everywhere, core]
    assert _in_a_thread(lambda: turns(StepCores(core, idle_cores=core))) == [core] * 4  # --pin-all-threads
    assert _in_a_thread(lambda: turns(StepCores(frozenset()))) == [everywhere] * 4  # no --cpu-cores: untouched
    assert WorkerConfig(cpu_cores=str(ALLOWED[-1]), pin_all_threads=True).step_cores().idle_cores == core


class Sleeper:
    """A Python thread that waits until stopped; `cores` says where it may run."""

    def __init__(self):
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._stop.wait, daemon=True)
        self.thread.start()

    @property
    def cores(self) -> set[int]:
        return os.sched_getaffinity(self.thread.native_id)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores to pin to one")
def test_python_threads_started_while_pinned_do_not_stay_pinned():
    core = frozenset({ALLOWED[-1]})

    def loading() -> tuple[set[int], set[int]]:
        with pinned(core):  # the engine loads: a library starts a Python thread
            sleeper = Sleeper()
            inside = sleeper.cores
        after = sleeper.cores
        sleeper.stop()
        return inside, after

    assert _in_a_thread(loading) == (core, set(ALLOWED))

    def stepping() -> tuple[set[int], set[int]]:
        cores = StepCores(core)
        cores.use(idle=False)
        sleeper = Sleeper()  # a pool's worker, started by the step loop on first use
        inside = sleeper.cores
        cores.use(idle=True)
        after = sleeper.cores
        sleeper.stop()
        return inside, after

    assert _in_a_thread(stepping) == (core, set(ALLOWED))
