"""The abuse suite's attacks on what requests carry: constraints, huge prompts, control messages, batches.

Each attack is a plain function over the stack's public (or, for the control-plane ones, internal)
sockets that returns its own figures: the answers it got, by status, and how long they took. Whether
the stack held up is read beside them from the bystander's traffic and the roles' restarts
(`probes.Traffic`, `probes.Roles`).

- `constraint_attacks`: structured-output constraints that crashed or wedged a role once — a Lark
  grammar of a few thousand chained rules, nested counted repetition, an 88 KiB Lark regex, thousands
  of alternatives, JSON nested 1,000 deep, 300-digit bounds — over HTTP and gRPC.
- `prompt_flood`: clients sending 1 MiB prompts to /tokenize, completions, chat and gRPC Tokenize,
  while a prober times the health checks (HTTP /health and gRPC health).
- `submit_flood`: one SubmitStream batch of 50,000 entries straight to the scheduler (with the
  internal token), and a holder of the worker key reporting as many worker ids.
- `batch_hog`: requests of 64 generations each (a prompt list × n), back to back.
- `first_structured`: a structured request as the first request a fresh stack serves.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve import internal_auth
from loraserve.bench.suites.abuse.probes import http_post
from loraserve.client import ApiError, Client
from loraserve.client.api import auth_metadata
from loraserve.client.retry import NO_RETRY
from loraserve.params import SamplingParams, encode_sampling
from loraserve.sockets import make_socket, send
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from loraserve.wire import WorkerReport

MIB = 1 << 20


# ---- constraints ----------------------------------------------------------------------------------
def chain_grammar(rules: int = 3000) -> str:
    """A Lark grammar whose rules form one chain (`start: r0`, `r0: r1 | "x0"`, ...): ~64 KiB at 3,000."""
    lines = ["start: r0", *(f'r{i}: r{i + 1} | "x{i}"' for i in range(rules)), f'r{rules}: "end"']
    return "\n".join(lines)


def alternatives_grammar(terminals: int = 3000) -> str:
    """A Lark grammar of `terminals` alternative terminals."""
    return "start: " + " | ".join(f'"t{i}"' for i in range(terminals))


def big_lark_regex(target_bytes: int = 88 * 1024) -> str:
    """A Lark grammar whose one terminal is a regex of about `target_bytes`, of nested counted repetitions."""
    parts, size, i = [], 0, 0
    while size < target_bytes:
        part = f"(y{i}(x{{100}}){{100}})"
        parts.append(part)
        size, i = size + len(part) + 1, i + 1
    return "start: /(" + "|".join(parts) + ")/"


def deep_json(levels: int = 1000) -> str:
    """A JSON text nested `levels` deep (a schema of arrays of arrays ...)."""
    return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels


HUGE_BOUNDS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(10**300), "maximum": 10**300}}}

# name -> (HTTP body fields, gRPC StructuredOutput fields)
CONSTRAINTS: dict[str, tuple[dict, dict]] = {
    "chain_grammar": ({"guided_grammar": chain_grammar()}, {"grammar": chain_grammar()}),
    "nested_repetition": ({"guided_regex": "(x{1000}){1000}"}, {"regex": "(x{1000}){1000}"}),
    "big_lark_regex": ({"guided_grammar": big_lark_regex()}, {"grammar": big_lark_regex()}),
    "alternatives": ({"guided_grammar": alternatives_grammar()}, {"grammar": alternatives_grammar()}),
    "deep_json": ({"guided_json": deep_json()}, {"json_schema": deep_json()}),
    "huge_bounds": ({"guided_json": json.dumps(HUGE_BOUNDS)}, {"json_schema": json.dumps(HUGE_BOUNDS)}),
}


def _tally(answers: list[tuple[str, float]]) -> dict:
    return {
        "answers": dict(Counter(status for status, _ in answers)),
        "max_s": round(max((s for _, s in answers), default=0.0), 2),
    }


def constraint_attacks(http_address: str, grpc_address: str, api_key: str, model: str, repeats: int) -> dict:
    """Each of CONSTRAINTS `repeats` times over HTTP (completions) and over gRPC (Generate)."""
    figures = {}
    for name, (http_fields, grpc_fields) in CONSTRAINTS.items():
        answers = {"http": [], "grpc": []}
        for _ in range(repeats):
            body = {"model": model, "prompt": "a", "max_tokens": 8, **http_fields}
            answers["http"].append(http_post(http_address, "/v1/completions", body, api_key))
            structured = common_pb2.StructuredOutput(**grpc_fields)
            answers["grpc"].append(structured_generate(grpc_address, api_key, structured))
        figures[name] = {edge: _tally(a) for edge, a in answers.items()}
    return figures


def structured_request(structured: common_pb2.StructuredOutput, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        text="a", max_new_tokens=max_new_tokens, sampling=common_pb2.SamplingParameters(structured_output=structured)
    )


def structured_generate(
    grpc_address: str, api_key: str, structured: common_pb2.StructuredOutput, max_new_tokens: int = 8
) -> tuple[str, float]:
    """One gRPC Generate of "a" under `structured`; (OK or the status's name, seconds)."""
    request = structured_request(structured, max_new_tokens)
    started = time.time()
    with grpc.insecure_channel(grpc_address) as channel:
        try:
            gateway_pb2_grpc.LoraServeStub(channel).Generate(request, metadata=auth_metadata(api_key), timeout=60)
            return "OK", time.time() - started
        except grpc.RpcError as e:
            return e.code().name, time.time() - started


# ---- huge prompts ---------------------------------------------------------------------------------
class HealthProbe:
    """Times HTTP /health and the gRPC health check every `interval_s`, from a thread; counts the
    answers that were not healthy (an HTTP status other than 200, a gRPC status other than SERVING)."""

    def __init__(self, http_address: str, grpc_address: str, interval_s: float = 0.1):
        self.http_address, self.grpc_address, self.interval_s = http_address, grpc_address, interval_s
        self.http_s: list[float] = []
        self.grpc_s: list[float] = []
        self.not_serving = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        host, port = self.http_address.rsplit(":", 1)
        with grpc.insecure_channel(self.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self._stop.wait(self.interval_s):
                started = time.time()
                with closing(http.client.HTTPConnection(host, int(port), timeout=30)) as connection:
                    try:
                        connection.request("GET", "/health")
                        response = connection.getresponse()
                        response.read()
                        self.not_serving += response.status != 200
                    except OSError:
                        self.not_serving += 1
                self.http_s.append(time.time() - started)
                started = time.time()
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
                    self.not_serving += status != health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    self.not_serving += 1
                self.grpc_s.append(time.time() - started)

    def figures(self) -> dict:
        def worst(values: list[float]) -> dict:
            ordered = sorted(values)
            p99 = ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0
            return {"checks": len(ordered), "p99_s": round(p99, 3), "max_s": round(max(ordered, default=0.0), 3)}

        return {"http_health": worst(self.http_s), "grpc_health": worst(self.grpc_s), "not_serving": self.not_serving}


def prompt_flood(
    http_address: str, grpc_address: str, api_key: str, model: str, seconds: float, clients: int = 4
) -> dict:
    """`clients` threads sending 1 MiB prompts for `seconds` (to /tokenize, completions, chat and gRPC
    Tokenize in turn) while a HealthProbe runs; the answers by target and the probe's figures."""
    prompt = "the quiet king " * (MIB // 15)

    def post(path: str, body: dict) -> Callable[[Client], tuple[str, float]]:
        return lambda _: http_post(http_address, path, body, api_key)

    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    targets: list[tuple[str, Callable[[Client], tuple[str, float]]]] = [
        ("tokenize", post("/tokenize", {"model": model, "prompt": prompt})),
        ("completions", post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4})),
        ("chat", post("/v1/chat/completions", chat)),
        ("grpc_tokenize", lambda client: _grpc_tokenize(client, prompt)),
    ]
    answers: dict[str, list[tuple[str, float]]] = {name: [] for name, _ in targets}
    lock, stop = threading.Lock(), threading.Event()

    def loop(index: int) -> None:
        with Client(grpc_address, api_key=api_key, retry=NO_RETRY) as client:
            n = index
            while not stop.is_set():
                name, call = targets[n % len(targets)]
                outcome = call(client)
                with lock:
                    answers[name].append(outcome)
                n += 1

    with HealthProbe(http_address, grpc_address) as probe:
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join(120)
    return {"targets": {name: _tally(a) for name, a in answers.items()}, **probe.figures()}


def _grpc_tokenize(client: Client, text: str) -> tuple[str, float]:
    started = time.time()
    try:
        client.tokenize(text, timeout=60)
        return "OK", time.time() - started
    except ApiError as e:
        return e.code, time.time() - started


# ---- control messages -----------------------------------------------------------------------------
def submit_flood(scheduler_grpc: str, keys_dir: Path, entries: int) -> dict:
    """One SubmitStream batch of `entries` one-token requests, with the internal token; the answer and
    the seconds until it came, and the scheduler's health check latency right after."""
    keys = internal_auth.load(keys_dir, "gateway")
    sampling = encode_sampling(SamplingParams(max_new_tokens=1))
    batch = scheduler_pb2.SubmitStreamRequest(
        requests=[
            scheduler_pb2.SubmitRequest(
                request_id=f"flood-{i}",
                prompt_ids=[1, 2, 3],
                sampling_params=sampling,
                reply_to="tcp://127.0.0.1:9",
                arrival_unix=time.time(),
                tenant="flood",
            )
            for i in range(entries)
        ]
    )
    metadata = (("authorization", f"Bearer {keys.token}"),)
    options = [("grpc.max_send_message_length", 256 * MIB), ("grpc.max_receive_message_length", 256 * MIB)]
    started = time.time()
    with grpc.insecure_channel(scheduler_grpc, options=options) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            replies = stub.SubmitStream(iter([batch]), metadata=metadata, timeout=60)
            first = next(replies)
            outcome = dict(Counter(o.status for o in first.outcomes))
        except grpc.RpcError as e:
            outcome = {e.code().name: entries}
        except StopIteration:
            outcome = {"no answer": entries}
        seconds = time.time() - started
        started = time.time()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    return {
        "entries": entries,
        "bytes": batch.ByteSize(),
        "outcome": outcome,
        "seconds": round(seconds, 2),
        "health_after": health_pb2.HealthCheckResponse.ServingStatus.Name(health),
        "health_s": round(time.time() - started, 3),
    }


def spoofed_workers(worker_address: str, keys_dir: Path, ids: int, seconds: float) -> dict:
    """A holder of the worker key on one connection, reporting as `ids` worker ids for `seconds`
    (each report within the per-report bounds; not ready, so nothing is placed on them)."""
    keys = internal_auth.load(keys_dir, "worker")
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=worker_address, identity="spoof", curve=keys.client_of("scheduler"))
    sent, ended = 0, time.time() + seconds
    try:
        while time.time() < ended:
            for i in range(ids):
                report = WorkerReport(
                    worker_id=f"spoof-{i}",
                    ready=False,
                    max_batch_size=1024,
                    total_pages=1_000_000,
                    free_pages=1_000_000,
                    kv_pages=0,
                    adapter_pages=0,
                    running=[],
                    waiting=[f"w{i}-{j}" for j in range(2048)],
                    resident=[],
                )
                send(sock, report)
                sent += 1
            time.sleep(0.05)
    finally:
        sock.close(linger=0)
        ctx.term()
    return {"ids": ids, "reports": sent, "seconds": seconds}


# ---- batches --------------------------------------------------------------------------------------
def batch_hog(http_address: str, api_key: str, model: str, seconds: float, prompts: int = 16, n: int = 4) -> dict:
    """Requests of `prompts` × `n` generations (64) of 64 tokens each, back to back for `seconds`."""
    answers = []
    ended = time.time() + seconds
    while time.time() < ended:
        body = {"model": model, "prompt": [f"story {i}" for i in range(prompts)], "n": n, "max_tokens": 64}
        answers.append(http_post(http_address, "/v1/completions", body, api_key, timeout_s=120))
    return {"generations_per_request": prompts * n, **_tally(answers)}


def first_structured(grpc_address: str, api_key: str) -> dict:
    """A JSON-schema request as the first structured request the stack serves: its status and seconds."""
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    status, seconds = structured_generate(grpc_address, api_key, common_pb2.StructuredOutput(json_schema=schema), 16)
    return {"status": status, "seconds": round(seconds, 2)}
