"""The abuse benchmark's probes (`loraserve bench --suite abuse`) against small real servers: the
traffic window's figures, connection churn, an oversized body answered early, held connections
that a server closes; the suite's flags, and its targets computed from its phases."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from loraserve.bench import cli as bench_main
from loraserve.bench.suites.abuse import probes
from loraserve.bench.suites.abuse.attacks import (
    CONSTRAINTS,
    big_lark_regex,
    chain_grammar,
    deep_json,
    structured_request,
)
from loraserve.bench.suites.abuse.probes import Outcome, Traffic, big_body, connection_churn, idle_connections
from loraserve.bench.suites.abuse.targets import targets
from loraserve.v1 import common_pb2


class _Server:
    """A loopback TCP server: each accepted connection goes to `handle` on its own thread."""

    def __init__(self, handle):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._handle = handle
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def test_window_counts_by_status_and_finds_the_longest_stretch_without_a_success():
    traffic = Traffic("127.0.0.1:1", "127.0.0.1:1", "key", [""])
    traffic.outcomes = [
        Outcome(100.0, 101.0, "http", "OK"),
        Outcome(101.0, 102.0, "http", "UNAVAILABLE"),
        Outcome(102.0, 109.0, "http", "UNAVAILABLE"),
        Outcome(109.0, 112.0, "http", "OK"),
        Outcome(200.0, 201.0, "http", "OK"),  # outside the window
    ]
    window = traffic.window(100.0, 115.0)
    assert window == {
        "calls": 4,
        "ok": 2,
        "failed": {"UNAVAILABLE": 2},
        "longest_without_success_s": 11.0,
        "latency_s": {"p50": 1.0, "p99": 3.0, "max": 3.0},  # the successes' only
    }
    assert traffic.window(150.0, 160.0)["longest_without_success_s"] == 10.0  # no call at all


def test_the_attack_constraints_have_the_shapes_that_once_broke_a_role():
    assert 60_000 < len(chain_grammar().encode()) < 70_000 and chain_grammar().count("\n") == 3001
    assert 88 * 1024 <= len(big_lark_regex().encode()) < 90 * 1024
    assert deep_json(1000).count("[") == 0 and deep_json(1000).count("{") == 1001
    assert set(CONSTRAINTS) >= {"chain_grammar", "nested_repetition", "deep_json", "huge_bounds", "alternatives"}
    for _, grpc_fields in CONSTRAINTS.values():  # each a StructuredOutput the gRPC API takes
        request = structured_request(common_pb2.StructuredOutput(**grpc_fields), 8)
        assert request.max_new_tokens == 8 and request.sampling.HasField("structured_output")


def test_connection_churn_connects_and_closes_every_cycle():
    server = _Server(lambda conn: conn.close())
    try:
        connection_churn("127.0.0.1", server.port, 200)
        deadline = time.time() + 5
        while server.accepted < 200 and time.time() < deadline:
            time.sleep(0.01)
        assert server.accepted == 200
    finally:
        server.close()


def _answer_401_at_once(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    time.sleep(0.2)
    conn.close()


def test_big_body_reports_an_early_answer_and_how_little_was_sent():
    server = _Server(_answer_401_at_once)
    try:
        result = big_body(f"127.0.0.1:{server.port}", 1 << 30, None, timeout_s=20)
    finally:
        server.close()
    assert result["status"] == "401"
    assert result["bytes_taken"] < 1 << 30


def test_idle_connections_counts_what_a_server_closed():
    def close_after_a_second(conn: socket.socket) -> None:
        time.sleep(1.0)
        conn.sendall(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")  # an answer, then the end
        conn.close()

    server = _Server(close_after_a_second)
    try:
        result = idle_connections(f"127.0.0.1:{server.port}", 40, hold_s=2.5, processes=2)
    finally:
        server.close()
    assert result["asked"] == result["connected"] == 40
    assert result["refused"] == 0
    assert result["open_at_end"] == 0


def test_the_suite_and_its_flags_are_wired_into_the_bench_command():
    assert "abuse" in bench_main.SUITES
    args = bench_main.parse_args(["--suite", "abuse", "--abuse-soak-s", "5", "--abuse-idle-connections", "100"])
    assert (args.abuse_soak_s, args.abuse_idle_connections) == (5.0, 100)


def test_roles_are_told_by_their_title_s_first_word_and_restarts_count_from_the_start(monkeypatch):
    """`loraserve-gateway-constraints` is not the gateway, and two compilers at the start are no restart."""
    titles = {11: "loraserve-gateway", 12: "loraserve-gateway-constraints", 13: "loraserve-gateway-constraints"}
    titles |= {14: "loraserve-worker worker-0"}
    monkeypatch.setattr(probes, "_children", lambda _pid: list(titles))
    monkeypatch.setattr(probes, "_title", titles.get)
    roles = probes.Roles(up_pid=1)
    roles.start()
    roles.stop()
    assert roles.restarts() == {"gateway": 0, "gateway-constraints": 0, "worker": 0}
    titles[15] = "loraserve-gateway-constraints"  # one replaced
    roles.sample()
    assert roles.restarts() == {"gateway": 0, "gateway-constraints": 1, "worker": 0}


def test_the_targets_are_computed_from_the_phases():
    """Met on the committed full run; a bystander failure, a restart or a slow health check misses."""
    phases = json.loads((Path(__file__).parents[2] / "docs/abuse/results.json").read_text())["phases"]
    assert all(t["met"] for t in targets(phases)), targets(phases)
    phases[-1]["traffic"]["failed"] = {"UNAVAILABLE": 2}
    phases[0]["restarts"]["worker"] = 1
    phases[0]["restarts"]["gateway-constraints"] = 3  # replaced compilers are no restart
    prompts = next(p for p in phases if p["phase"] == "prompts")
    prompts["attack"]["grpc_health"]["max_s"] = 2.0
    missed = {t["name"]: t["value"] for t in targets(phases) if not t["met"]}
    assert missed == {
        "role restarts": 1,
        "bystander calls failed": 2,
        "slowest health check under 1 MiB prompts (s)": 2.0,
    }
