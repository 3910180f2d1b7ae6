"""The gateway's OpenAI-compatible HTTP edge (FastAPI on uvicorn, in the gateway's own event loop).

`server.py` runs it beside the gRPC server when the gateway has `--http-bind`; `app.py` holds the
routes, `schemas.py` the request bodies, `responses.py` the OpenAI-shaped answers and stream chunks,
`errors.py` the one table from loraserve errors to HTTP statuses. Every generation is run by the
generation core (`gateway/core.py`) the gRPC API runs on, with no protobuf in between: same keys,
tenants, quotas, validation, tracing, metrics and failover.
"""
