"""Shared fixtures. Sets TRITON_INTERPRET=1 on machines without CUDA, before anything imports triton.

Tests that run Triton kernels take `kernel_device`: "cpu" (interpreted) without CUDA, "cuda"
(compiled, marked `gpu`) with it; see helpers.KERNEL_DEVICES.

With CI set, every property test is derandomized and replays nothing from a local example database:
the profile loaded here is the default of each `settings(...)` the test modules make (they are imported
after this file), so a run checks the same examples on every machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests import the shared helpers in support/ by name (`helpers`, `stack`, ...), and a test module
# of any folder by its name (`from test_scheduler_policy import request`): file names are unique.
sys.path.insert(0, str(Path(__file__).parent / "support"))
sys.path.extend(sorted({str(p.parent) for p in Path(__file__).parent.glob("*/**/test_*.py")}))

import pytest
from helpers import KERNEL_DEVICES, TinySpec, make_adapter, make_model
from hypothesis import settings
from stack import Collector

# Under pytest-xdist (`make test`'s parallel folders) the workers share the cores: a torch thread pool
# each as wide as the machine would oversubscribe it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1) // _WORKERS))

if os.environ.get("CI", "").lower() not in ("", "0", "false"):
    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _data_home(tmp_path_factory) -> Iterator[Path]:
    """Adapter stores started by tests (and `loraserve up`'s per-stack data dirs) write below a temp
    XDG_DATA_HOME, never into ~/.local/share; child processes inherit it."""
    previous = os.environ.get("XDG_DATA_HOME")
    home = tmp_path_factory.mktemp("xdg-data-home")
    os.environ["XDG_DATA_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = previous


AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server (moto's, in a thread of this process) on a free loopback port. Test
    credentials are in the environment while it runs, so child processes find them too."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in AWS_TEST_ENV}
    os.environ.update(AWS_TEST_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module", params=KERNEL_DEVICES)
def kernel_device(request) -> str:
    """The device a test runs Triton kernels on: cpu under the interpreter, or cuda (the `gpu` suite)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama with grouped-query attention and an MLP width not a multiple of the KV width."""
    return make_model(tmp_path_factory.mktemp("tiny") / "model", TinySpec())


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory) -> dict[str, Path]:
    """Adapters of mixed ranks and targets, saved by peft: name -> directory."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "r4-qv": make_adapter(tiny_model, root / "r4-qv", 4, ["q_proj", "v_proj"], seed=1),
        "r16-all-rslora": make_adapter(tiny_model, root / "r16", 16, "all-linear", use_rslora=True, seed=2),
        "r8-kod-layer1": make_adapter(
            tiny_model, root / "r8", 8, ["k_proj", "o_proj", "down_proj"], layers_to_transform=[1], seed=3
        ),
        "r64-mlp": make_adapter(tiny_model, root / "r64", 64, ["gate_proj", "up_proj", "down_proj"], seed=4, std=0.03),
    }


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    """An OTLP trace collector on a free port, for stacks whose spans a test reads."""
    collector = Collector()
    yield collector
    collector.stop()
