"""Bounded worker adapter cache, oversized uploads.

One real stack whose worker may keep almost no adapter in host RAM (`--adapter-cache-gb` tiny) and
whose store accepts weights files up to 1 MiB (`LORASERVE_MAX_ADAPTER_MB`, the flag's env twin):
- requests cycling through three adapters keep giving the same tokens while the worker evicts and
  fetches again, and the worker's metrics endpoint counts those evictions;
- an upload over the limit, streamed in chunks through the gateway, is refused mid-stream with
  INVALID_ARGUMENT naming --max-adapter-mb every time (not INTERNAL, not a hang, not the
  RESOURCE_EXHAUSTED clients retry), and the stack keeps serving.
"""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.v1 import gateway_pb2

pytestmark = pytest.mark.slow
CYCLED = ("upper", "rot13", "novowel")  # each under 1 MiB
TOO_LARGE = "reverse"  # 1.2 MiB of weights
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def stack():
    metrics = free_port_block(4)  # gateway, scheduler, store, worker-0
    adapters = demo_adapters()
    stack = LocalStack(
        DEMO_MODEL_DIR,
        1,
        adapter=[f"{name}={adapters[name]}" for name in CYCLED],
        adapter_cache_gb=1e-6,
        metrics_port=metrics,
    )
    with pytest.MonkeyPatch.context() as env:  # the children read these flags' environment twins
        env.setenv("LORASERVE_MAX_ADAPTER_MB", "1")
        env.setenv("LORASERVE_PRELOAD_DEMO", "0")  # the demo's "reverse" is over that limit
        stack.start()
    stack.wait_workers(1)
    stack.worker_metrics = f"http://127.0.0.1:{metrics + 3}/metrics"
    yield stack
    stack.stop()


def _tokens(stack, adapter: str) -> list[int]:
    request = gateway_pb2.GenerateRequest(adapter=adapter, text="the quiet king", max_new_tokens=8)
    return list(stack.api.Generate(request, timeout=60).token_ids)


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    match = re.search(rf'^{name}\{{worker="worker-0"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} not in the worker's metrics"
    return float(match.group(1))


def test_a_tiny_worker_cache_evicts_and_refetches_with_the_same_tokens(stack):
    first = {name: _tokens(stack, name) for name in CYCLED}
    assert len({tuple(t) for t in first.values()}) == len(CYCLED), "three adapters, three different outputs"
    again = {name: _tokens(stack, name) for name in CYCLED}
    assert again == first
    assert _metric(stack.worker_metrics, "loraserve_worker_host_cache_evictions_total") >= len(CYCLED)
    assert _metric(stack.worker_metrics, "loraserve_worker_host_cache_bytes") >= 0


def _upload(name: str, files: dict[str, bytes], chunk: int = 64 * 1024):
    yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
    for file, data in files.items():
        for i in range(0, len(data), chunk):
            yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file=file, data=data[i : i + chunk]))


def test_an_oversized_upload_through_the_gateway_is_refused_mid_stream_not_to_be_retried(stack):
    path = demo_adapters()[TOO_LARGE]
    files = {f: (path / f).read_bytes() for f in ("adapter_config.json", WEIGHTS)}
    outcomes = set()
    for _ in range(10):  # the refusal must not race with the gateway's relay of the stream
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stack.api.UploadAdapter(_upload("big", files), timeout=20)
        assert time.monotonic() - started < 5
        outcomes.add((refused.value.code(), "maximum adapter size" in refused.value.details()))
        assert "--max-adapter-mb" in refused.value.details()
    assert outcomes == {(grpc.StatusCode.INVALID_ARGUMENT, True)}
    listed = stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters
    assert "big" not in [a.name for a in listed]
    assert _tokens(stack, "upper") == _tokens(stack, "upper")
