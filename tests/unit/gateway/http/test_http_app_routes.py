"""The app's model routes over a stand-in core (`build_app`, through Starlette's test client): a model id
the caller cannot use is a 404 on `/v1/models/{id}` in OpenAI's error shape, named as every other unknown
model is (`/tokenize` given one: `tests/stack/test_openai_http.py`)."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from loraserve.errors import AdapterNotFoundError
from loraserve.gateway.http.app import build_app
from loraserve.gateway.http.errors import http_error


async def _listing(_namespace):
    return SimpleNamespace(adapters=[SimpleNamespace(name="upper", created_unix=7, owner="a")])


def _client() -> TestClient:
    principal = SimpleNamespace(tenant="a", admin=False, require=lambda *_: None)
    core = SimpleNamespace(
        authenticate=lambda _metadata: principal,
        config=SimpleNamespace(model_name="base"),
        limits=SimpleNamespace(max_prompt_bytes=1024, max_context=64),
        adapters=SimpleNamespace(list=_listing),
    )
    return TestClient(build_app(core, admin=None, chat_template=None, started_unix=1))


def test_a_model_card_is_found_by_its_id_and_an_unknown_one_is_openais_404():
    with _client() as client:
        listed = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in listed] == ["base", "upper"]
        assert client.get("/v1/models/upper").json() == listed[1]
        missing = client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json() == http_error(AdapterNotFoundError("nope")).body
    assert missing.json()["error"]["param"] == "model" and missing.json()["error"]["code"] == "model_not_found"
