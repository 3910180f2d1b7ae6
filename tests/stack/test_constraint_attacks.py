"""Hostile structured-output constraints against a real stack: refused, never a crash, a wedge or a 500.

Real processes (one worker on the demo model, the HTTP port open, the hermes tool parser). Each
constraint that once crashed the gateway (a Lark grammar of 3,000 chained rules: SIGSEGV in
llguidance), wedged a worker (nested counted repetition, 3,000 alternatives) or answered 500 (JSON
nested 1,000 deep, 300-digit integer bounds, in a body's schema or a tool's) is sent over HTTP and
over gRPC: each is answered 400 / INVALID_ARGUMENT naming its field within seconds, the gateway
process is the same one afterwards, and structured requests still generate over both edges.
"""

from __future__ import annotations

import http.client
import json
import time

import grpc
import jsonschema
import pytest
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow
PROMPT = "the quiet king"
QUICK_S = 10.0  # the sandbox's default time bound is 2 s; a crashed child's replacement starts meanwhile
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chain_grammar(rules: int = 3000, name: str = "r") -> str:
    """`start: r0`, `r0: r1 | "x0"`, ... (~64 KiB at 3,000 rules): llguidance recurses once per rule."""
    lines = ["start: " + f"{name}0", *(f'{name}{i}: {name}{i + 1} | "x{i}"' for i in range(rules))]
    return "\n".join([*lines, f'{name}{rules}: "end"'])


def alternatives_grammar(terminals: int = 3000) -> str:
    return "start: " + " | ".join(f'"t{i}"' for i in range(terminals))


def deep_json(levels: int = 1000) -> str:
    return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels


HUGE_BOUNDS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(10**300), "maximum": 10**300}}}


@pytest.fixture(scope="module")
def stack():
    http_port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, http_bind=f"127.0.0.1:{http_port}", tool_call_parser="hermes")
    stack.http_port = http_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def post(stack, path: str, body: dict) -> tuple[int, dict, float]:
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), time.monotonic() - started
    finally:
        connection.close()


def grpc_refusal(stack, **structured) -> tuple[grpc.StatusCode, str, float]:
    request = gateway_pb2.GenerateRequest(
        text=PROMPT,
        max_new_tokens=8,
        sampling=common_pb2.SamplingParameters(structured_output=common_pb2.StructuredOutput(**structured)),
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stack.api.Generate(request, timeout=60)
    return caught.value.code(), caught.value.details(), time.monotonic() - started


HTTP_ATTACKS = {  # name -> (path, body fields, the parameter the 400 names)
    "chain grammar": ("/v1/completions", {"guided_grammar": chain_grammar()}, "guided_grammar"),
    "nested repetition": ("/v1/completions", {"guided_regex": "(x{1000}){1000}"}, "guided_regex"),
    "3,000 alternatives": ("/v1/completions", {"guided_grammar": alternatives_grammar()}, "guided_grammar"),
    "JSON 1,000 deep": ("/v1/completions", {"guided_json": deep_json()}, "guided_json"),
    "300-digit bounds (text)": ("/v1/completions", {"guided_json": json.dumps(HUGE_BOUNDS)}, "guided_json"),
    "300-digit bounds (object)": (
        "/v1/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": HUGE_BOUNDS}}},
        "response_format",
    ),
    "a tool's 300-digit bounds": (
        "/v1/chat/completions",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE_BOUNDS}}],
            "tool_choice": "required",
        },
        "tool_choice",
    ),
    "a strict tool's 300-digit bounds": (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE_BOUNDS, "strict": True}}]},
        "tools",
    ),
}
GRPC_ATTACKS = {  # name -> (StructuredOutput fields, the field the status names)
    "chain grammar (as HTTP's)": ({"grammar": chain_grammar()}, "sampling.structured_output.grammar"),
    "chain grammar (its own)": ({"grammar": chain_grammar(name="g")}, "sampling.structured_output.grammar"),
    "nested repetition": ({"regex": "(y{1000}){1000}"}, "sampling.structured_output.regex"),
    "3,000 alternatives": ({"grammar": alternatives_grammar(3001)}, "sampling.structured_output.grammar"),
    "JSON 1,000 deep": ({"json_schema": deep_json()}, "sampling.structured_output.json_schema"),
    "300-digit bounds": ({"json_schema": json.dumps(HUGE_BOUNDS)}, "sampling.structured_output.json_schema"),
    "llguidance's own form": ({"llguidance": chain_grammar(name="h")}, "sampling.structured_output.llguidance"),
}


def test_hostile_constraints_are_refused_naming_their_field_and_the_gateway_stays_up(stack):
    gateway = stack.process("gateway").pid
    for name, (path, fields, param) in HTTP_ATTACKS.items():
        body = {"model": DEMO_MODEL_DIR.name, "max_tokens": 8} | fields
        body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        status, answer, seconds = post(stack, path, body)
        assert (status, answer["error"]["param"]) == (400, param), (name, answer)
        assert seconds < QUICK_S, (name, seconds)
    for name, (fields, field) in GRPC_ATTACKS.items():
        code, details, seconds = grpc_refusal(stack, **fields)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), (name, details)
        assert seconds < QUICK_S, (name, seconds)
    assert stack.process("gateway").poll() is None and stack.process("gateway").pid == gateway

    # a repeated poison costs nothing: its refusal is remembered
    started = time.monotonic()
    status, answer, _ = post(
        stack, "/v1/completions", {"model": DEMO_MODEL_DIR.name, "prompt": PROMPT} | {"guided_grammar": chain_grammar()}
    )
    assert status == 400 and time.monotonic() - started < 1.0, answer

    # and structured output still works, over both edges
    status, answer, _ = post(
        stack,
        "/v1/completions",
        {"model": DEMO_MODEL_DIR.name, "prompt": PROMPT, "max_tokens": 60, "guided_json": SCHEMA},
    )
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    jsonschema.validate(json.loads(answer["choices"][0]["text"]), SCHEMA)
    reply = stack.api.Generate(
        gateway_pb2.GenerateRequest(
            text=PROMPT,
            max_new_tokens=60,
            sampling=common_pb2.SamplingParameters(
                structured_output=common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
            ),
        ),
        timeout=60,
    )
    jsonschema.validate(json.loads(reply.text), SCHEMA)
    assert stack.process("gateway").pid == gateway and stack.process("gateway").poll() is None
