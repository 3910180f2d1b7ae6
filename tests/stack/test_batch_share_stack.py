"""One client request cannot fill a worker's batch (`scheduler/batch_share.py`), on a real stack (demo
model, one CPU worker of 64 slots, the HTTP edge, no auth file: tenants by `x-loraserve-client`).

Tenant a asks for 64 generations in one HTTP body (n = 64, each a fixed 128 tokens); while they run,
tenant b sends short requests (2 tokens) one after another. With the request batch share (a quarter
of the 64 slots), a's generations take 16 slots at a time and the rest wait in the scheduler's queue,
so b's requests find a free slot at once: each is answered within B_BOUND_S (~0.03 s measured).
Before the share, a's 64 generations filled the batch and b's first request waited for all of them to
end (3.2 s here, 22 s with 400 tokens each; a p50 of 2.4 s and 10 s timeouts on the attack's stack).
a's request is answered whole.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time

import pytest
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
A_TOKENS = 128  # each of a's 64 generations: ~3 s for the request here
B_REQUESTS = 6
B_BOUND_S = 1.0  # the slowest of b's short requests while a's request runs (~0.03 s each here; ~3.2 s before)


def _complete(port: int, tenant: str, body: dict, timeout_s: float = 300.0) -> tuple[int, dict, float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    started = time.monotonic()
    try:
        headers = {"Content-Type": "application/json", "x-loraserve-client": tenant}
        connection.request(
            "POST", "/v1/completions", body=json.dumps({"model": DEMO_MODEL_DIR.name, **body}), headers=headers
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read()), time.monotonic() - started
    finally:
        connection.close()


def test_a_64_generation_request_leaves_room_for_another_tenants_short_requests():
    http_port = free_port_block(1)
    stack = LocalStack(
        DEMO_MODEL_DIR, workers=1, max_batch_size=64, pool_pages=2048, http_bind=f"127.0.0.1:{http_port}"
    )  # pool room for all 64: the batch is the limit
    try:
        stack.start()
        stack.wait_workers(1)
        _complete(http_port, "warm", {"prompt": "the king", "max_tokens": 2})
        big: dict = {}
        prompt = [11, 12, 13, 14, 15, 16, 17, 18]  # token ids: the 64 generations share one prompt, tokenized never
        body = {"prompt": prompt, "n": 64, "max_tokens": A_TOKENS, "ignore_eos": True}
        a = threading.Thread(target=lambda: big.update(result=_complete(http_port, "a", body)))
        a.start()
        time.sleep(0.5)  # a's generations are placed and running
        b = []
        while len(b) < B_REQUESTS and a.is_alive():
            status, answer, seconds = _complete(http_port, "b", {"prompt": "the river", "max_tokens": 2}, 60.0)
            assert status == 200, answer
            b.append(seconds)
        running_when_b_done = a.is_alive()
        a.join(300)
        status, answer, a_seconds = big["result"]
        assert max(b) < B_BOUND_S, (
            f"b's short requests took up to {max(b):.2f} s (median {statistics.median(b):.2f} s) while a's "
            f"64 generations ran ({a_seconds:.1f} s)"
        )
        assert len(b) == B_REQUESTS and running_when_b_done, f"a's request ended after {len(b)} of b's requests"
        assert status == 200 and len(answer["choices"]) == 64, answer
        assert all(c["finish_reason"] == "length" for c in answer["choices"])
    finally:
        stack.stop()
