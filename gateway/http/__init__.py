"""The gateway's OpenAI-compatible HTTP edge (FastAPI on uvicorn, in the gateway's own event loop).

`server.py` runs it beside the gRPC server when the gateway has `--http-bind` (`connections.py` bounds its
connections, `body_guard.py` refuses before reading a body); `app.py` and `operations.py` hold the routes,
`schemas.py` every request body and what of it is refused, `answering.py` runs a request's generations,
`responses.py` (completions, chat) and `responses_events.py` (the Responses API) write the core's events
as OpenAI's answers and stream events, `errors.py` the one table from loraserve errors to HTTP statuses.
Every generation is run by the generation core (`gateway/core.py`) the gRPC API runs on, with no
protobuf in between: same keys, tenants, quotas, validation, tracing, metrics and failover.
"""
