"""The gateway's OpenAI-compatible HTTP edge (FastAPI on uvicorn, in the gateway's own event loop), beside
the gRPC server when the gateway has `--http-bind`, on the generation core (`gateway/core.py`) the gRPC API
runs on: `server.py` runs it (`connections.py` and `body_guard.py` guard it), `app.py` and `operations.py`
hold the routes, `schemas.py` the request bodies, `answering.py` runs a request's generations, and
`responses.py` and `responses_events.py` write the core's events as OpenAI's answers.
"""
