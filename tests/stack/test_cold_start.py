"""Cold adapters on a real stack (store, scheduler, worker with the real runner, gateway, as processes).

- The gateway's hint alone (`PrepareAdapter`, no request submitted) makes the worker placement would choose
  fetch the adapter and copy it into its pool: it is resident before any request for it is placed.
- A generation through the gateway hints the scheduler (its counter moves) and, with its adapter resident
  nowhere (fetched as rows, mapped from the store's shared memory, loaded layer by layer on the request's
  path), gives exactly the tokens the same request gives warm.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from stack import LocalStack, free_port_block, scrape_metrics
from store_proc import files, upload_requests

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.shared_memory import user_dir
from loraserve.v1 import common_pb2, gateway_pb2, scheduler_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    metrics_port = free_port_block(4)  # gateway, scheduler, adapter store, the worker
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, metrics_port=metrics_port)
    stack.metrics_port = metrics_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def _upload(stack: LocalStack, name: str, demo: str) -> None:
    config, weights = files(demo)
    parts = [("adapter_config.json", config), ("adapter_model.safetensors", weights)]
    stack.api.UploadAdapter(upload_requests(name, parts), timeout=30)


def _resident(stack: LocalStack, adapter: str) -> bool:
    return any(adapter in w.resident_adapters for w in stack.cluster().workers)


def test_a_hint_alone_makes_the_chosen_worker_load_the_adapter(stack):
    _upload(stack, "hinted", "snake")
    assert not _resident(stack, "hinted@1")
    hint = scheduler_pb2.PrepareAdapterRequest(adapter="hinted", adapter_version=1, adapter_rank=8)
    answer = stack.scheduler.PrepareAdapter(hint, timeout=5, metadata=stack.internal_metadata)
    assert answer.worker_id == "worker-0"
    deadline = time.monotonic() + 20
    while not _resident(stack, "hinted@1"):  # no request was submitted: the hint alone brought it
        assert time.monotonic() < deadline, "the hinted adapter never became resident"
        time.sleep(0.05)
    again = stack.scheduler.PrepareAdapter(hint, timeout=5, metadata=stack.internal_metadata)
    assert again.worker_id == ""  # resident there now: nothing to do


def test_a_cold_generation_is_hinted_and_token_exact_with_the_warm_one(stack):
    _upload(stack, "cold", "title")
    assert not _resident(stack, "cold@1")
    scheduler_port = stack.metrics_port + 1
    before = scrape_metrics(scheduler_port).get(("loraserve_scheduler_adapter_hints_total", ()), 0.0)
    request = gateway_pb2.GenerateRequest(
        adapter="cold", text="the cat sat on the mat", max_new_tokens=12, sampling=common_pb2.SamplingParameters()
    )
    cold = stack.api.Generate(request, timeout=60)
    warm = stack.api.Generate(request, timeout=60)
    assert list(cold.token_ids) == list(warm.token_ids) and len(cold.token_ids) > 0
    after = scrape_metrics(scheduler_port)[("loraserve_scheduler_adapter_hints_total", ())]
    assert after == before + 1  # the cold request's hint started the fetch; the warm one's found it resident
    maps = Path(f"/proc/{stack.process('worker-0').pid}/maps").read_text()
    assert f"{user_dir()}/p" in maps and ".rows" in maps  # the worker mapped the store's rows: none were sent
