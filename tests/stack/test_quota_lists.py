"""Token quotas for prompt lists (`scheduler/quotas.py`, `gateway/client_request.py`), through the HTTP
edge of a real stack with an auth file: an HTTP body of several generations is admitted or refused
whole, charged once for the sum of its generations' prompt + max_tokens.

- A list that can never fit the tenant's tokens_per_minute is answered 429 with no Retry-After (a
  retry could never succeed), and burns nothing: the tenant's next small request is served. Before,
  the first generations were admitted and charged, a later one refused with `Retry-After: 1`, and
  every retry burned the tenant's refill with no output.
- A list that fits is answered in full (every choice) and charged once: what is left of the quota
  is the quota less the list's summed cost. One that does not fit what is left now is refused whole,
  with a retry hint, and takes nothing.
"""

from __future__ import annotations

import hashlib
import http.client
import json

import pytest
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
QUOTA = 100  # tokens_per_minute of both tenants: 1.7 tokens a second come back
KEYS = {"lister": "key-of-lister-0123456789", "fitter": "key-of-fitter-0123456789"}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens (ids: no tokenizer between)


def _complete(port: int, tenant: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}"}
        payload = json.dumps({"model": DEMO_MODEL_DIR.name, **body})
        connection.request("POST", "/v1/completions", body=payload, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


@pytest.fixture(scope="module")
def http_port(tmp_path_factory):
    auth = tmp_path_factory.mktemp("quota-lists") / "auth.toml"
    auth.write_text(
        "".join(
            f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
            f'scopes = ["generate"]\ntokens_per_minute = {QUOTA}\n\n'
            for name, key in KEYS.items()
        )
    )
    port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, auth_file=str(auth), http_bind=f"127.0.0.1:{port}")
    try:
        stack.start()
        stack.wait_workers(1)
        yield port
    finally:
        stack.stop()


def test_a_list_that_can_never_fit_is_refused_whole_without_a_retry_hint_and_burns_nothing(http_port):
    too_big = {"prompt": [PROMPT] * 4, "max_tokens": 20}  # 4 × (10 + 20) = 120 > 100; each alone would fit
    for _ in range(3):  # a client that retries anyway burns nothing either
        status, answer, headers = _complete(http_port, "lister", too_big)
        assert status == 429, answer
        assert "retry-after" not in headers, f"a retry hint for a request that can never fit: {headers}"
        message = answer["error"]["message"]
        assert "120 tokens" in message and "never" in message and "tokens_per_minute = 100" in message, message
    status, answer, _ = _complete(http_port, "lister", {"prompt": PROMPT, "max_tokens": 80})  # 90 of the 100
    assert status == 200, answer


def test_a_list_that_fits_is_answered_in_full_and_charged_once(http_port):
    fits = {"prompt": [PROMPT, PROMPT[:5]], "n": 2, "max_tokens": 10}  # 2 × (10 + 10) + 2 × (5 + 10) = 70
    status, answer, _ = _complete(http_port, "fitter", fits)
    assert status == 200, answer
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1, 2, 3]
    not_now = {"prompt": [PROMPT] * 2, "max_tokens": 10}  # 40: more than the 30 left, less than the quota
    status, answer, headers = _complete(http_port, "fitter", not_now)
    assert status == 429 and "retry-after" in headers, answer  # waiting helps: a hint, and nothing taken
    status, answer, _ = _complete(http_port, "fitter", {"prompt": PROMPT, "max_tokens": 18})  # 28: 98 of 100
    assert status == 200, f"the lists took more than the first one's 70 tokens: {answer}"
    status, answer, headers = _complete(http_port, "fitter", {"prompt": PROMPT, "max_tokens": 15})  # 25 more
    assert status == 429 and "retry-after" in headers, f"the list was charged less than its 70 tokens: {answer}"
