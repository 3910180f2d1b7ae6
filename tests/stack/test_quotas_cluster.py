"""Token quotas (`tokens_per_minute`) metered at the scheduler, for the whole cluster.

- A stack with an auth file: a tenant's long prompts count against its quota (a prompt-heavy
  tenant is refused RESOURCE_EXHAUSTED, with a retry hint, once its prompts use the quota up),
  and other tenants are untouched.
- A real scheduler process called by two gRPC clients, as two gateways would: they draw on one
  quota, and a failover attempt (attempt > 0) is neither charged nor refused.
- `scheduler/quotas.py`, the pure policy, with a fake clock.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import time

import grpc
import pytest
from scheduler_proc import FakeWorker, SchedulerProcess
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.scheduler.quotas import QuotaExceededError, TokenQuotas
from loraserve.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc

KEYS = {"thrifty": "key-of-thrifty-0123456789", "free": "key-of-free-0123456789"}
QUOTA = 200  # thrifty's tokens_per_minute
LONG_PROMPT = "the quiet king walked along the river and " * 8  # tens of tokens
REPLY_TO = "tcp://127.0.0.1:1"  # never used: no worker runs these requests far enough to reply


# ---- the policy, pure ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0


def test_a_request_is_charged_its_prompt_and_max_tokens_and_refused_past_the_bucket():
    clock = Clock()
    quotas = TokenQuotas()
    quotas.charge("t", 60, 30, clock.now)  # 60 a minute: one a second; the bucket starts full
    quotas.charge("t", 60, 25, clock.now)
    with pytest.raises(QuotaExceededError) as info:
        quotas.charge("t", 60, 10, clock.now)  # 5 left, 10 wanted: 5 s to wait
    error = info.value
    assert error.status == "RESOURCE_EXHAUSTED" and error.retry_after_s == pytest.approx(5.0)
    assert "'t'" in str(error) and "tokens_per_minute = 60" in str(error) and "retry in 5.0 s" in str(error)
    quotas.charge("u", 60, 60, clock.now)  # another tenant's bucket is its own
    clock.now += 4.9
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 60, 10, clock.now)  # refused: nothing was taken
    clock.now += 0.2
    quotas.charge("t", 60, 10, clock.now)
    clock.now += 1000  # the bucket holds at most a minute's tokens
    quotas.charge("t", 60, 60, clock.now)
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 60, 1, clock.now)


def test_a_request_larger_than_the_whole_quota_is_refused_for_good():
    quotas = TokenQuotas()
    with pytest.raises(QuotaExceededError) as info:
        quotas.charge("t", 100, 101, 0.0)
    assert info.value.retry_after_s is None and "never" in str(info.value) and "max_tokens" in str(info.value)
    quotas.charge("t", 100, 100, 0.0)  # nothing was taken by the refusal


def test_zero_means_unlimited_and_refunds_never_overfill():
    quotas = TokenQuotas()
    for _ in range(100):
        quotas.charge("t", 0, 10**6, 0.0)
    assert quotas.tenants() == 0  # unlimited tenants keep no state
    quotas.charge("t", 100, 80, 0.0)
    quotas.refund("t", 100, 500, 0.0)  # a refund fills the bucket at most to its size
    quotas.charge("t", 100, 100, 0.0)
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 100, 1, 0.0)


def test_a_lower_limit_applies_at_once_and_full_buckets_are_forgotten():
    quotas = TokenQuotas()
    quotas.charge("t", 1000, 10, 0.0)
    with pytest.raises(QuotaExceededError):
        quotas.charge("t", 100, 95, 0.0)  # the bucket is cut to the new size (100), 10 of it used
    quotas.charge("t", 100, 90, 0.0)
    quotas.charge("x", 60, 1, 0.0)
    quotas.charge("y", 60, 1, 100.0)  # by now t's and x's buckets are full again: kept no longer
    assert quotas.tenants() == 1


# ---- a real scheduler, two clients as two gateways ----------------------------------------------
@pytest.fixture
def scheduler():
    process = SchedulerProcess()
    worker = None
    try:
        process.wait_serving()
        worker = FakeWorker(process.worker_address)
        process.wait_worker(worker.worker_id)
        yield process
    finally:
        if worker is not None:
            worker.close()
        process.stop()


def submit(stub, request_id: str, prompt_len: int, max_new_tokens: int, **fields) -> scheduler_pb2.SubmitResponse:
    request = scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_ids=[5] * prompt_len,
        max_new_tokens=max_new_tokens,
        reply_to=REPLY_TO,
        arrival_unix=time.time(),
        tenant=fields.pop("tenant", "acme"),
        tokens_per_minute=fields.pop("tokens_per_minute", 600),
        **fields,
    )
    return stub.Submit(request, timeout=5)


def test_two_gateways_share_one_quota_and_failover_attempts_are_not_charged(scheduler):
    gateways = []
    for _ in range(2):
        channel = grpc.insecure_channel(scheduler.grpc_address)
        gateways.append((channel, scheduler_pb2_grpc.SchedulerStub(channel)))
    one, two = gateways[0][1], gateways[1][1]
    try:
        submit(one, "r1", 250, 10)  # 260 of acme's 600 a minute
        submit(two, "r2", 250, 10)  # 520: the other gateway's request drew on the same bucket
        with pytest.raises(grpc.RpcError) as info:
            submit(one, "r3", 100, 10)  # 110 more: over
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'acme'" in info.value.details() and "tokens_per_minute = 600" in info.value.details()
        assert int(dict(info.value.trailing_metadata())["retry-after-ms"]) > 1000
        # A failover attempt of r1 was admitted (and charged) as r1: never charged or refused again.
        for attempt in (1, 2, 3):
            submit(two, f"r1.{attempt}", 250, 10, attempt=attempt, output_ids=[7])
        submit(one, "r4", 70, 10)  # 520 + 80 = 600: exactly what is left, so the attempts took nothing
        submit(two, "other", 500, 10, tenant="other")  # another tenant is untouched
        submit(one, "unmetered", 4000, 10, tokens_per_minute=0)  # 0: unlimited
    finally:
        for channel, _ in gateways:
            channel.close()


# ---- a stack with an auth file ------------------------------------------------------------------
@pytest.mark.slow
def test_long_prompts_use_up_the_quota_across_the_stack(tmp_path):
    auth = tmp_path / "auth.toml"
    auth.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
            f'scopes = ["generate"]\n{f"tokens_per_minute = {QUOTA}" if name == "thrifty" else ""}\n\n'
            for name, key in KEYS.items()
        )
    )
    http_port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, auth_file=str(auth), http_bind=f"127.0.0.1:{http_port}")
    try:
        stack.start()
        stack.wait_workers(1)

        def generate(tenant: str) -> gateway_pb2.GenerateResponse:
            request = gateway_pb2.GenerateRequest(text=LONG_PROMPT, max_new_tokens=1)
            return stack.api.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),))

        served, refusal = [], None
        for _ in range(12):  # each costs its prompt (tens of tokens) + 1: the quota allows a few
            try:
                served.append(generate("thrifty").usage.prompt_tokens)
            except grpc.RpcError as e:
                refusal = e
                break
        assert served and served[0] > 20, served  # the prompt really is long
        assert refusal is not None, f"{len(served)} requests, {sum(served)} prompt tokens, none refused"
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
        assert "'thrifty'" in refusal.details() and f"tokens_per_minute = {QUOTA}" in refusal.details()
        assert int(dict(refusal.trailing_metadata())["retry-after-ms"]) > 0
        assert sum(p + 1 for p in served) <= QUOTA * 1.5, served  # the refill over the test's seconds is small
        assert generate("free").usage.prompt_tokens == served[0]  # another tenant is untouched
        over_http = post_completion(http_port, KEYS["thrifty"])  # the HTTP edge: the same quota, as a 429
        assert over_http.status == 429 and int(over_http.getheader("Retry-After")) >= 1
        assert "'thrifty'" in json.loads(over_http.read())["error"]["message"]
    finally:
        stack.stop()


def post_completion(port: int, key: str) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": DEMO_MODEL_DIR.name, "prompt": LONG_PROMPT, "max_tokens": 1}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    return connection.getresponse()
