"""What the abuse suite watches and what it sends: the stack's processes, steady traffic, attacks.

- `Roles` follows the role processes of one `loraserve up` (by process title, `loraserve-ROLE`):
  their resident memory, open file descriptors, and every restart (a role whose pid changed).
- `Traffic` keeps mixed calls flowing through the public APIs (gRPC unary and stream; HTTP
  completions plain, with a JSON schema, and with n = 2 and log-probabilities) from a few threads and
  records each call's outcome and latency, so a phase's failures, its latencies and its longest
  stretch without a success can be read afterwards.
- The attacks are plain functions over sockets: TCP connect+close churn, an oversized HTTP body,
  and idle or trickling HTTP connections held by child processes (one process cannot hold 20,000).
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field

import psutil

from loraserve.client import ApiError, Client
from loraserve.client.retry import NO_RETRY
from loraserve.demo.assets import DEMO_MODEL_DIR

# Process titles' first word, `loraserve-ROLE`; the gateway's constraint compilers are watched apart from
# it (a constraint that crashes one replaces it: a "restart" there is the sandbox at work).
ROLES = ("adapter-store", "scheduler", "worker", "gateway", "gateway-constraints")
STRUCTURED = {  # the bystander's structured-output calls
    "type": "json_schema",
    "json_schema": {
        "name": "pick",
        "schema": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]},
    },
}


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except psutil.Error:
        return ""


def _usage(pid: int) -> tuple[float, int]:
    """(resident memory in MiB, open file descriptors) of `pid`; zeros when it is gone."""
    try:
        process = psutil.Process(pid)
        return process.memory_info().rss / 2**20, process.num_fds()
    except psutil.Error:
        return 0.0, 0


@dataclass
class Roles:
    """Samples the roles under one `up` process every `interval_s`, from a thread."""

    up_pid: int
    interval_s: float = 0.25
    pids: dict[str, set[int]] = field(default_factory=dict)  # role -> every pid it has had
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    peak_fds: dict[str, int] = field(default_factory=dict)
    _first: dict[str, int] = field(default_factory=dict)  # pids per role at `start`
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.sample()
        with self._lock:
            self._first = {role: len(pids) for role, pids in self.pids.items()}
        threading.Thread(target=self._run, name="roles", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for pid in _children(self.up_pid):
            words = _title(pid).split(maxsplit=1)
            role = next((r for r in ROLES if words and words[0] == f"loraserve-{r}"), None)
            if role is None:
                continue
            rss_mb, fds = _usage(pid)
            with self._lock:
                self.pids.setdefault(role, set()).add(pid)
                self.peak_rss_mb[role] = max(self.peak_rss_mb.get(role, 0.0), rss_mb)
                self.peak_fds[role] = max(self.peak_fds.get(role, 0), fds)

    def restarts(self) -> dict[str, int]:
        """Per role: pids seen beyond those it had at `start` (at least one: one worker has 1 pid, two
        constraint compilers 2; a restart adds one)."""
        with self._lock:
            return {role: len(pids) - max(1, self._first.get(role, 0)) for role, pids in self.pids.items()}

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_rss_mb.clear()
            self.peak_fds.clear()


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    kind: str  # grpc-unary, grpc-stream, http
    status: str  # OK, or the gRPC status / HTTP code of the failure


class Traffic:
    """`threads` callers in a loop, each call with a deadline and no client-side retry."""

    def __init__(
        self,
        grpc_address: str,
        http_address: str,
        api_key: str,
        adapters: list[str],
        base_model: str = DEMO_MODEL_DIR.name,
        threads: int = 2,
    ):
        self.grpc_address, self.http_address, self.api_key = grpc_address, http_address, api_key
        self.adapters, self.base_model = adapters, base_model
        self.threads = threads
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.threads):
            thread = threading.Thread(target=self._loop, args=(i,), name=f"traffic-{i}", daemon=True)
            thread.start()
            self._workers.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout=30)

    def _loop(self, index: int) -> None:
        calls = (self._unary, self._stream, self._http, self._structured, self._choices)
        n = index
        with Client(self.grpc_address, api_key=self.api_key, retry=NO_RETRY) as client:
            while not self._stop.is_set():
                call = calls[n % len(calls)]
                adapter = self.adapters[n % len(self.adapters)]
                started = time.time()
                status = call(client, adapter)
                with self._lock:
                    self.outcomes.append(Outcome(started, time.time(), call.__name__.strip("_"), status))
                n += 1

    def _unary(self, client: Client, adapter: str) -> str:
        try:
            client.generate("the quiet king", adapter=adapter, max_new_tokens=8, timeout=15)
            return "OK"
        except ApiError as e:
            return e.code

    def _stream(self, client: Client, adapter: str) -> str:
        try:
            for _ in client.stream("a river runs", adapter=adapter, max_new_tokens=8, timeout=15):
                pass
            return "OK"
        except ApiError as e:
            return e.code

    def _http(self, client: Client, adapter: str, **fields) -> str:
        body = {"model": adapter or self.base_model, "prompt": "the quiet king", "max_tokens": 8, **fields}
        status, _ = http_post(self.http_address, "/v1/completions", body, self.api_key, timeout_s=15)
        return "OK" if status == "200" else f"HTTP {status}"

    def _structured(self, client: Client, adapter: str) -> str:
        return self._http(client, adapter, max_tokens=16, response_format=STRUCTURED)

    def _choices(self, client: Client, adapter: str) -> str:
        return self._http(client, adapter, n=2, logprobs=2, seed=7, temperature=0.8)

    def window(self, start: float, end: float) -> dict:
        """The calls that started in [start, end): counts by status, the successes' latency
        percentiles, and the longest stretch between two successes (or from `start` to the first, or
        the last to `end`)."""
        with self._lock:
            calls = [o for o in self.outcomes if start <= o.started < end]
        statuses = Counter(o.status for o in calls)
        successes = sorted(o.ended for o in calls if o.status == "OK")
        marks = [start, *successes, end]
        longest = max((b - a for a, b in itertools.pairwise(marks)), default=end - start)
        latencies = sorted(o.ended - o.started for o in calls if o.status == "OK")
        return {
            "calls": len(calls),
            "ok": statuses.pop("OK", 0),
            "failed": dict(statuses),
            "longest_without_success_s": round(longest, 2),
            "latency_s": {f"p{q}": _percentile(latencies, q) for q in (50, 99)} | {"max": _percentile(latencies, 100)},
        }


def http_post(address: str, path: str, body: dict, api_key: str, timeout_s: float = 60.0) -> tuple[str, float]:
    """POST `body` as JSON; (the HTTP status or the error's name, seconds)."""
    host, port = address.rsplit(":", 1)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    with closing(http.client.HTTPConnection(host, int(port), timeout=timeout_s)) as connection:
        started = time.time()
        try:
            connection.request("POST", path, json.dumps(body), headers)
            response = connection.getresponse()
            response.read()
            return str(response.status), time.time() - started
        except OSError as e:
            return type(e).__name__, time.time() - started


def _percentile(ordered: list[float], q: int) -> float:
    return round(ordered[round(q / 100 * (len(ordered) - 1))], 3) if ordered else 0.0


# ---- attacks ---------------------------------------------------------------------------------------
def connection_churn(host: str, port: int, cycles: int) -> float:
    """`cycles` plain TCP connect+close cycles (no handshake, no key); returns the seconds taken."""
    started = time.time()
    for _ in range(cycles):
        with socket.create_connection((host, port), timeout=5):
            pass
    return time.time() - started


def big_body(address: str, size: int, api_key: str | None, chunk: int = 1 << 20, timeout_s: float = 60.0) -> dict:
    """POST a `size`-byte body to /v1/completions as fast as the gateway takes it; returns the status
    the gateway answered, the seconds until then and how many bytes it took before answering."""
    host, port = address.rsplit(":", 1)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {size}\r\n"
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    payload = b"x" * chunk
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started, sent = time.time(), 0
        sock.sendall((head + "\r\n").encode())
        sock.setblocking(False)
        answer = b""
        while sent < size and time.time() - started < timeout_s:
            try:
                answer += sock.recv(65536)
                if answer:
                    break
            except BlockingIOError:
                pass
            try:
                sent += sock.send(payload[: min(chunk, size - sent)])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:  # the gateway closed the connection: read what it answered
                break
        sock.setblocking(True)
        sock.settimeout(max(1.0, timeout_s - (time.time() - started)))
        try:
            while b"\r\n" not in answer:
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
        except OSError:
            pass
    line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    status = line.split()[1] if len(line.split()) > 1 else "no answer"
    return {"status": status, "seconds": round(time.time() - started, 2), "bytes_taken": sent}


_HOLDER = r"""
import resource, socket, sys, time
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
host, port, count, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
trickle = sys.argv[5] == "1"
socks, refused = [], 0
for _ in range(count):
    try:
        s = socket.create_connection((host, port), timeout=5)
        s.setblocking(False)
        socks.append(s)
    except OSError:
        refused += 1
end = time.time() + hold
while time.time() < end:
    for s in socks:
        if trickle and s.fileno() >= 0:
            try:
                s.send(b"G")
            except OSError:
                s.close()
    time.sleep(1.0)
open_ = 0
for s in socks:
    if s.fileno() < 0:
        continue
    alive = False
    try:
        while s.recv(65536):  # what the server said (a 503, a 408) before it closed, if it did
            pass
    except BlockingIOError:
        alive = True  # nothing more to read, and no end: still open
    except OSError:
        pass
    open_ += alive
print(f"{len(socks)} {refused} {open_}")
"""


def idle_connections(address: str, total: int, hold_s: float, processes: int = 4) -> dict:
    """Hold `total` connections to `address` for `hold_s` from child processes: half idle, half
    trickling a byte a second of a request head. Returns how many connected, were refused, and were
    still open at the end (a gateway with timeouts closes them)."""
    host, port = address.rsplit(":", 1)
    per = total // processes
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, host, port, str(per), str(hold_s), str(i % 2)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    connected = refused = still_open = 0
    for child in children:
        out, _ = child.communicate(timeout=hold_s + 120)
        c, r, o = (int(x) for x in out.split())
        connected, refused, still_open = connected + c, refused + r, still_open + o
    return {"asked": per * processes, "connected": connected, "refused": refused, "open_at_end": still_open}
