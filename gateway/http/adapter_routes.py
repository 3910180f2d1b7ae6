"""Adapters loaded and unloaded over HTTP, in vLLM's shapes: `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"} -> 200 "Success: LoRA adapter 'NAME' added successfully."
    POST /v1/unload_lora_adapter  {"lora_name"}              -> 200 "Success: LoRA adapter 'NAME' removed successfully."

They are the gRPC `RegisterAdapterFromPath` and `DeleteAdapter`, run by the same adapter admin
(`gateway/admin_service.py`): the scope `adapters`, the caller's namespace, the store's `--adapter-root` (a path is
relative to it and never escapes it), the audit log and the new version's rollout are theirs. A
name that exists already gets a new version, as a second registration does over gRPC. Failures have
OpenAI's error shape, naming `lora_name` or `lora_path`.
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import PlainTextResponse

from loraserve.errors import LoraserveError
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.http.errors import HttpError, bad_request, http_error
from loraserve.gateway.http.generation import http_metadata
from loraserve.gateway.http.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from loraserve.v1 import gateway_pb2

PARAMS = {"name": "lora_name", "path": "lora_path"}  # the gRPC request's fields, as this API names them


class AdapterRoutes:
    def __init__(self, admin: AdapterAdminService):
        self.admin = admin

    async def load(self, body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        call = gateway_pb2.RegisterAdapterFromPathRequest(name=body.lora_name, path=body.lora_path)
        try:
            await self.admin.register(http_metadata(request.headers), call)
        except LoraserveError as e:
            raise _named(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        if body.lora_int_id is not None:
            raise bad_request("lora_int_id", "adapters are named here: give lora_name alone")
        try:
            await self.admin.delete(http_metadata(request.headers), body.lora_name)
        except LoraserveError as e:
            raise _named(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _named(e: LoraserveError) -> HttpError:
    """`e` as an HTTP failure whose `param` is this API's name for the field: the store's refusals come
    back over gRPC as messages that start with the field's name; a missing adapter names the model
    (here: lora_name)."""
    error = http_error(e)
    body = error.body["error"]
    first_word = re.match(r"\w*", body["message"]).group()  # "path: ...", "path '...': no such directory"
    if first_word in PARAMS:
        body["param"] = PARAMS[first_word]
    elif error.status == 413:  # the adapter at the path is over the store's --max-adapter-mb
        body["param"] = "lora_path"
    elif body["param"] in ("model", "name"):
        body["param"] = "lora_name"
    return error
