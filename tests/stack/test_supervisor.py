"""Supervision in `loraserve up`: a role that exits or stops answering is restarted.

The restart policy alone on a simulated clock; the Supervisor over real child processes; and a
real `loraserve up` whose worker and gateway are killed: it restarts them and keeps serving.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import free_port_block

from loraserve import internal_auth
from loraserve.launcher.supervisor import CrashLoop, RestartPolicy, Role, SupervisionConfig, Supervisor
from loraserve.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

CONFIG = SupervisionConfig(backoff_s=1.0, max_backoff_s=4.0, stable_after_s=30.0, max_restarts=3, window_s=60.0)


# ---- the policy, on a simulated clock ----------------------------------------------------------
def test_backoff_doubles_up_to_its_cap_and_resets_once_a_role_stayed_up():
    policy = RestartPolicy(SupervisionConfig(backoff_s=1.0, max_backoff_s=4.0, max_restarts=10, window_s=5.0))
    policy.started("w", 0.0)
    delays = []
    now = 0.0
    for _ in range(4):
        delays.append(policy.died("w", now))
        assert not policy.restart_due("w", now + delays[-1] - 0.01)
        now += delays[-1]
        assert policy.restart_due("w", now)
        policy.started("w", now)
        now += 0.1
    assert delays == [1.0, 2.0, 4.0, 4.0]
    policy.started("w", now)
    assert policy.died("w", now + 31.0) == 1.0  # it had stayed up: the backoff starts over


def test_a_role_dying_too_often_is_a_crash_loop():
    policy = RestartPolicy(CONFIG)
    policy.started("scheduler", 0.0)
    for i in range(3):
        policy.died("scheduler", 10.0 * i)
        policy.started("scheduler", 10.0 * i + 5)
    with pytest.raises(CrashLoop, match="scheduler died 4 times within 60 s"):
        policy.died("scheduler", 35.0)
    fresh = RestartPolicy(CONFIG)  # the same deaths spread over more than the window are fine
    fresh.started("scheduler", 0.0)
    for i in range(6):
        fresh.died("scheduler", 40.0 * i)
        fresh.started("scheduler", 40.0 * i + 5)


# ---- the supervisor, over real processes -------------------------------------------------------
def _sleeper(name: str, health: str | None = None) -> Role:
    return Role(name, [sys.executable, "-c", "import time; time.sleep(600)"], health)


def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_role_is_restarted_after_its_backoff_and_the_others_are_left_alone():
    supervisor = Supervisor([_sleeper("a"), _sleeper("b")], SupervisionConfig(backoff_s=0.3))
    supervisor.start()
    try:
        first, other = supervisor.children["a"].pid, supervisor.children["b"].pid
        supervisor.children["a"].send_signal(signal.SIGKILL)
        supervisor.children["a"].wait()
        killed = time.monotonic()

        def restarted() -> bool:
            supervisor.tick()
            return supervisor.children["a"].pid != first

        _until(restarted)
        assert time.monotonic() - killed >= 0.3
        assert supervisor.children["a"].poll() is None and supervisor.children["b"].pid == other
        assert supervisor.restarts == {"a": 1, "b": 0}
    finally:
        supervisor.stop()
    assert all(p.poll() is not None for p in supervisor.children.values())


def test_a_role_that_keeps_exiting_ends_in_a_crash_loop():
    crasher = Role("crasher", [sys.executable, "-c", "raise SystemExit(3)"])
    supervisor = Supervisor([crasher], SupervisionConfig(backoff_s=0.05, max_backoff_s=0.05, max_restarts=2))
    supervisor.start()
    try:
        with pytest.raises(CrashLoop, match="crasher died 3 times"):
            for _ in range(400):
                supervisor.tick()
                time.sleep(0.01)
    finally:
        supervisor.stop()


def test_a_role_that_stops_answering_its_health_check_is_killed_and_restarted():
    silent = _sleeper("silent", f"127.0.0.1:{free_port_block(1)}")  # nothing serves health there
    config = SupervisionConfig(backoff_s=0.05, health_interval_s=0.05, unhealthy_after=2, startup_grace_s=0.2)
    supervisor = Supervisor([silent], config)
    supervisor.start()
    try:
        first = supervisor.children["silent"].pid

        def replaced() -> bool:
            supervisor.tick()
            return supervisor.children["silent"].pid != first

        _until(replaced)
        assert supervisor.restarts["silent"] == 1
    finally:
        supervisor.stop()


def test_stop_drains_group_by_group(tmp_path):
    """The gateway stops (and drains) first, then the workers, then the scheduler and the store."""
    script = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'a').write(sys.argv[2] + ' ' + repr(time.monotonic()) + '\\n')\n"
        "    time.sleep(0.3)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "stops"
    groups = {"adapter-store": 3, "scheduler": 2, "worker-0": 1, "worker-1": 1, "gateway": 0}
    roles = [Role(n, [sys.executable, "-c", script, str(log), n], None, g) for n, g in groups.items()]
    supervisor = Supervisor(roles)
    supervisor.start()
    time.sleep(1.0)  # let the children install their handlers
    supervisor.stop(timeout_s=5.0)
    stopped = [line.split() for line in log.read_text().splitlines()]
    order = [name for name, _ in sorted(stopped, key=lambda s: float(s[1]))]
    assert order[0] == "gateway" and set(order[1:3]) == {"worker-0", "worker-1"}
    assert order[3:] == ["scheduler", "adapter-store"]
    assert all(p.returncode == 0 for p in supervisor.children.values()), "each exited on its own, none killed"


# ---- `loraserve up` ----------------------------------------------------------------------------
def _children(pid: int) -> dict[str, int]:
    """The role of each child process of `pid` -> its pid (roles title themselves loraserve-ROLE)."""
    roles = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(FileNotFoundError):  # a child that just exited
            title = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            for role in ("adapter-store", "scheduler", "worker", "gateway"):
                if f"loraserve-{role}" in title or f"\0{role}\0" in title:
                    roles[role] = int(child)
    return roles


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _generate(address: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        request = gateway_pb2.GenerateRequest(adapter="upper", text="the quiet king", max_new_tokens=6)
        return list(gateway_pb2_grpc.LoraServeStub(channel).Generate(request, timeout=30).token_ids)


def _worker_ready(scheduler: str, keys: Path) -> bool:
    token = internal_auth.load(keys, "gateway").token  # the scheduler's port wants the internal token
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.GetClusterStateRequest()
        state = stub.GetClusterState(request, timeout=2, metadata=[("authorization", f"Bearer {token}")])
    return any(w.ready for w in state.workers)


@pytest.mark.slow
def test_up_restarts_a_killed_worker_and_gateway_and_keeps_serving(tmp_path):
    base = free_port_block(6)
    gateway, scheduler = f"127.0.0.1:{base + 5}", f"127.0.0.1:{base}"
    log_path = tmp_path / "up.log"
    command = [
        sys.executable,
        "-m",
        "loraserve.cli",
        "up",
        "--base-port",
        str(base),
        "--bind",
        gateway,
        "--pool-pages",
        "256",
        "--max-batch-size",
        "8",
        "--worker-timeout",
        "2",
        "--internal-keys",
        str(tmp_path / "keys"),
    ]
    with open(log_path, "w") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _until(lambda: "worker" in _children(up.pid), 30)
        starting = _children(up.pid)["worker"]
        subprocess.run(["kill", "-9", str(starting)], check=True)  # while `up` still waits for health
        _until(lambda: _serving(gateway) and _worker_ready(scheduler, tmp_path / "keys"), 120)
        assert up.poll() is None, "a role that dies during start-up is restarted, not fatal"
        before = _generate(gateway)
        for role in ("worker", "gateway"):
            old = _children(up.pid)[role]
            subprocess.run(["kill", "-9", str(old)], check=True)
            _until(lambda role=role, old=old: _children(up.pid).get(role, old) != old, 30)
            _until(lambda: _serving(gateway) and _worker_ready(scheduler, tmp_path / "keys"), 90)
            assert up.poll() is None
            assert _generate(gateway) == before, f"after the {role} was restarted"
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    output = log_path.read_text()
    assert up.returncode == 0, output[-3000:]
    assert "worker-0 exited with code -9; restarting it" in output
    assert "gateway exited with code -9; restarting it" in output
