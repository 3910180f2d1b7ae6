"""The adapter store's bounds, on real processes.

- Restarted with many adapters, the store never answers from a partial set: while it loads its
  catalogue, List, Describe and fetches are refused UNAVAILABLE (and health is not SERVING); once
  they answer, they answer everything.
- Many uploads of new versions of one adapter (each retained) leave the store's open descriptors
  where they were: a version's shared-memory rows file is mapped only while it is filled or sent,
  and a retained version is still fetched (over the socket, or by its file).
- An adapter over `--max-adapter-mb` is refused as not worth retrying: HTTP 413 naming `lora_path`
  at `/v1/load_lora_adapter`, and INVALID_ARGUMENT naming the flag over gRPC (the gateway's
  RegisterAdapterFromPath and UploadAdapter, the store's own Upload), never RESOURCE_EXHAUSTED (429),
  which clients retry.
"""

from __future__ import annotations

import http.client
import json
import os
import time

import grpc
import pytest
from emulated import fixed_profile
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import LocalStack, free_port_block
from store_proc import SERVICE, StoreProcess, files, upload, upload_requests

from loraserve.adapter_store.client import AdapterFetcher, FetchedRows
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import NotFoundError, UnavailableError
from loraserve.model_config import ModelConfig
from loraserve.shared_memory import user_dir
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.slow
ADAPTERS = 200  # stored before the restart: their restore takes a while, long enough to be asked meanwhile
UPLOADS = 120  # new versions of one adapter, every one retained (the default retention is 10 minutes)
DEMO = set(demo_adapters())  # preloaded by a store of the demo model
MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20)]
FAST_RECONNECT += [("grpc.max_reconnect_backoff_ms", 50)]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_restarted_store_never_lists_a_partial_set(tmp_path):
    data = tmp_path / "data"
    first = StoreProcess(tmp_path, "--data-dir", str(data)).wait_serving()
    try:
        for i in range(ADAPTERS):
            upload(first, f"a-{i:03d}", "upper")
        expected = DEMO | {f"a-{i:03d}" for i in range(ADAPTERS)}
        assert set(first.listed()) == expected
    finally:
        first.stop()
    store = StoreProcess(tmp_path, "--data-dir", str(data))
    last = f"a-{ADAPTERS - 1:03d}"  # restored last
    channel = grpc.insecure_channel(store.address, options=FAST_RECONNECT)  # asks as soon as the port opens
    api, health = adapter_store_pb2_grpc.AdapterStoreStub(channel), health_pb2_grpc.HealthStub(channel)
    answers = {"refused while loading": 0, "complete": 0, "partial": 0, "fetch not found": 0}
    partial_sizes = []
    try:
        deadline = time.monotonic() + 120
        while answers["complete"] < 20:
            assert time.monotonic() < deadline, answers
            assert store.proc.poll() is None, store.output()
            serving = _serving(health)  # asked first: a store once loaded stays loaded, so no race with the List
            try:
                listed = {a.name for a in api.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters}
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                assert serving is not True, "SERVING while still loading"
                if serving is False:  # the gRPC port is up: the refusals are the store's own
                    try:  # "not loaded yet" is not "not registered": never NOT_FOUND
                        api.Describe(gateway_pb2.DescribeAdapterRequest(name=last), timeout=5)
                    except grpc.RpcError as refused:
                        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
                        answers["refused while loading"] += "still loading its catalogue" in refused.details()
                    try:
                        store.fetcher.fetch_adapter(last, 1)
                    except NotFoundError:
                        answers["fetch not found"] += 1
                    except UnavailableError:
                        pass
                continue
            if listed == expected:
                answers["complete"] += 1
            else:
                answers["partial"] += 1
                partial_sizes.append(len(listed))
        assert answers["partial"] == 0 and answers["fetch not found"] == 0, (answers, partial_sizes[:10])
        assert answers["refused while loading"] > 0, answers  # the window was there, and it was asked in
        assert store.fetcher.fetch_adapter(last, 1).config_json == files("upper")[0]
    finally:
        channel.close()
        store.stop()


def _serving(health: health_pb2_grpc.HealthStub) -> bool | None:
    """The store's health: True (SERVING), False (answering, not SERVING), None (not answering yet)."""
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0)
    except grpc.RpcError:
        return None
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_uploads_of_new_versions_keep_the_stores_descriptors_bounded(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    store = StoreProcess(tmp_path, "--shared-memory-root", str(root)).wait_serving()
    by_file = AdapterFetcher(store.data_address, timeout_s=5.0, shared_memory=user_dir(root))

    def fetch_rows(version: int) -> None:
        """A version's rows over the socket (mapped for the reply only) and by its file: the same bytes."""
        over_socket = store.fetcher.fetch_rows("soak", version, MODEL.kv_width, MODEL.num_layers)
        mapped = by_file.fetch_rows("soak", version, MODEL.kv_width, MODEL.num_layers)
        assert isinstance(over_socket, FetchedRows) and not over_socket.shared and mapped.shared
        assert bytes(over_socket.rows) == bytes(mapped.rows) and any(bytes(mapped.rows))

    try:
        for _ in range(10):  # warm: every lazy socket, thread and file of a serving store is open
            upload(store, "soak", "title")
        fetch_rows(10)
        before = _fds(store.proc.pid)
        for _ in range(UPLOADS):
            upload(store, "soak", "title")
        assert _fds(store.proc.pid) - before <= 4, (before, _fds(store.proc.pid))  # not one per retained version
        assert store.listed()["soak"].version == 10 + UPLOADS
        assert len(list(user_dir(root).glob("*/*.rows"))) == len(DEMO) + 10 + UPLOADS  # all retained, by file
        for version in (1, 60, 10 + UPLOADS):
            fetch_rows(version)
        assert _fds(store.proc.pid) - before <= 4, (before, _fds(store.proc.pid))
    finally:
        by_file.close()
        store.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    http_port = free_port_block(1)
    profile = fixed_profile(tmp_path_factory.mktemp("too-large") / "runner_profile.json")
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        http_bind=f"127.0.0.1:{http_port}",
        adapter_root=str(demo_adapters()["upper"].parent),
        max_adapter_mb=1.0,  # "reverse" is 1.2 MiB
        runner="emulated",
        runner_profile=profile,
    )
    stack.http_port = http_port
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LORASERVE_PRELOAD_DEMO", "0")  # the demo's "reverse" is over that limit
        stack.start()
    yield stack
    stack.stop()


def test_an_adapter_over_max_adapter_mb_is_413_over_http_and_not_retryable_over_grpc(stack):
    connection = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    body = json.dumps({"lora_name": "big", "lora_path": "reverse"})
    connection.request("POST", "/v1/load_lora_adapter", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    connection.close()
    assert response.status == 413, error
    assert error["param"] == "lora_path" and "--max-adapter-mb" in error["message"], error
    assert "exceed the store's maximum adapter size of 1.0 MiB" in error["message"], error
    register = gateway_pb2.RegisterAdapterFromPathRequest(name="big", path="reverse")
    with pytest.raises(grpc.RpcError) as refused:
        stack.api.RegisterAdapterFromPath(register, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "--max-adapter-mb" in refused.value.details()
    config, weights = files("reverse")
    parts = [("adapter_config.json", config), ("adapter_model.safetensors", weights)]
    with pytest.raises(grpc.RpcError) as refused:
        stack.api.UploadAdapter(upload_requests("big", parts), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "--max-adapter-mb" in refused.value.details()
    names = [a.name for a in stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]
    assert "big" not in names
